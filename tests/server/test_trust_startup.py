"""`carpool serve` checks its stores before it loads a model: a database or batch dir it cannot use stops it at
once with one line naming the path and the cause, never a traceback, never a healthy server that then 500s."""

import sqlite3
import subprocess

import pytest

from carpool.cli import main
from carpool.economics import keys
from carpool.economics.db import connect
from carpool.server.batch.home import OWNER_FILE, BatchDirUnusable, claim_batch_dir, default_batch_dir


class ModelLoaded(AssertionError):
    pass


@pytest.fixture
def no_model(monkeypatch):
    """Loading a model fails the test: every check under test must come before it."""
    import carpool.server.app  # noqa: F401  (imported first, so it holds the real class for its annotations)
    from carpool.engine import async_engine

    def refuse(*args, **kwargs):
        raise ModelLoaded("the model started loading before the stores were checked")

    monkeypatch.setattr(async_engine, "AsyncEngine", refuse)


def serve(capsys, db, *args) -> str:
    """Run `carpool serve` until it stops; its one line of complaint."""
    assert main(["serve", "--db", str(db), *args]) == 2
    complaint = capsys.readouterr().err.strip()
    assert len(complaint.splitlines()) == 1, complaint
    return complaint


def read_only(path, monkeypatch_cleanup: list) -> None:
    """Make `path` unwritable, for root too (chmod alone does not stop root); skip if this machine can't."""
    path.chmod(0o555 if path.is_dir() else 0o444)
    monkeypatch_cleanup.append(lambda: path.chmod(0o755 if path.is_dir() else 0o644))
    if _writable(path) and subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode == 0:
        monkeypatch_cleanup.append(lambda: subprocess.run(["chattr", "-i", str(path)], check=True))
    if _writable(path):
        pytest.skip("cannot make a path read-only here")


def _writable(path) -> bool:
    probe = path / "probe" if path.is_dir() else path
    try:
        with open(probe, "a"):
            pass
    except OSError:
        return False
    if path.is_dir():
        probe.unlink()
    return True


@pytest.fixture
def undo():
    steps = []
    yield steps
    for step in reversed(steps):
        step()


def test_a_file_that_is_not_a_database(capsys, tmp_path, no_model):
    db = tmp_path / "carpool.db"
    db.write_bytes(b"this is not a database, just some bytes" * 100)
    complaint = serve(capsys, db)
    assert str(db) in complaint and "not a database" in complaint


def test_a_keys_table_that_is_not_carpools(capsys, tmp_path, no_model):
    db = tmp_path / "carpool.db"
    connect(db).close()
    with sqlite3.connect(db) as conn:
        conn.executescript("DROP TABLE keys; CREATE TABLE keys (key_id TEXT, secret TEXT);")
    complaint = serve(capsys, db)
    assert str(db) in complaint and "table keys" in complaint


def test_a_damaged_keys_table(capsys, tmp_path, no_model):
    db = tmp_path / "carpool.db"
    conn = connect(db)
    keys.create_key(conn, "acme")
    page_size = conn.execute("PRAGMA page_size").fetchone()[0]
    root_page = conn.execute("SELECT rootpage FROM sqlite_master WHERE name = 'keys'").fetchone()[0]
    conn.close()  # the last connection checkpoints the WAL into the file
    with open(db, "r+b") as data:
        data.seek((root_page - 1) * page_size)
        data.write(b"\xff" * page_size)
    complaint = serve(capsys, db)
    assert str(db) in complaint and ("integrity" in complaint or "malformed" in complaint)


def test_a_read_only_database(capsys, tmp_path, no_model, undo):
    db = tmp_path / "carpool.db"
    connect(db).close()
    read_only(db, undo)
    complaint = serve(capsys, db)
    assert str(db) in complaint and "readonly" in complaint


def test_a_full_disk(capsys, tmp_path, no_model, monkeypatch):
    def full(*args, **kwargs):
        raise sqlite3.OperationalError("database or disk is full")

    monkeypatch.setattr(sqlite3, "connect", full)
    db = tmp_path / "carpool.db"
    complaint = serve(capsys, db)
    assert complaint == f"carpool: {db}: database or disk is full"


def test_a_read_only_batch_dir_fails_before_the_model_loads(capsys, tmp_path, no_model, undo):
    batches = tmp_path / "batches"
    batches.mkdir()
    read_only(batches, undo)
    complaint = serve(capsys, tmp_path / "carpool.db", "--batch-dir", str(batches))
    assert str(batches) in complaint


def test_the_default_batch_dir_belongs_to_its_database(tmp_path, monkeypatch):
    monkeypatch.delenv("CARPOOL_BATCH_DIR", raising=False)
    first, second = tmp_path / "a" / "carpool.db", tmp_path / "b" / "carpool.db"
    assert default_batch_dir(first) != default_batch_dir(second)
    assert default_batch_dir(first).parent == first.parent


def test_a_batch_dir_claimed_by_another_database_is_refused(capsys, tmp_path, no_model):
    shared = tmp_path / "batches"
    first, second = tmp_path / "first.db", tmp_path / "second.db"
    claim_batch_dir(shared, first)
    claim_batch_dir(shared, first)  # its own database again: a restart
    assert (shared / OWNER_FILE).read_text().strip() == str(first.resolve())
    complaint = serve(capsys, second, "--batch-dir", str(shared))
    assert str(shared) in complaint and str(first.resolve()) in complaint


def test_a_server_without_a_ledger_never_runs_a_ledgers_batches(tmp_path, monkeypatch):
    """An --api-key server bills nothing: its default dir is its own, and a ledger's dir is refused to it."""
    monkeypatch.delenv("CARPOOL_BATCH_DIR", raising=False)
    db = tmp_path / "carpool.db"
    assert default_batch_dir(db, ledger=False) != default_batch_dir(db)
    claim_batch_dir(tmp_path / "batches", db)
    with pytest.raises(BatchDirUnusable, match="holds the batches of the database"):
        claim_batch_dir(tmp_path / "batches", None)


def test_one_running_server_per_batch_dir(tmp_path):
    """Two live servers on one database would each resume, run and bill the same batches."""
    db = tmp_path / "carpool.db"
    lock = claim_batch_dir(tmp_path / "batches", db)
    with pytest.raises(BatchDirUnusable, match="in use by another running carpool server"):
        claim_batch_dir(tmp_path / "batches", db)
    lock.close()  # that server stopped
    claim_batch_dir(tmp_path / "batches", db).close()


def test_the_checks_pass_a_sound_store(tmp_path, no_model):
    """The control: with a sound database and batch dir, serve goes on to load the model."""
    with pytest.raises(ModelLoaded):
        main(["serve", "--db", str(tmp_path / "carpool.db"), "--batch-dir", str(tmp_path / "batches")])

"""Where a server's batches live, and the database they belong to.

A batch dir's files and batches are billed to one economics database. Two servers with different databases
sharing one dir would list each other's files under same-named tenants and run each other's batches, billing
them in both. So the default dir sits beside the database (`<db>.batches`), and a dir names the database that
owns it in its `database` file: a server with another database refuses it at start-up. A server with fixed
`--api-key`s keeps no ledger, so its batches are billed nowhere: its dir is its own (`<db>.api-key-batches`),
owned by no database, and never one a ledger's server runs. And a dir is run by one live server at a time (an
exclusive lock held while it serves), or two servers on one database would run, and bill, each batch twice.

Replicas sharing a PostgreSQL `--db` share its batch dir instead: the metadata lives in that database, and each
batch is claimed there by the one server running it (BatchStore.claim), so no dir lock is taken. The dir must
then be one every replica mounts (`--batch-dir` on shared storage for replicas on several machines).
"""

import fcntl
import hashlib
import os
import sqlite3
import tempfile
from pathlib import Path

from carpool import postgres
from carpool.models.loader import cache_dir
from carpool.server.batch.store import BatchStore

OWNER_FILE = "database"
LOCK_FILE = "lock"
NO_LEDGER = "none (a server with fixed --api-key keys, which keeps no ledger)"


class BatchDirUnusable(ValueError):
    """The batch dir cannot be used by this server: `<dir>: <cause>`."""


def default_batch_dir(db_path: str | Path, ledger: bool = True) -> Path:
    """`CARPOOL_BATCH_DIR`, else `<db>.batches` beside the database (`<db>.api-key-batches` without a ledger); for
    a PostgreSQL database, a folder named after it in carpool's cache folder (replicas on this machine share it)."""
    override = os.environ.get("CARPOOL_BATCH_DIR")
    if override:
        return Path(override)
    kind = "batches" if ledger else "api-key-batches"
    if postgres.is_postgres_url(str(db_path)):
        digest = hashlib.sha256(postgres.redacted(str(db_path)).encode()).hexdigest()[:16]
        return cache_dir() / f"postgres-{digest}.{kind}"
    return Path(f"{db_path}.{kind}")


def claim_batch_dir(batch_dir: str | Path, db_path: str | Path | None):
    """Run before the model loads: the dir exists (created if need be), can be written, its store opens, it
    belongs to `db_path` (None: no ledger; a dir nobody owns yet is claimed), and no other live server runs it.
    Returns the lock: the dir stays this process's while the returned file is open. A PostgreSQL `db_path` shares
    the dir with its other servers: nothing is locked (the returned object's close does nothing)."""
    root = Path(batch_dir)
    shared = postgres.is_postgres_url(str(db_path))
    if db_path is None:
        database = NO_LEDGER
    elif shared:
        database = postgres.redacted(str(db_path))
    else:
        database = str(Path(db_path).expanduser().resolve())
    try:
        root.mkdir(parents=True, exist_ok=True)
        marker = root / OWNER_FILE
        if marker.exists():
            owner = marker.read_text(encoding="utf-8").strip()
            if owner != database:
                raise BatchDirUnusable(
                    f"{root}: holds the batches of the database {owner}, not {database}; give this server a "
                    f"--batch-dir of its own (or delete {marker} if that database is gone)"
                )
        else:
            _write_atomically(marker, database + "\n")
        if shared:
            lock = _Unlocked()
        else:
            lock = open(root / LOCK_FILE, "a")
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                lock.close()
                raise BatchDirUnusable(
                    f"{root}: in use by another running carpool server; give this one a --batch-dir of its own"
                ) from None
        store = BatchStore(root, str(db_path) if shared else None)
        try:
            store.check_writable()
        finally:
            store.close()
        return lock
    except (OSError, sqlite3.Error, *(postgres.errors() if shared else ())) as error:  # noqa: B030 (a tuple)
        cause = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
        raise BatchDirUnusable(f"{root}: {cause}") from None


class _Unlocked:
    """What a shared dir's claim holds: nothing (each batch is claimed in the database instead)."""

    def close(self) -> None:
        pass


def _write_atomically(path: Path, text: str) -> None:
    with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, encoding="utf-8") as out:
        out.write(text)
    os.replace(out.name, path)

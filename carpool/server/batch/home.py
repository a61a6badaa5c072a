"""Where a server's batches live, and the database they belong to.

A batch dir's files and batches are billed to one economics database. Two servers with different databases
sharing one dir would list each other's files under same-named tenants and run each other's batches, billing
them in both. So the default dir sits beside the database (`<db>.batches`), and a dir names the database that
owns it in its `database` file: a server with another database refuses it at start-up.
"""

import os
import sqlite3
import tempfile
from pathlib import Path

from carpool.server.batch.store import BatchStore

OWNER_FILE = "database"


class BatchDirUnusable(ValueError):
    """The batch dir cannot be used by this server: `<dir>: <cause>`."""


def default_batch_dir(db_path: str | Path) -> Path:
    """`CARPOOL_BATCH_DIR`, else `<db>.batches` beside the database."""
    override = os.environ.get("CARPOOL_BATCH_DIR")
    return Path(override) if override else Path(f"{db_path}.batches")


def claim_batch_dir(batch_dir: str | Path, db_path: str | Path) -> None:
    """Run before the model loads: the dir exists (created if need be), can be written, its store opens, and it
    belongs to `db_path` (a dir no database owns yet is claimed for it)."""
    root = Path(batch_dir)
    database = str(Path(db_path).expanduser().resolve())
    try:
        root.mkdir(parents=True, exist_ok=True)
        marker = root / OWNER_FILE
        if marker.exists():
            owner = marker.read_text(encoding="utf-8").strip()
            if owner != database:
                raise BatchDirUnusable(
                    f"{root}: holds the batches of the database {owner}, not {database}; give this server a "
                    f"--batch-dir of its own (or delete {marker} if that database is gone)")
        else:
            _write_atomically(marker, database + "\n")
        store = BatchStore(root)
        try:
            store.check_writable()
        finally:
            store.close()
    except (OSError, sqlite3.Error) as error:
        cause = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
        raise BatchDirUnusable(f"{root}: {cause}") from None


def _write_atomically(path: Path, text: str) -> None:
    with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, encoding="utf-8") as out:
        out.write(text)
    os.replace(out.name, path)

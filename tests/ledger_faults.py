"""A ledger database whose disk fills up and frees again on the test's word, through SQLite's own error."""

import sqlite3

from carpool.economics import ledger


class DiskFull(sqlite3.Connection):
    """The ledger writer's connection: its inserts fail as SQLite's do on a full disk while `full` is set."""

    full = True

    def execute(self, sql, *args):
        if DiskFull.full and sql.startswith("INSERT INTO ledger"):
            raise sqlite3.OperationalError("database or disk is full")
        return super().execute(sql, *args)


def fill_disk(monkeypatch) -> type[DiskFull]:
    """From now on, ledger writers opened in this test write through DiskFull (full until told otherwise) and
    retry every 50 ms. Set `DiskFull.full = False` to free the disk."""
    monkeypatch.setattr(DiskFull, "full", True)
    monkeypatch.setattr(
        ledger, "connect", lambda path: sqlite3.connect(path, factory=DiskFull, check_same_thread=False)
    )
    monkeypatch.setattr(ledger, "RETRY_SECONDS", 0.05)
    return DiskFull

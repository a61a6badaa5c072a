"""A ledger written before the second wave's columns existed opens, keeps its rows, and passes the server's check."""

import sqlite3

from carpool.economics.db import ADDED_COLUMNS, SCHEMA, check_database, connect


def _first_wave_schema() -> str:
    """SCHEMA as it was: without the added columns (and the comment line above them)."""
    added = {column.split()[0] for columns in ADDED_COLUMNS.values() for column in columns}
    lines = [
        line
        for line in SCHEMA.splitlines()
        if line.split()[:1] and line.split()[0] not in added and not line.lstrip().startswith("-- Added")
    ]
    return "\n".join(lines).replace("cost REAL NOT NULL,", "cost REAL NOT NULL")


def test_an_old_ledger_gains_the_new_columns_and_keeps_its_rows(tmp_path):
    path = tmp_path / "old.db"
    old = sqlite3.connect(path)
    old.executescript(_first_wave_schema())
    old.execute(
        "INSERT INTO ledger (time, model, tier, uncached_prompt_tokens, cache_read_tokens, cache_write_tokens,"
        " output_tokens, queue_seconds, prefill_seconds, decode_seconds, finish_reason, cost)"
        " VALUES (1, 'm', 'default', 10, 0, 0, 5, 0, 0, 0, 'stop', 0.5)"
    )
    old.commit()
    old.close()

    conn = connect(path)
    check_database(conn, path)  # the server's own check: would refuse a ledger whose columns differ
    (row,) = conn.execute("SELECT * FROM ledger").fetchall()
    assert row["cost"] == 0.5 and row["purpose"] == "request" and row["parent_request_id"] is None

"""A ledger written before the second wave's columns existed opens, keeps its rows, and passes the server's check."""

import sqlite3

from carpool.economics.db import ADDED_COLUMNS, SCHEMA, check_database, connect
from carpool.economics.keys import ADMIN_SCOPES, get_key


def _first_wave_schema() -> str:
    """SCHEMA as it was: without the added columns (and the comment line above them)."""
    added = {column.split()[0] for columns in ADDED_COLUMNS.values() for column in columns}
    lines = [
        line
        for line in SCHEMA.splitlines()
        if line.split()[:1] and line.split()[0] not in added and not line.lstrip().startswith("-- Added")
    ]
    return (
        "\n".join(lines).replace("cost REAL NOT NULL,", "cost REAL NOT NULL").replace("revoked REAL,", "revoked REAL")
    )


def test_an_old_ledger_gains_the_new_columns_and_keeps_its_rows(tmp_path):
    path = tmp_path / "old.db"
    old = sqlite3.connect(path)
    old.executescript(_first_wave_schema())
    old.execute(
        "INSERT INTO ledger (time, model, tier, uncached_prompt_tokens, cache_read_tokens, cache_write_tokens,"
        " output_tokens, queue_seconds, prefill_seconds, decode_seconds, finish_reason, cost)"
        " VALUES (1, 'm', 'default', 10, 0, 0, 5, 0, 0, 0, 'stop', 0.5)"
    )
    old.execute(  # an admin key made before scopes: its scopes column arrives empty (NULL)
        "INSERT INTO keys (key_id, key_hash, tenant, is_admin, created) VALUES ('key_old', 'h', 'ops', 1, 1)"
    )
    old.commit()
    old.close()

    conn = connect(path)
    check_database(conn, path)  # the server's own check: would refuse a ledger whose columns differ
    (row,) = conn.execute("SELECT * FROM ledger").fetchall()
    assert row["cost"] == 0.5 and row["purpose"] == "request" and row["parent_request_id"] is None
    # It keeps what an admin could do, the usage reports and every tenant's batches, but not their files (prompts).
    assert get_key(conn, "key_old").scopes == ADMIN_SCOPES == {"usage:read", "batches:read-all"}

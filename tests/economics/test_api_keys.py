import sqlite3

import pytest

from carpool.economics import keys
from carpool.economics.db import connect, default_db_path


@pytest.fixture
def conn(db_path):
    conn = connect(db_path)
    yield conn
    conn.close()


def test_secret_is_stored_only_as_its_hash(conn, db_path):
    key, secret = keys.create_key(conn, "acme")
    assert secret.startswith("sk-cp-") and len(secret) > 40
    dump = "\n".join(connect(db_path).iterdump())
    assert secret not in dump
    assert keys.hash_secret(secret) in dump
    assert keys.find_key(conn, secret) == key
    assert keys.find_key(conn, secret + "x") is None


def test_create_stores_tiers_budget_and_limits(conn):
    key, _ = keys.create_key(
        conn,
        "acme",
        scopes=["files:read-all"],
        allowed_tiers=["flex", "priority"],
        budget=10,
        budget_period="day",
        rpm=5,
        tpm=100,
    )
    assert key.allowed_tiers == frozenset({"flex", "priority"})
    assert (key.scopes == {"files:read-all"}, key.budget, key.budget_period, key.rpm, key.tpm) == (
        True,
        10.0,
        "day",
        5,
        100,
    )
    assert keys.list_keys(conn) == [key]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"allowed_tiers": ["gold"]}, "tiers must be"),
        ({"allowed_tiers": []}, "tiers must be"),
        ({"budget": -1, "budget_period": "day"}, "must not be negative"),
        ({"budget": 1, "budget_period": "week"}, "budget period must be"),
        ({"budget_period": "day"}, "needs a budget amount"),
        ({"rpm": 0}, "rpm must be a positive"),
    ],
)
def test_create_rejects_bad_settings(conn, kwargs, message):
    with pytest.raises(ValueError, match=message):
        keys.create_key(conn, "acme", **kwargs)


def test_revoke_and_set_budget(conn):
    key, _ = keys.create_key(conn, "acme")
    assert keys.set_budget(conn, key.key_id, 3.5, "month").budget == 3.5
    assert keys.set_budget(conn, key.key_id, None, None).budget is None
    assert keys.revoke_key(conn, key.key_id).revoked is not None
    with pytest.raises(ValueError, match="no key with id"):
        keys.revoke_key(conn, "key_missing")


def test_revoked_keys_still_count_as_configured(conn):
    assert not keys.has_keys(conn)
    key, _ = keys.create_key(conn, "acme")
    keys.revoke_key(conn, key.key_id)
    assert keys.has_keys(conn)


def test_default_db_path_follows_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("CARPOOL_DB", str(tmp_path / "x.db"))
    assert default_db_path() == tmp_path / "x.db"
    monkeypatch.delenv("CARPOOL_DB")
    monkeypatch.setenv("CARPOOL_CACHE_DIR", str(tmp_path / "cache"))
    assert default_db_path() == tmp_path / "cache" / "carpool.db"


def test_database_is_in_wal_mode(conn):
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert isinstance(conn, sqlite3.Connection)

"""Stored responses on both databases: SQLite in the batch dir (one server) and PostgreSQL (replicas sharing
`--db`, started by the suite: conftest.postgres_server): a row is its key's alone, survives a reopen, and goes
when deleted."""

import pytest

from carpool.server.responses_api.store import ResponseStore

RESPONSE = {"id": "resp_1", "created_at": 1700000000, "output": [{"type": "message", "role": "assistant"}]}
CONTEXT = [{"role": "user", "content": "Hi"}]


@pytest.fixture(params=["sqlite", "postgresql"])
def reopen(request, tmp_path):
    """A function that opens the store anew, as a restarted server (or another replica) would."""
    db = request.getfixturevalue("postgres_url") if request.param == "postgresql" else None
    opened = []

    def open_store() -> ResponseStore:
        opened.append(ResponseStore(tmp_path, db))
        return opened[-1]

    yield open_store
    for store in opened:
        store.close()
    assert (tmp_path / "responses.db").exists() == (db is None)  # on PostgreSQL, nothing in the batch dir


def test_a_response_is_its_keys_alone_and_deletable(reopen):
    store = reopen()
    store.save("key-a", RESPONSE, CONTEXT)
    assert reopen().get("key-a", "resp_1") == (RESPONSE, CONTEXT)
    assert store.get("key-b", "resp_1") is None and store.get(None, "resp_1") is None
    assert not store.delete("key-b", "resp_1") and store.get("key-a", "resp_1") is not None
    assert store.delete("key-a", "resp_1") and reopen().get("key-a", "resp_1") is None
    assert not store.delete("key-a", "resp_1")


def test_an_open_servers_callers_share_one_owner(reopen):
    store = reopen()
    store.save(None, RESPONSE, CONTEXT)
    assert store.get(None, "resp_1") == (RESPONSE, CONTEXT) and store.get("key-a", "resp_1") is None

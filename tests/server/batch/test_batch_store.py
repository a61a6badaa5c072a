import io

import pytest

from carpool.server.batch.store import BatchStore, FileTooLarge


def upload(store: BatchStore, data: bytes = b"{}\n", owner: str | None = "t", max_bytes: int = 1 << 20) -> dict:
    return store.save_file(owner, "in.jsonl", "batch", io.BytesIO(data), max_bytes, 1000)


def test_a_file_over_the_limit_is_refused_and_leaves_nothing_behind(tmp_path):
    store = BatchStore(tmp_path)
    with pytest.raises(FileTooLarge):
        upload(store, b"x" * 101, max_bytes=100)
    assert list(store.files_dir.iterdir()) == []
    assert store.list_files(None, True, None, None, 10, True) == ([], False)


def test_files_list_newest_first_by_owner_with_a_cursor(tmp_path):
    store = BatchStore(tmp_path)
    mine = [upload(store)["id"] for _ in range(5)]
    upload(store, owner="someone else")
    page, more = store.list_files("t", False, None, None, 2, newest_first=True)
    assert [f["id"] for f in page] == mine[::-1][:2] and more
    page, more = store.list_files("t", False, None, page[-1]["id"], 10, newest_first=True)
    assert [f["id"] for f in page] == mine[::-1][2:] and not more
    assert len(store.list_files(None, True, "batch", None, 10, True)[0]) == 6


def test_unregistered_files_are_swept_at_start(tmp_path):
    store = BatchStore(tmp_path)
    kept = upload(store)["id"]
    (store.files_dir / "file-left-by-a-crash").write_bytes(b"partial")
    store.close()
    assert [p.name for p in BatchStore(tmp_path).files_dir.iterdir()] == [kept]


def test_a_custom_id_is_answered_once(tmp_path):
    store = BatchStore(tmp_path)
    file_id = upload(store)["id"]
    batch = store.create_batch(
        owner=None,
        key_id=None,
        tenant=None,
        endpoint="/v1/completions",
        input_file_id=file_id,
        completion_window="24h",
        metadata={"k": "v"},
        created_at=1,
        expires_at=2,
    )
    assert store.add_result(batch["id"], 1, "a", True, {"custom_id": "a"})
    assert not store.add_result(batch["id"], 1, "a", True, {"custom_id": "a"})
    assert not store.add_result(batch["id"], 2, "a", False, {"custom_id": "a"})
    assert store.get_batch(batch["id"])["completed"] == 1
    assert store.file_in_use(file_id)


def test_a_transition_only_happens_from_the_allowed_states(tmp_path):
    store = BatchStore(tmp_path)
    batch = store.create_batch(
        owner=None,
        key_id=None,
        tenant=None,
        endpoint="/v1/completions",
        input_file_id="file-x",
        completion_window="24h",
        metadata=None,
        created_at=1,
        expires_at=2,
    )
    assert not store.transition(batch["id"], "finalizing", 5, ("in_progress",))
    assert store.transition(batch["id"], "cancelling", 5, ("validating", "in_progress"))
    row = store.get_batch(batch["id"])
    assert (row["status"], row["cancelling_at"]) == ("cancelling", 5)

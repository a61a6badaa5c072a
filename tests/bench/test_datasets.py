"""The prompt sets ship inside the package: a fresh clone reads them with nothing beside the repository."""

import fnmatch
import json
import tomllib
from pathlib import Path

import carpool
from carpool.bench import datasets

REPO = Path(__file__).resolve().parents[2]


def test_the_shipped_sets_are_read_by_default(monkeypatch):
    monkeypatch.delenv("CARPOOL_DATA_DIR", raising=False)
    package = Path(carpool.__file__).resolve().parent
    assert datasets.data_dir().is_relative_to(package)
    chats = list(datasets.conversations())
    assert len(datasets.first_human_turns()) == len(chats) > 1000
    multi_turn = [chat for chat in chats if len(chat) >= 4]
    assert multi_turn and all(m["role"] == ("user", "assistant")[i % 2] for c in multi_turn for i, m in enumerate(c))
    # The prefix benchmark's defaults: documents of at most 1,500 words, grouped by meeting, 4 meetings.
    meetings = {doc["meeting_id"] for doc in datasets.long_docs() if doc["doc_words"] <= 1500}
    assert len(meetings) >= 4


def test_the_data_files_are_package_data():
    patterns = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["carpool"]
    shipped = [path.relative_to(REPO / "carpool").as_posix() for path in datasets.SHIPPED.iterdir()]
    assert {"chat_prompts.jsonl", "long_docs.jsonl", "README.md"} <= {Path(name).name for name in shipped}
    assert all(any(fnmatch.fnmatch(name, pattern) for pattern in patterns) for name in shipped)


def test_carpool_data_dir_overrides(monkeypatch, tmp_path):
    record = {"conversations": [{"from": "human", "value": "only this"}]}
    (tmp_path / "chat_prompts.jsonl").write_text(json.dumps(record) + "\n")
    monkeypatch.setenv("CARPOOL_DATA_DIR", str(tmp_path))
    assert datasets.first_human_turns() == ["only this"]

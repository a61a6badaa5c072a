"""The official `openai` SDK against a live server: Files and Batches as OpenAI's users call them."""

import json

import openai
import pytest
from batch_server import chat_line, jsonl, result_lines, submit, wait_for_end, wait_until
from live_server import LiveServer

from carpool.cli import main


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    live = LiveServer(home=str(tmp_path_factory.mktemp("home")))
    yield live
    live.stop()


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def test_files_round_trip(client):
    data = jsonl([chat_line("a", "Hi")])
    uploaded = client.files.create(file=("mine.jsonl", data), purpose="batch")
    assert (uploaded.object, uploaded.purpose, uploaded.filename, uploaded.bytes) == (
        "file",
        "batch",
        "mine.jsonl",
        len(data),
    )
    assert client.files.retrieve(uploaded.id).id == uploaded.id
    assert uploaded.id in [f.id for f in client.files.list()]
    assert client.files.content(uploaded.id).content == data
    deleted = client.files.delete(uploaded.id)
    assert deleted.deleted and deleted.id == uploaded.id
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(uploaded.id)


def test_a_chat_batch_completes_with_one_response_per_custom_id(client):
    lines = [chat_line(f"q{i}", f"Name a color, number {i}.") for i in range(6)]
    batch = submit(client, lines, metadata={"job": "colors"})
    assert batch.status == "validating" and batch.object == "batch" and batch.metadata == {"job": "colors"}
    batch = wait_for_end(client, batch.id)
    assert batch.status == "completed", batch
    assert batch.request_counts.model_dump() == {"total": 6, "completed": 6, "failed": 0}
    assert batch.in_progress_at and batch.finalizing_at and batch.completed_at and batch.error_file_id is None
    outputs = result_lines(client, batch.output_file_id)
    assert sorted(line["custom_id"] for line in outputs) == [f"q{i}" for i in range(6)]
    for line in outputs:
        body = line["response"]["body"]
        assert line["response"]["status_code"] == 200 and line["error"] is None
        assert body["object"] == "chat.completion" and body["service_tier"] == "batch"
        assert body["usage"]["completion_tokens"] <= 4 and body["choices"][0]["message"]["content"]
    assert batch.usage.output_tokens == sum(line["response"]["body"]["usage"]["completion_tokens"] for line in outputs)
    assert client.files.retrieve(batch.output_file_id).purpose == "batch_output"
    assert batch.id in [b.id for b in client.batches.list(limit=100)]
    with pytest.raises(openai.ConflictError):
        client.batches.cancel(batch.id)


def test_a_completions_batch_matches_the_live_endpoint(client):
    line = {
        "custom_id": "c",
        "method": "POST",
        "url": "/v1/completions",
        "body": {"prompt": "1, 2, 3,", "max_tokens": 4, "temperature": 0},
    }
    batch = wait_for_end(client, submit(client, [line], endpoint="/v1/completions").id)
    (output,) = result_lines(client, batch.output_file_id)
    model = output["response"]["body"]["model"]
    live = client.completions.create(model=model, prompt="1, 2, 3,", max_tokens=4, temperature=0)
    assert output["response"]["body"]["choices"][0]["text"] == live.choices[0].text


def test_bad_lines_fail_the_batch_naming_each_line(client):
    lines = [
        chat_line("ok", "Hi"),
        "{this is not json",
        chat_line("ok", "Hi again"),
        {**chat_line("elsewhere", "Hi"), "url": "/v1/completions"},
        chat_line("bad-body", "Hi", max_tokens=0),
        {"method": "POST", "url": "/v1/chat/completions", "body": {"messages": []}},
    ]
    batch = wait_for_end(client, submit(client, lines).id)
    assert batch.status == "failed" and batch.failed_at
    assert [(e.line, e.code) for e in batch.errors.data] == [
        (2, "invalid_json_line"),
        (3, "duplicate_custom_id"),
        (4, "invalid_url"),
        (5, "invalid_request"),
        (6, "missing_required_parameter"),
    ]
    assert batch.errors.data[3].param == "body.max_tokens"
    assert batch.output_file_id is None and batch.error_file_id is None


def test_a_request_the_engine_refuses_is_an_error_line(client):
    lines = [chat_line("fits", "Hi"), chat_line("too-long", "Hi", max_tokens=10**7)]
    batch = wait_for_end(client, submit(client, lines).id)
    assert batch.status == "completed"
    assert batch.request_counts.model_dump() == {"total": 2, "completed": 1, "failed": 1}
    (error,) = result_lines(client, batch.error_file_id)
    assert error["custom_id"] == "too-long" and error["response"]["status_code"] == 400
    assert error["response"]["body"]["error"]["code"] == "context_length_exceeded"
    assert [line["custom_id"] for line in result_lines(client, batch.output_file_id)] == ["fits"]


def test_cancel_stops_new_requests_and_keeps_finished_results(client):
    lines = [chat_line(f"r{i}", f"Count to {i}.", max_tokens=8) for i in range(40)]
    batch = submit(client, lines)
    wait_until(client, batch.id, lambda b: b.status != "validating")
    cancelled = client.batches.cancel(batch.id)
    assert cancelled.status in ("cancelling", "cancelled") and cancelled.cancelling_at
    batch = wait_for_end(client, batch.id)
    assert batch.status == "cancelled" and batch.cancelled_at
    outputs, errors = result_lines(client, batch.output_file_id), result_lines(client, batch.error_file_id)
    assert errors and all(line["error"]["code"] == "batch_cancelled" for line in errors)
    assert sorted(line["custom_id"] for line in outputs + errors) == sorted(f"r{i}" for i in range(40))
    assert batch.request_counts.completed == len(outputs) and batch.request_counts.failed == len(errors)
    assert client.batches.cancel(batch.id).status == "cancelled"  # cancelling twice is no error


def test_refusals_are_openai_errors(client):
    with pytest.raises(openai.BadRequestError) as refused:
        client.files.create(file=("x.jsonl", b"{}\n"), purpose="fine-tune")
    assert refused.value.param == "purpose"
    uploaded = client.files.create(file=("x.jsonl", jsonl([chat_line("a", "Hi")])), purpose="batch")
    with pytest.raises(openai.BadRequestError) as refused:
        client.batches.create(input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h")
    assert refused.value.param == "endpoint"
    with pytest.raises(openai.BadRequestError) as refused:
        client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="1h")
    assert refused.value.param == "completion_window"
    with pytest.raises(openai.NotFoundError):
        client.batches.create(input_file_id="file-nope", endpoint="/v1/chat/completions", completion_window="24h")
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_nope")
    with pytest.raises(openai.BadRequestError):
        client.batches.list(limit=101)


def test_the_cli_submits_follows_and_fetches_results(server, tmp_path, capsys):
    path = tmp_path / "requests.jsonl"
    path.write_bytes(jsonl([chat_line("x", "Hi"), chat_line("y", "Hello")]))
    url = ["--url", f"{server.url}/v1", "--poll-interval", "0.1"]
    assert main(["batch", "submit", str(path), "--wait", *url]) == 0
    batch_id = capsys.readouterr().out.strip()
    assert batch_id.startswith("batch_")
    assert main(["batch", "status", batch_id, *url]) == 0
    assert json.loads(capsys.readouterr().out)["status"] == "completed"
    results = tmp_path / "results.jsonl"
    assert main(["batch", "results", batch_id, "-o", str(results), *url]) == 0
    assert sorted(json.loads(line)["custom_id"] for line in results.read_text().splitlines()) == ["x", "y"]
    assert main(["batch", "cancel", batch_id, *url]) == 1
    assert "can no longer be cancelled" in capsys.readouterr().err

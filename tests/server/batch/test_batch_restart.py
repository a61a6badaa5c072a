"""`kill -9` mid-batch, start again on the same batch dir: the batch completes, every custom_id answered once."""

from collections import Counter

from batch_server import chat_line, result_lines, submit, wait_for_end, wait_until
from live_server import LiveServer

NUM_LINES = 8


def test_a_killed_server_finishes_the_batch_after_restart(tmp_path):
    # Two sequence slots make the batch slow enough to be caught half done.
    server = LiveServer("--max-num-seqs", "2", home=str(tmp_path))
    try:
        client = server.client()
        lines = [
            chat_line(f"job-{i}", f"Write a word that starts with {chr(97 + i)}.", max_tokens=6)
            for i in range(NUM_LINES)
        ]
        batch = submit(client, lines)
        midway = wait_until(client, batch.id, lambda b: b.request_counts.completed >= 2)
    finally:
        server.kill()
    assert midway.status == "in_progress" and midway.request_counts.completed < NUM_LINES

    server = server.restart()
    try:
        client = server.client()
        resumed = client.batches.retrieve(batch.id)
        assert resumed.request_counts.completed >= midway.request_counts.completed  # nothing finished was lost
        batch = wait_for_end(client, batch.id)
        assert batch.status == "completed", batch
        assert batch.request_counts.model_dump() == {"total": NUM_LINES, "completed": NUM_LINES, "failed": 0}
        answered = result_lines(client, batch.output_file_id) + result_lines(client, batch.error_file_id)
        assert Counter(line["custom_id"] for line in answered) == Counter(f"job-{i}" for i in range(NUM_LINES))
        assert all(line["response"]["status_code"] == 200 for line in answered)
    finally:
        server.stop()

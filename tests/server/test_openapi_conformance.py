"""schemathesis (pinned in requirements-dev.txt) against a live server's /openapi.json, every check on: no 5xx, every
status and content type the server answers documented, every request the schema calls valid accepted and every
one it calls invalid refused, a 405's `Allow` naming the path's every method, responses matching their schemas.
Bounded (a few examples an operation, a fixed seed) to stay a CI test.

One allowance, on the routes that run or read the model only: a schema-valid body there may still be a 400, for
rules that span fields or need the model, which no JSON schema states (top_logprobs needs logprobs, best_of at
least n, the prompt plus max_tokens within the context, a regex or grammar that compiles, token ids within the
vocabulary, a Messages conversation's turn order, a prompt with something to compress). Every other route's
refusals are in its schema."""

import subprocess
import sys
from pathlib import Path

import pytest
from live_server import LiveServer

SCHEMATHESIS = Path(sys.executable).with_name("st")
CONFIG = """
[[operations]]
include-path = ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages", "/v1/messages/count_tokens",
                "/v1/messages/batches", "/v1/compress", "/tokenize", "/detokenize"]
checks.positive_data_acceptance.expected-statuses = ["2xx", "400", "401", "403", "404", "429", "5xx"]
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # A short context keeps each generated request's output short (schemathesis asks for any max_tokens).
    live = LiveServer("--max-model-len", "64", home=str(tmp_path_factory.mktemp("home")))
    yield live
    live.stop()


@pytest.mark.timeout(900)
def test_the_server_answers_as_its_openapi_schema_says(server, tmp_path):
    config = tmp_path / "schemathesis.toml"
    config.write_text(CONFIG)
    command = [str(SCHEMATHESIS), "--no-color", "--config-file", str(config), "run", f"{server.url}/openapi.json"]
    # Every check; the response time's limit is the machine's, not the schema's (a best_of of 127 is slow).
    options = ["--checks", "all", "--max-examples", "5", "--seed", "48"]
    options += ["--max-response-time", "300", "--request-timeout", "300"]
    run = subprocess.run(command + options, capture_output=True, text=True, timeout=840)
    assert run.returncode == 0, run.stdout[-12000:] + run.stderr[-2000:]

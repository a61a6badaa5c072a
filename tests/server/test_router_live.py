"""A router through `carpool serve --cascades` and the official OpenAI SDK: the routed-to model answers, named in
the headers, and its one ledger row carries the router's name and the routed-to model's index. A prompt-pass
router adds one durable row for its pass, and its cheap answer's row reads the prompt from the prefix cache."""

import os
import sqlite3
import uuid

import pytest
from live_server import LiveServer

from carpool.server.cascade.router import feature_count
from tests.server.test_router import NUMBERS_WEIGHTS, NUMERIC, PLAIN


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from carpool.server.assembly import default_served_name

    served, path = default_served_name(None), tmp_path_factory.mktemp("routers") / "cascades.toml"
    weights = ", ".join(repr(w) for w in NUMBERS_WEIGHTS[0])
    path.write_text(
        f'[[router]]\nname = "route"\nmodels = ["{served}", "{served}"]\nthresholds = [0.5]\n'
        f"weights = [[{weights}]]\nbias = [5.0]\n"
        # always the cheap model (no weight on any feature): what is tested is the pass's row and the cache read
        f'[[router]]\nname = "route-pass"\nmodels = ["{served}", "{served}"]\nfeatures = "prompt-pass"\n'
        f"weights = [[{', '.join(['0.0'] * feature_count('prompt-pass'))}]]\nbias = [5.0]\n"
    )
    live = LiveServer("--cascades", str(path))
    yield live
    live.stop()


@pytest.mark.parametrize("text,step", [(PLAIN, 0), (NUMERIC, 1)])
def test_the_sdk_gets_the_routed_answer_and_one_row(server, text, step):
    raw = server.client().chat.completions.with_raw_response.create(
        model="route", messages=[{"role": "user", "content": text}], max_tokens=4, temperature=0
    )
    completion = raw.parse()
    assert completion.choices[0].message.content
    assert raw.headers["x-carpool-cascade-step"] == str(step)
    assert raw.headers["x-carpool-routed-to"] == completion.model == raw.headers["x-carpool-answered-by"]
    with sqlite3.connect(os.path.join(server.home, "carpool.db")) as conn:
        rows = conn.execute(
            "SELECT purpose, cascade, cascade_step, cascade_accepted FROM ledger WHERE parent_request_id = ?",
            (raw.headers["x-request-id"],),
        ).fetchall()
    assert rows == [("cascade_attempt", "route", step, 1)]


def test_the_prompt_pass_is_one_durable_row_and_the_answer_reads_its_kv(server):
    text = f"Which desk takes this: my parcel never came, order {uuid.uuid4().hex}?"
    raw = server.client().chat.completions.with_raw_response.create(
        model="route-pass", messages=[{"role": "user", "content": text}], max_tokens=4, temperature=0
    )
    assert raw.parse().choices[0].message.content and raw.headers["x-carpool-cascade-step"] == "0"
    client_id = raw.headers["x-request-id"]
    with sqlite3.connect(os.path.join(server.home, "carpool.db")) as conn:
        rows = conn.execute(
            "SELECT request_id, purpose, cascade_step, cascade_accepted, uncached_prompt_tokens + cache_read_tokens,"
            " cache_read_tokens,"
            " output_tokens, cost FROM ledger WHERE parent_request_id = ? ORDER BY request_id",
            (client_id,),
        ).fetchall()
    [answer, passed] = rows  # '#cascade-0' sorts before '#prompt-pass'
    assert passed[:4] == (f"{client_id}#prompt-pass", "cascade_attempt", 0, 0) and passed[5:7] == (0, 1)
    assert answer[:4] == (f"{client_id}#cascade-0", "cascade_attempt", 0, 1) and answer[4] == passed[4]
    assert answer[5] >= (answer[4] - 1) // 16 * 16 > 0 and passed[7] > 0

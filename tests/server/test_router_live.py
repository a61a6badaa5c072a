"""A router through `carpool serve --cascades` and the official OpenAI SDK: the routed-to model answers, named in
the headers, and its one ledger row carries the router's name and the routed-to model's index."""

import os
import sqlite3

import pytest
from live_server import LiveServer

from tests.server.test_router import NUMBERS_WEIGHTS, NUMERIC, PLAIN


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from carpool.server.assembly import default_served_name

    served, path = default_served_name(None), tmp_path_factory.mktemp("routers") / "cascades.toml"
    weights = ", ".join(repr(w) for w in NUMBERS_WEIGHTS[0])
    path.write_text(
        f'[[router]]\nname = "route"\nmodels = ["{served}", "{served}"]\nthresholds = [0.5]\n'
        f"weights = [[{weights}]]\nbias = [5.0]\n"
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

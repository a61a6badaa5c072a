"""`carpool serve --step-log`: the served engine's steps, shape and time, and `carpool cost whatif --steps` fitting
its step model on them."""

import json
import os

import httpx
import pytest

from carpool.bench import whatif
from carpool.bench.simulate import StepModel
from carpool.cli import build_parser
from carpool.engine.step_shape import attention_pairs
from carpool.server.step_log import read_steps
from tests.live_server import LiveServer


def test_the_server_logs_each_step_and_whatif_fits_its_step_model_on_them(tmp_path):
    path = tmp_path / "steps.jsonl"
    server = LiveServer("--step-log", str(path), "--max-num-seqs", "4")
    try:
        model = httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]
        prompts = []
        for text in ("apple " * 3, "river stone " * 20, "blue sky " * 6):  # no two share a first block
            body = {"model": model, "prompt": text, "max_tokens": 5, "temperature": 0}
            answer = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120).json()
            prompts.append(answer["usage"]["prompt_tokens"])
    finally:
        server.stop()  # the log is flushed and closed as the server stops
    steps = read_steps(str(path), model)
    assert read_steps(str(path), "another-model") == []
    # One request at a time, no cache hit: a prompt step each,
    # then four decode steps each reading the request's context so far.
    assert len(steps) == 3 * 5
    for i, prompt in enumerate(prompts):
        first, *decodes = steps[5 * i : 5 * i + 5]
        assert first[:4] == (prompt, 0, 0, attention_pairs(prompt, 0))
        assert [step[:4] for step in decodes] == [(0, 1, prompt + k, 0) for k in range(4)]
        assert all(step[4] > 0 for step in steps)
    # whatif --steps: the step model fitted on exactly these steps, not on a fresh engine here.
    args = build_parser().parse_args(
        ["cost", "whatif", "--db", os.path.join(server.home, "carpool.db"), "--hourly-price", "1"]
        + ["--steps", str(path), "--out", str(tmp_path / "whatif.json")]
    )
    assert whatif.main(args) == 0
    assert json.loads((tmp_path / "whatif.json").read_text())["step_model"] == vars(StepModel.fit(steps))


def test_a_step_log_is_checked(tmp_path):
    path = tmp_path / "steps.jsonl"
    path.write_text('{"time": 1, "model": "m"}\n')
    with pytest.raises(ValueError, match="--steps: .* line 1 is not a `carpool serve --step-log` line"):
        read_steps(str(path), "m")
    with pytest.raises(ValueError, match="--steps: cannot read"):
        read_steps(str(tmp_path / "missing.jsonl"), "m")
    args = build_parser().parse_args(["serve", "--replicas", "2", "--step-log", str(path)])
    with pytest.raises(ValueError, match="--step-log: not with --replicas"):
        args.func(args)

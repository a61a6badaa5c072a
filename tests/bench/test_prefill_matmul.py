"""The prefill bench times one prompt's prefill per matmul mode, each in its own engine."""

from carpool.bench.prefill_matmul import run


def test_each_mode_prefills_the_prompt_cut_to_length():
    report = run("smollm2-135m", tokens=48, modes=["exact", "int8-dot-all"], rounds=1)
    assert report["tokens"] == 48
    assert set(report["seconds"]) == {"exact", "int8-dot-all"}
    assert all(0 < seconds < 60 for seconds in report["seconds"].values())

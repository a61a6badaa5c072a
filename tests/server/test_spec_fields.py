"""The server's side of speculative decoding: the per-request opt-out field and the spec_decode metrics."""

import pytest
from prometheus_client import generate_latest
from pydantic import ValidationError

from carpool.engine.llm_engine import StepStats
from carpool.engine.spec_decode import SpecStepStats
from carpool.server.metrics import ServerMetrics
from carpool.server.protocol import ChatCompletionRequest


def body(**fields) -> dict:
    return {"messages": [{"role": "user", "content": "hi"}], **fields}


def test_speculative_field_reaches_the_sampling_params():
    assert ChatCompletionRequest.model_validate(body(speculative=False)).sampling_options()["speculative"] is False
    assert ChatCompletionRequest.model_validate(body()).sampling_options()["speculative"] is True
    with pytest.raises(ValidationError, match="speculative"):
        ChatCompletionRequest.model_validate(body(speculative="no"))


def test_spec_decode_metrics_are_counted_per_drafter():
    metrics = ServerMetrics(["m"])
    spec = SpecStepStats("ngram", num_drafts=2, num_draft_tokens=6, num_accepted_tokens=4, accepted_lengths=[3, 1])
    stats = StepStats(
        num_tokens=8, num_seqs=2, num_prefill_tokens=0, num_decode_tokens=8, num_preemptions=0, duration=0.01, spec=spec
    )
    metrics.models["m"].on_step(stats, [])
    metrics.models["m"].on_step(stats, [])
    text = generate_latest(metrics.registry).decode()
    assert 'carpool:spec_decode_num_draft_tokens_total{drafter="ngram",model_name="m"} 12.0' in text
    assert 'carpool:spec_decode_num_accepted_tokens_total{drafter="ngram",model_name="m"} 8.0' in text
    assert 'carpool:spec_decode_num_drafts_total{drafter="ngram",model_name="m"} 4.0' in text
    assert 'carpool:spec_decode_accepted_length_bucket{drafter="ngram",le="1.0",model_name="m"} 2.0' in text

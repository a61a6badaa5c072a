"""One tier table (carpool/engine/tiers.py): the API, the scheduler, the price sheet, the key store and the metrics
all agree with it. No model is loaded."""

import pydantic
import pytest
from prometheus_client import generate_latest

from carpool.economics.db import connect
from carpool.economics.keys import create_key, lookup_key
from carpool.economics.prices import load_price_sheet
from carpool.engine.block_manager import BlockManager
from carpool.engine.config import EngineConfig
from carpool.engine.sampling_params import SamplingParams
from carpool.engine.scheduler import Scheduler
from carpool.engine.sequence import Sequence
from carpool.engine.tiers import BATCH_TIER, BY_NAME, DEFAULT_TIER, LIVE_TIERS, TIER_NAMES, TIERS
from carpool.server.metrics import ServerMetrics
from carpool.server.protocol import ChatCompletionRequest, CompletionRequest
from carpool.server.serving import requested_tier

MESSAGES = [{"role": "user", "content": "hi"}]


def test_the_table_is_consistent():
    assert len(set(TIER_NAMES)) == len(TIERS) and len({tier.priority for tier in TIERS}) == len(TIERS)
    # The API's `priority` names a live tier by its number: 0, 1, 2, ... with no gap.
    assert sorted(tier.priority for tier in LIVE_TIERS) == list(range(len(LIVE_TIERS)))
    # The scheduler tells background from foreground by one threshold: background tiers come last.
    background = [tier.priority for tier in TIERS if tier.background]
    assert background and min(background) > max(tier.priority for tier in TIERS if not tier.background)
    assert BY_NAME[DEFAULT_TIER].live and not BY_NAME[BATCH_TIER].live and BY_NAME[BATCH_TIER].background


@pytest.mark.parametrize(
    "request_model, body", [(ChatCompletionRequest, {"messages": MESSAGES}), (CompletionRequest, {"prompt": "hi"})]
)
def test_the_api_offers_exactly_the_live_tiers(request_model, body):
    for tier in TIERS:
        if tier.live:
            request = request_model(**body, service_tier=tier.name)
            assert requested_tier(request) == tier.name
            assert requested_tier(request_model(**body, priority=tier.priority)) == tier.name
        else:  # reached only through the Batch API: no body may name it
            with pytest.raises(pydantic.ValidationError):
                request_model(**body, service_tier=tier.name)
            with pytest.raises(pydantic.ValidationError):
                request_model(**body, priority=tier.priority)
    assert (
        requested_tier(request_model(**body))
        == requested_tier(request_model(**body, service_tier="auto"))
        == DEFAULT_TIER
    )


def test_the_price_sheet_and_key_store_know_every_tier(tmp_path):
    assert load_price_sheet().tiers == {tier.name: tier.price_multiplier for tier in TIERS}
    with connect(tmp_path / "carpool.db") as conn:
        key, _ = create_key(conn, "acme", allowed_tiers=list(TIER_NAMES))
        assert lookup_key(conn, key.key_id).allowed_tiers == frozenset(TIER_NAMES)


def test_metrics_have_a_series_for_every_tier():
    text = generate_latest(ServerMetrics(["m"]).registry).decode()
    for name in TIER_NAMES:
        assert f'carpool:generation_tokens_total{{model_name="m",tier="{name}"}} 0.0' in text


@pytest.mark.parametrize("tier", TIERS, ids=TIER_NAMES)
def test_the_scheduler_holds_back_exactly_the_background_tiers(tier):
    """A tier's decode sits out a step that computes a foreground prompt if, and only if, it is background."""
    scheduler = Scheduler(EngineConfig(max_num_seqs=4, max_num_batched_tokens=64), BlockManager(64, 16, False))
    decoding = Sequence("decoding", list(range(100, 108)), SamplingParams(max_tokens=50), priority=tier.priority)
    scheduler.add(decoding)
    batch = scheduler.schedule()  # its prompt; then pretend the model ran and sampled a token
    decoding.num_computed_tokens += batch.num_new_tokens[0]
    decoding.token_ids.append(7)
    top = min(TIERS, key=lambda t: t.priority)
    scheduler.add(Sequence("prompt", list(range(200, 220)), SamplingParams(max_tokens=5), priority=top.priority))
    assert (decoding in scheduler.schedule().seqs) == (not tier.background)

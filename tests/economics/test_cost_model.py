import json
import math

import pytest
import torch
from economics_helpers import FOOTPRINT, HARDWARE, PHASES
from prometheus_client import CollectorRegistry, generate_latest
from safetensors.torch import save_file

from carpool.economics.cost_model import cost_model, render
from carpool.economics.footprint import model_footprint
from carpool.economics.hardware import measure_bandwidth, measure_flops
from carpool.economics.phase_meter import (
    PhaseMeter,
    PhaseTotals,
    totals_from_metrics_text,
)
from carpool.economics.prices import ModelPrice, PriceSheet
from carpool.economics.suggested_prices import below_cost, suggest
from carpool.economics.suggested_prices import render as render_suggested
from carpool.engine.llm_engine import StepStats
from carpool.engine.outputs import RequestOutput
from carpool.engine.tiers import TIER_NAMES


def test_cost_per_million_tokens_per_tier(prices):
    # $3.60/hour = $0.001/s. Prefill 10k tokens/s: $0.1 per 1M; decode 500 tokens/s: $2 per 1M.
    model = cost_model(PHASES, 3.60, HARDWARE, FOOTPRINT, prices)
    assert (model.prefill_tokens_per_second, model.decode_tokens_per_second) == (10_000, 500)
    by_tier = {
        t.tier: (t.input_per_1m, t.output_per_1m, t.list_input_per_1m, t.list_output_per_1m) for t in model.tiers
    }
    assert by_tier == {
        "priority": pytest.approx((0.2, 4.0, 2.0, 8.0)),
        "default": pytest.approx((0.1, 2.0, 1.0, 4.0)),
        "flex": pytest.approx((0.05, 1.0, 0.5, 2.0)),
        "batch": pytest.approx((0.05, 1.0, 0.5, 2.0)),
    }


def test_decode_step_against_its_floors(prices):
    # Bytes: 400 MB of weights + 16 x 500 x 40 kB of KV = 720 MB -> 7.2 ms at 100 GB/s.
    # FLOPs: 16 x (2 x 100M + 500 x 50k) = 3.6 GFLOP -> 3.6 ms at 1 TFLOP/s. Measured: 30 ms.
    decode = cost_model(PHASES, 3.60, HARDWARE, FOOTPRINT, prices).decode
    assert (decode.step_seconds, decode.batch_size, decode.context_tokens) == (0.03, 16, 500)
    assert decode.bytes_per_step == 720_000_000 and decode.flops_per_step == 3_600_000_000
    assert decode.bandwidth_floor_seconds == pytest.approx(0.0072)
    assert decode.compute_floor_seconds == pytest.approx(0.0036)
    assert decode.bound == "memory bandwidth"
    assert decode.efficiency == pytest.approx(0.24)


def test_render_table_and_json(prices):
    model = cost_model(PHASES, 3.60, HARDWARE, FOOTPRINT, prices)
    table = render(model, "table")
    assert "priority" in table and "7.20 ms" in table and "bound by memory bandwidth" in table
    assert json.loads(render(model, "json"))["decode"]["efficiency"] == pytest.approx(0.24)


def test_refuses_empty_measurements_and_bad_price(prices):
    with pytest.raises(ValueError, match="no prefill or no decode"):
        cost_model(PhaseTotals(), 1.0, HARDWARE, FOOTPRINT, prices)
    with pytest.raises(ValueError, match="hourly price"):
        cost_model(PHASES, 0, HARDWARE, FOOTPRINT, prices)


def output(prompt_len: int, output_len: int) -> RequestOutput:
    return RequestOutput("r", [0] * prompt_len, [0] * output_len, "", finished=False)


def test_phase_meter_splits_mixed_steps_by_tokens_and_exports_totals():
    meter = PhaseMeter()
    meter(StepStats(100, 1, 100, 0, 0, duration=1.0), [output(100, 1)])  # prefill only
    meter(StepStats(100, 11, 90, 10, 0, duration=0.5), [output(90, 1)] + [output(10, 5)] * 10)  # 90% prefill
    meter(StepStats(4, 4, 0, 4, 0, duration=0.2), [output(10, 5)] * 4)  # decode only: context 15 each
    meter(None, [output(10, 5)])  # an abort computes nothing
    expected = PhaseTotals(
        prefill_tokens=190,
        prefill_seconds=1.45,
        decode_tokens=14,
        decode_seconds=0.25,
        decode_steps=1,
        decode_step_seconds=0.2,
        decode_step_sequences=4,
        decode_step_context_tokens=60,
    )
    totals = meter.totals()
    assert totals.as_dict() == pytest.approx(expected.as_dict())
    registry = CollectorRegistry()
    meter.register_metrics(registry)
    assert totals_from_metrics_text(generate_latest(registry).decode()).as_dict() == pytest.approx(expected.as_dict())
    assert PhaseTotals.from_dict(json.loads(json.dumps(totals.as_dict()))) == totals


def test_metrics_without_the_meter_are_refused():
    with pytest.raises(ValueError, match="PhaseMeter"):
        totals_from_metrics_text("# HELP x y\n# TYPE x counter\nx_total 1.0\n")


def tiny_llama(directory, tied: bool):
    """2 layers, hidden 4, 2 heads of 2 (1 KV head), MLP 8, vocab 10."""
    config = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 10,
        "hidden_size": 4,
        "intermediate_size": 8,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 2,
        "tie_word_embeddings": tied,
    }
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    shapes = {"model.embed_tokens.weight": (10, 4), "model.norm.weight": (4,)}
    for i in range(2):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (4, 4),
            p + "self_attn.k_proj.weight": (2, 4),
            p + "self_attn.v_proj.weight": (2, 4),
            p + "self_attn.o_proj.weight": (4, 4),
            p + "mlp.gate_proj.weight": (8, 4),
            p + "mlp.up_proj.weight": (8, 4),
            p + "mlp.down_proj.weight": (4, 8),
            p + "input_layernorm.weight": (4,),
            p + "post_attention_layernorm.weight": (4,),
        }
    if not tied:
        shapes["lm_head.weight"] = (10, 4)
    save_file({name: torch.zeros(shape) for name, shape in shapes.items()}, str(directory / "model.safetensors"))
    return directory


@pytest.mark.parametrize("tied", [False, True])
def test_footprint_counts_weights_streamed_and_flops(tmp_path, tied):
    # Per layer: attention 16 + 8 + 8 + 16, MLP 3 x 32, norms 8 = 152; x 2 layers = 304 (288 in matrices).
    # Embedding 40, final norm 4, untied head 40. Matmuls: 288 + the output head's 40 (tied: the embedding's).
    footprint = model_footprint(str(tiny_llama(tmp_path / f"tiny-{tied}", tied)))
    assert footprint.name == f"tiny-{tied}"
    assert footprint.parameters == (348 if tied else 388)
    assert footprint.matmul_parameters == 328
    assert footprint.streamed_bytes_per_step == 348 * 4  # everything but the lookup-only embedding table
    assert footprint.kv_bytes_per_token == 2 * 2 * 1 * 2 * 4  # layers x (k, v) x kv heads x head_dim x fp32
    assert footprint.attention_flops_per_context_token == 4 * 2 * 2 * 2  # 4 x layers x heads x head_dim
    assert footprint.matmul_flops_per_token() == 656


def test_footprint_counts_the_weight_format_the_engine_runs():
    """SmolLM2's GGUF: Q4_1 projections and a Q8_0 tied embedding/head, counted at their block sizes (read from
    the GGUF file itself here), the fp32 norms at the serving dtype; KV at the serving dtype."""
    import gguf

    from carpool.models.loader import default_model_path

    reader = gguf.GGUFReader(default_model_path())
    blocks = sum(int(t.n_bytes) for t in reader.tensors if t.tensor_type != gguf.GGMLQuantizationType.F32)
    norms = sum(int(t.n_elements) for t in reader.tensors if t.tensor_type == gguf.GGMLQuantizationType.F32)
    served = model_footprint(None, torch.bfloat16, "auto")
    assert served.streamed_bytes_per_step == blocks + 2 * norms
    dense = model_footprint(None, torch.bfloat16, "none")
    assert dense.streamed_bytes_per_step == 2 * dense.parameters  # tied: the table is streamed as the head
    assert served.streamed_bytes_per_step < 0.4 * dense.streamed_bytes_per_step
    assert served.kv_bytes_per_token == model_footprint(None).kv_bytes_per_token // 2


def test_hardware_measurements_are_positive():
    cpu = torch.device("cpu")
    assert measure_bandwidth(cpu, 8 * 2**20, repeats=2) > 1e8
    assert measure_flops(cpu, 128, repeats=2) > 1e7


def test_a_free_list_price_never_breaks_even_and_is_below_cost():
    free = PriceSheet(
        models={"test-model": ModelPrice(input=0.0, output=4.0)},
        cache_read=0.1,
        cache_write=1.25,
        tiers={tier: 1.0 for tier in TIER_NAMES},
        source="test",
    )
    suggested = suggest(cost_model(PHASES, 3.6, HARDWARE, FOOTPRINT, free), free, 0.5, 0.0)
    default = next(t for t in suggested.tiers if t.tier == "default")
    assert math.isinf(default.input_utilization) and suggested.below_cost(default)
    assert "never / 50%" in render_suggested(suggested, free.price("test-model"))


def test_the_start_up_check_names_the_tiers_whose_output_price_misses_the_machine_at_full_load():
    """$3.60 an hour is $0.001 a second: at 250 output tokens a second, $4.00 per 1M at full load."""
    sheet = PriceSheet(
        models={"m": ModelPrice(input=1.0, output=4.0)},
        cache_read=0.1,
        cache_write=1.25,
        tiers={"priority": 2.0, "default": 1.0, "flex": 0.5, "batch": 0.5},
        source="test",
    )
    assert below_cost("m", sheet, 3.6, 500.0) == []  # $2.00: flex and batch at 0.5x just cover it
    lines = below_cost("m", sheet, 3.6, 250.0)
    assert [line.split("tier ")[1].split(",")[0] for line in lines] == ["flex", "batch"]
    assert "$2.0000 per 1M" in lines[0] and "at least $4.0000" in lines[0]

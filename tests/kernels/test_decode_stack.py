"""The fused decode step (`torch.classes.carpool.DecodeStack`, csrc/decode_layer.cpp) against the same step composed
from the ops one call at a time in Python, bit for bit: hidden states and the KV caches it writes. Small random
layers in GGML blocks of five formats (q and k/v as parts of two formats, eight-block runs with a remainder), both
matmul modes, fp32 and bf16, a Llama-like and a Gemma-like stack, batches that run in the step's one parallel region
(the GEMV kernels) and one that runs op by op (the batched int8 kernel), on an odd thread count. Runs on whatever
kernel build is loaded (test_isa_paths.py runs it on every path this CPU can run)."""

import functools

import pytest
import torch
import torch.nn.functional as F
from test_ggml_quants import Q, random_blocks

import carpool.kernels  # noqa: F401

ops = torch.ops.carpool
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER = 288, 4, 2, 64, 512  # 288 = nine 32-weight blocks: one run of 8 and 1
Q_SIZE, KV_SIZE = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
EPS, SCALE, BLOCK_SIZE, NUM_BLOCKS = 1e-5, HEAD_DIM**-0.5, 16, 24

# name -> (positions, keys each row attends to, block table row per row): one sequence, two (4 attention items on the
# test's 3 threads: split finer in the region, as too few to share evenly), three, and one sequence's three verify
# rows (each row reads the keys the rows before it wrote in the same step); six rows take the batched int8 kernel, so
# that step runs op by op.
BATCHES = {
    "one": ([20], [21], [0]),
    "two": ([4, 39], [5, 40], [0, 1]),
    "three": ([4, 39, 16], [5, 40, 17], [0, 1, 2]),
    "verify": ([29, 30, 31], [30, 31, 32], [1, 1, 1]),
    "six": ([4, 39, 16, 0, 7, 25], [5, 40, 17, 1, 8, 26], [0, 1, 2, 3, 4, 5]),
}


@functools.cache  # gguf-py's reference dequantization (which random_blocks runs) is the slow part; weights are read-only
def blocks(rows, cols, qtype, seed):
    return random_blocks(rows, cols, qtype, seed)[0]


def make_layers(dtype, gemma, seed=0):
    g = torch.Generator().manual_seed(seed)

    def norm(size):
        return (torch.rand(size, generator=g) + 0.5).to(dtype)

    layers = []
    for i in range(2):
        s = 10 * i + seed
        layers.append(
            {
                "input_norm": norm(HIDDEN),
                "attention_out_norm": norm(HIDDEN) if gemma else None,
                "mlp_in_norm": norm(HIDDEN),
                "mlp_out_norm": norm(HIDDEN) if gemma else None,
                "q_norm": norm(HEAD_DIM) if gemma else None,
                "k_norm": norm(HEAD_DIM) if gemma else None,
                "qkv": [
                    (blocks(Q_SIZE, HIDDEN, Q.Q4_1, s), int(Q.Q4_1)),
                    (blocks(2 * KV_SIZE, HIDDEN, Q.Q8_0, s + 1), int(Q.Q8_0)),
                ],
                "qkv_bias": None if gemma else torch.randn(Q_SIZE + 2 * KV_SIZE, generator=g).to(dtype),
                "o": [(blocks(HIDDEN, Q_SIZE, Q.Q5_0, s + 2), int(Q.Q5_0))],
                "gate_up": [(blocks(2 * INTER, HIDDEN, Q.Q4_0, s + 3), int(Q.Q4_0))],
                "down": [(blocks(HIDDEN, INTER, Q.Q4_K, s + 4), int(Q.Q4_K))],
                "k_cache": torch.randn(NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=g).to(dtype),
                "v_cache": torch.randn(NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=g).to(dtype),
                "rotary": i,
                "window": 24 if gemma and i == 0 else 0,
            }
        )
    return layers


def build_stack(layers, gemma):
    stack = torch.classes.carpool.DecodeStack(HEADS, KV_HEADS, HEAD_DIM, EPS, SCALE, "gelu_tanh" if gemma else "silu")
    for layer in layers:
        parts = [list(p) for name in ("qkv", "o", "gate_up", "down") for p in zip(*layer[name])]
        stack.add_layer(
            layer["input_norm"],
            layer["attention_out_norm"],
            layer["mlp_in_norm"],
            layer["mlp_out_norm"],
            layer["q_norm"],
            layer["k_norm"],
            parts[0],
            parts[1],
            layer["qkv_bias"],
            parts[2],
            parts[3],
            parts[4],
            parts[5],
            parts[6],
            parts[7],
            layer["k_cache"],
            layer["v_cache"],
            layer["rotary"],
            layer["window"],
        )
    return stack


def project(x, parts):
    outs = [ops.ggml_linear(x, weight, qtype) for weight, qtype in parts]
    return outs[0] if len(outs) == 1 else torch.cat(outs, -1)


def norm_or_pass(x, weight):
    return x if weight is None else ops.rms_norm(x, weight, EPS)


def reference_step(layers, x, positions, cos, sin, slots, tables, lens, gemma):
    """What carpool's Python layers run for a decode step, one op call at a time."""
    batch = x.shape[0]
    for layer in layers:
        qkv = project(ops.rms_norm(x, layer["input_norm"], EPS), layer["qkv"])
        if layer["qkv_bias"] is not None:
            qkv = qkv + layer["qkv_bias"]
        q, k, v = qkv.split([Q_SIZE, KV_SIZE, KV_SIZE], -1)
        q, k = q.view(batch, HEADS, HEAD_DIM), k.view(batch, KV_HEADS, HEAD_DIM)
        v = v.view(batch, KV_HEADS, HEAD_DIM)
        if layer["q_norm"] is not None:
            q, k = ops.rms_norm(q, layer["q_norm"], EPS), ops.rms_norm(k, layer["k_norm"], EPS)
        ops.rotary_embedding(positions, q, k, cos[layer["rotary"]], sin[layer["rotary"]])
        ops.write_kv_cache(k, v, layer["k_cache"], layer["v_cache"], slots)
        attended = ops.paged_decode_attention(
            q, layer["k_cache"], layer["v_cache"], tables, lens, SCALE, layer["window"]
        )
        x = x + norm_or_pass(project(attended.view(batch, Q_SIZE), layer["o"]), layer["attention_out_norm"])
        gate_up = project(ops.rms_norm(x, layer["mlp_in_norm"], EPS), layer["gate_up"])
        if gemma:
            act = F.gelu(gate_up[:, :INTER], approximate="tanh") * gate_up[:, INTER:]
        else:
            act = ops.silu_mul(gate_up)
        x = x + norm_or_pass(project(act, layer["down"]), layer["mlp_out_norm"])
    return x


def rotary_tables(dtype):
    positions = torch.arange(64, dtype=torch.float32)[:, None]
    tables = []
    for base in (10000.0, 1000.0):  # one table per rotary, as Gemma's local and global layers
        freqs = positions * base ** (-torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM)
        angles = torch.cat([freqs, freqs], -1)
        tables.append((angles.cos().to(dtype), angles.sin().to(dtype)))
    return [c for c, _ in tables], [s for _, s in tables]


@pytest.fixture
def threads(request):
    """torch's thread count set to the test's `threads` (3: shares that split unevenly), restored after."""
    previous = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(previous)


@pytest.mark.parametrize("threads", [3], indirect=True)
@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("mode", [0, 1], ids=["exact", "int8-dot"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gemma", [False, True], ids=["llama", "gemma"])
def test_fused_step_equals_the_ops_bit_for_bit(threads, gemma, dtype, mode, batch):
    check_step(gemma, dtype, mode, batch)


@pytest.mark.parametrize("threads", [1], indirect=True)
@pytest.mark.parametrize("gemma", [False, True], ids=["llama", "gemma"])
def test_fused_step_on_one_thread(threads, gemma):
    check_step(gemma, torch.bfloat16, 1, "verify")


def check_step(gemma, dtype, mode, batch):
    positions, lens, table_rows = (torch.tensor(v) for v in BATCHES[batch])
    tables = torch.arange(NUM_BLOCKS).view(6, 4)[table_rows]  # each sequence its own 4 blocks
    slots = tables.gather(1, (positions // BLOCK_SIZE)[:, None])[:, 0] * BLOCK_SIZE + positions % BLOCK_SIZE
    cos, sin = rotary_tables(dtype)
    x = torch.randn(len(positions), HIDDEN, generator=torch.Generator().manual_seed(1)).to(dtype)
    fused_layers, reference_layers = make_layers(dtype, gemma), make_layers(dtype, gemma)
    previous = ops.set_matmul_mode(mode)
    try:
        with torch.inference_mode():
            stack = build_stack(fused_layers, gemma)
            fused = stack.forward(x, positions, cos, sin, slots, tables, lens, None, None, None)
            expected = reference_step(reference_layers, x, positions, cos, sin, slots, tables, lens, gemma)
    finally:
        ops.set_matmul_mode(previous)
    assert fused.isfinite().all()
    assert torch.equal(fused, expected)
    for mine, theirs in zip(fused_layers, reference_layers):
        assert torch.equal(mine["k_cache"], theirs["k_cache"]) and torch.equal(mine["v_cache"], theirs["v_cache"])


def test_fused_step_checks_its_metadata_before_running():
    dtype = torch.float32
    layers = make_layers(dtype, gemma=False)
    stack = build_stack(layers, gemma=False)
    cos, sin = rotary_tables(dtype)
    x, positions, tables = torch.randn(1, HIDDEN), torch.tensor([3]), torch.arange(4).view(1, 4)
    previous = ops.set_matmul_mode(1)
    try:

        def step(positions=positions, slot=3, length=4):
            stack.forward(
                x, positions, cos, sin, torch.tensor([slot]), tables, torch.tensor([length]), None, None, None
            )

        step()  # a good step runs
        with pytest.raises(RuntimeError, match="slot_mapping"):
            step(slot=NUM_BLOCKS * BLOCK_SIZE)
        with pytest.raises(RuntimeError, match="context_lens"):
            step(length=65)
        with pytest.raises(RuntimeError, match="positions"):
            step(positions=torch.tensor([64]))
    finally:
        ops.set_matmul_mode(previous)

"""The GEMV bench takes its matrices from the model's own file, whatever block formats that holds."""

import argparse

import gguf
import numpy as np
import torch

from carpool.bench import gemv
from carpool.bench.gemv import weights
from carpool.models.catalog import model_path
from carpool.models.quantization import OCTET_MAJOR, ROW_GROUPS

Q = gguf.GGMLQuantizationType


def test_smollm2_brings_its_own_q4_1_and_its_tied_lm_head():
    blocks = weights("smollm2-135m")
    assert set(blocks) == {Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q8_0}
    # Q8_0: the token embedding, which SmolLM2's LM head reads (the file has no output.weight).
    assert tuple(blocks[Q.Q8_0].shape) == (49152, 576 // 32 * 34)
    # Q4_1: one of the file's 1536 x 576 projections (gate or up), not a synthetic one; that shape in the others.
    file_q4_1 = [
        torch.from_numpy(np.array(t.data))
        for t in gguf.GGUFReader(model_path("smollm2-135m")).tensors
        if t.tensor_type == Q.Q4_1 and [int(n) for n in t.shape] == [576, 1536]
    ]
    assert any(torch.equal(blocks[Q.Q4_1], data) for data in file_q4_1)
    for qtype in (Q.Q4_0, Q.Q5_0):
        weights_per_block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
        assert tuple(blocks[qtype].shape) == (1536, 576 // weights_per_block * block_bytes)
    x = torch.randn(1, 576)
    for qtype, data in blocks.items():
        assert torch.ops.carpool.ggml_linear(x, data, int(qtype)).shape == (1, data.shape[0])


def test_layouts_time_the_same_product_in_gguf_and_carpools_arrangement(monkeypatch, capsys):
    """--layouts: each rearranged format's two columns are one matmul (the same outputs), the second from its
    arrangement (Q4_0/Q4_1 octet-major, Q4_K and Q6_K row groups), each call on the next of --copies copies of the
    matrix."""
    calls_seen, timed = [], []
    linear = gemv.linear

    def seen_linear(mode, x, blocks, qtype):
        calls_seen.append((qtype, blocks.data_ptr()))
        return linear(mode, x, blocks, qtype)

    def record(calls, clock):
        outputs = {}
        for name, fn in calls.items():
            calls_seen.clear()
            outputs[name] = [fn() for _ in range(3)]  # three calls: the two copies, then the first again
            qtypes, pointers = zip(*calls_seen)
            flag = ROW_GROUPS if qtypes[0] & 0xFF in (Q.Q4_K, Q.Q6_K) else OCTET_MAJOR
            assert len(set(qtypes)) == 1 and bool(qtypes[0] & flag) == (name == "rearranged")
            assert pointers[0] != pointers[1] and pointers[0] == pointers[2]
        timed.append((qtypes[0] & 0xFF, outputs))
        return dict.fromkeys(calls, 1e-3)

    monkeypatch.setattr(gemv, "linear", seen_linear)
    monkeypatch.setattr(gemv, "seconds_per_call", record)
    args = argparse.Namespace(rows=[1, 8], threads=[1], dtype="float32", copies=2)
    rng = np.random.default_rng(0)
    q4_k, q6_k = rng.integers(0, 256, (16, 2, 144), dtype=np.uint8), rng.integers(0, 256, (16, 2, 210), dtype=np.uint8)
    q4_k[..., :4] = np.full((16, 2, 2), 0.01, dtype=np.float16).view(np.uint8)  # finite d and dmin
    q6_k[..., 208:] = np.full((16, 2, 1), 0.01, dtype=np.float16).view(np.uint8)  # finite d
    blocks = {
        **gemv.weights("smollm2-135m"),
        Q.Q4_K: torch.from_numpy(q4_k.reshape(16, -1)),
        Q.Q6_K: torch.from_numpy(q6_k.reshape(16, -1)),
    }
    gemv.compare_layouts(blocks, args, clock=None)
    assert len(timed) == 4 * 2 * len(gemv.COMPARED)  # Q4_0, Q4_1, Q4_K and Q6_K, two row counts, both modes
    for qtype, outputs in timed:
        for gguf_y, rearranged_y in zip(outputs["gguf"], outputs["rearranged"]):
            if qtype in (
                Q.Q4_K,
                Q.Q6_K,
            ):  # the row-group GEMV rounds each block's whole sum, the GGUF rows' GEMV parts:
                # fp32 rounding within test_int8_dot's bound (2e-6 of the magnitude; 1200 draws of x: at most 3.8e-7)
                assert (gguf_y - rearranged_y).abs().max() <= 2e-6 * gguf_y.abs().max()
            else:
                assert torch.equal(gguf_y, rearranged_y)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith(("| Q4_", "| Q6_"))]
    assert len(lines) == len(timed) and all(line.endswith("| 1.00x |") for line in lines)

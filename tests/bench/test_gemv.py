"""The GEMV bench takes its matrices from the model's own file, whatever block formats that holds."""

import gguf
import numpy as np
import torch

from carpool.bench.gemv import weights
from carpool.models.catalog import model_path

Q = gguf.GGMLQuantizationType


def test_smollm2_brings_its_own_q4_1_and_its_tied_lm_head():
    blocks = weights("smollm2-135m")
    assert set(blocks) == {Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q8_0}
    # Q8_0: the token embedding, which SmolLM2's LM head reads (the file has no output.weight).
    assert tuple(blocks[Q.Q8_0].shape) == (49152, 576 // 32 * 34)
    # Q4_1: one of the file's 1536 x 576 projections (gate or up), not a synthetic one; that shape in the others.
    file_q4_1 = [torch.from_numpy(np.array(t.data)) for t in gguf.GGUFReader(model_path("smollm2-135m")).tensors
                 if t.tensor_type == Q.Q4_1 and [int(n) for n in t.shape] == [576, 1536]]
    assert any(torch.equal(blocks[Q.Q4_1], data) for data in file_q4_1)
    for qtype in (Q.Q4_0, Q.Q5_0):
        weights_per_block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
        assert tuple(blocks[qtype].shape) == (1536, 576 // weights_per_block * block_bytes)
    x = torch.randn(1, 576)
    for qtype, data in blocks.items():
        assert torch.ops.carpool.ggml_linear(x, data, int(qtype)).shape == (1, data.shape[0])

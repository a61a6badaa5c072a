"""The CPU kernels against the torch code they replace (each module's native path, used on other devices)."""

import pytest
import torch

from carpool.engine.attention import DecodeGroup, PagedAttention
from carpool.models.llama import LlamaMLP, RMSNorm, RotaryEmbedding

DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm(dtype):
    norm = RMSNorm(576, 1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(576) + 0.5)
    x = (torch.randn(7, 576) * 3).to(dtype)
    with torch.inference_mode():
        torch.testing.assert_close(norm(x), norm.forward_native(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_is_bitwise_torch(dtype):
    mlp = LlamaMLP.__new__(LlamaMLP)
    mlp.intermediate_size = 40  # a 16-wide vector part and a scalar tail
    gate_up = (torch.randn(5, 80) * 4).to(dtype)
    assert torch.equal(torch.ops.carpool.silu_mul(gate_up), mlp.silu_mul_native(gate_up))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_in_place_matches_native(dtype):
    rotary = RotaryEmbedding(64, 256, 10000.0).to(dtype)
    qkv = torch.randn(6, (9 + 3 + 3) * 64).to(dtype)
    positions = torch.tensor([0, 1, 5, 77, 128, 255])
    q, k, _ = qkv.split([9 * 64, 3 * 64, 3 * 64], dim=-1)  # strided views, as in the model
    q, k = q.view(6, 9, 64), k.view(6, 3, 64)
    expected_q, expected_k = rotary.forward_native(positions, q), rotary.forward_native(positions, k)
    rotated_q, rotated_k = rotary(positions, q, k)
    tolerance = {"rtol": 1e-2, "atol": 1e-2} if dtype == torch.bfloat16 else {}
    torch.testing.assert_close(rotated_q, expected_q, **tolerance)
    torch.testing.assert_close(rotated_k, expected_k, **tolerance)


@pytest.mark.parametrize("head_dim", [64, 32])  # the vectorized path, and the portable loop for other sizes
@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_decode_attention_matches_gathered_sdpa(dtype, head_dim):
    heads, kv_heads, block_size, num_blocks = 9, 3, 16, 40
    attention = PagedAttention(heads, kv_heads, head_dim)
    attention.k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim).to(dtype)
    attention.v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim).to(dtype)
    lengths = torch.tensor([1, 16, 17, 100, 33])  # one token, a full block, a block and one, several
    tables = torch.stack([torch.randperm(num_blocks)[:7] for _ in lengths])  # blocks scattered over the pool
    group = DecodeGroup(0, len(lengths), tables, lengths)
    q = torch.randn(len(lengths), heads, head_dim).to(dtype)
    tolerance = {"rtol": 2e-2, "atol": 2e-2} if dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-5}
    torch.testing.assert_close(attention._decode(q, group), attention._decode_gathered(q, group), **tolerance)


def test_write_kv_cache_matches_index_copy():
    cache = torch.zeros(8, 4, 3, 16)
    expected = cache.clone()
    qkv = torch.randn(5, 3 * 16 * 3)
    k = qkv[:, 48:96].view(5, 3, 16)  # strided rows, as the qkv projection's split gives them
    v = qkv[:, 96:].view(5, 3, 16)
    slots = torch.tensor([0, 5, 6, 31, 17])
    values = torch.zeros_like(cache)
    torch.ops.carpool.write_kv_cache(k, v, cache, values, slots)
    expected.view(-1, 3, 16).index_copy_(0, slots, k)
    assert torch.equal(cache, expected)
    assert torch.equal(values.view(-1, 3, 16)[slots], v)
    with pytest.raises(RuntimeError, match="slot_mapping"):
        torch.ops.carpool.write_kv_cache(k, v, cache, values, torch.tensor([0, 1, 2, 3, 32]))

"""The engine's command-line flags, shared by every command that starts an engine (`carpool generate`, `serve`,
`bench batch`): `add_engine_args` declares them, `engine_config` turns the parsed flags into an EngineConfig."""

import argparse

from carpool.engine.config import DRAFT_VOCAB_SIZE, DTYPES, EngineConfig
from carpool.models.quantization import MATMUL_SETTINGS, QUANTIZATION_MODES


def on_or_off(value: str) -> bool:
    if value not in ("on", "off"):
        raise argparse.ArgumentTypeError(f"expected on or off, got {value!r}")
    return value == "on"


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    defaults = EngineConfig()
    parser.add_argument(
        "--model", default=None, help="GGUF file or safetensors directory (default: SmolLM2-135M-Instruct)"
    )
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument(
        "--dtype",
        default=defaults.dtype,
        choices=["auto", *DTYPES],
        help="weights, activations and KV cache (default: auto, bfloat16 where the hardware has "
        "native bf16 units; float32 reproduces the reference implementation exactly only with --matmul exact)",
    )
    parser.add_argument(
        "--quantization",
        default=defaults.quantization,
        choices=list(QUANTIZATION_MODES),
        help="weight format: auto keeps a GGUF file's Q4_0/Q4_1/Q8_0 blocks (CPU kernels), none "
        "dequantizes to --dtype, q8_0/q4_1/q4_0 quantize at load (default: auto)",
    )
    parser.add_argument(
        "--matmul",
        default="auto",
        choices=list(MATMUL_SETTINGS),
        help="block-format linear layers: int8-dot quantizes decode's activations to int8 and runs "
        "integer dot products (llama.cpp's method, faster), prompt chunks stay exact "
        "except the K-quants' on avx512; "
        "int8-dot-all does so for prompt chunks too (faster prefill where there are no bf16 "
        "units, ~0.6%% error per linear); exact multiplies them as they are; auto: "
        "int8-dot-all on the avx2 and avxvnni kernel paths, int8-dot elsewhere (default: auto)",
    )
    parser.add_argument(
        "--reproducible",
        type=on_or_off,
        metavar="{on,off}",
        default=None,
        help="on: a token's logits are the same bits whatever else its step holds (the batch, a prompt chunk or a "
        "decode row, a prefix-cache hit, a preemption): every linear row through the int8 kernels' one arithmetic "
        "and prompt attention through the decode kernel (docs/features/reproducible.md); off: each batch shape's "
        "fastest arithmetic (--matmul auto, SDPA for prompts). Default: on where it can hold (the CPU, block-format "
        "weights, --matmul auto or int8-dot-all)",
    )
    parser.add_argument(
        "--block-size",
        type=int,
        default=defaults.block_size,
        help=f"tokens per KV-cache block, the unit of paging and prefix sharing (default: {defaults.block_size})",
    )
    parser.add_argument(
        "--num-kv-blocks", type=int, default=None, help="exact KV pool in blocks, overrides --kv-cache-gb"
    )
    parser.add_argument(
        "--kv-cache-gb",
        type=float,
        default=defaults.kv_cache_gb,
        help=f"memory for the KV pool (default: {defaults.kv_cache_gb})",
    )
    parser.add_argument(
        "--max-num-seqs",
        type=int,
        default=defaults.max_num_seqs,
        help=f"sequences in the running batch at most (default: {defaults.max_num_seqs})",
    )
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=defaults.max_num_batched_tokens,
        help=f"tokens one step computes at most; longer prompts are split over steps (default: "
        f"{defaults.max_num_batched_tokens})",
    )
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="prompt plus output tokens per sequence at most (default: the model's context window)",
    )
    parser.add_argument(
        "--no-prefix-caching",
        dest="enable_prefix_caching",
        action="store_false",
        help="compute every prompt in full instead of reusing cached prefixes",
    )
    parser.add_argument(
        "--cache-pin-fraction",
        type=float,
        default=defaults.cache_pin_fraction,
        help=f"share of the KV pool that prompt-cache TTL pins (Anthropic cache_control breakpoints) may hold; "
        f"a write past it is cached as an ordinary LRU prefix and billed as one (default: "
        f"{defaults.cache_pin_fraction})",
    )
    parser.add_argument(
        "--priority-aging-seconds",
        type=float,
        default=defaults.priority_aging_seconds,
        help=f"a waiting request gains one tier of priority per this many seconds waited (default: "
        f"{defaults.priority_aging_seconds})",
    )
    parser.add_argument(
        "--max-priority-boost",
        type=int,
        default=defaults.max_priority_boost,
        help=f"tiers a request can gain by waiting at most (default: {defaults.max_priority_boost})",
    )
    parser.add_argument(
        "--num-threads", type=int, default=None, help="torch threads on CPU (default: torch's own choice)"
    )
    parser.add_argument(
        "--speculative-model",
        default=None,
        metavar="ngram|NAME|PATH",
        help="speculative decoding: 'ngram' (prompt lookup) or a draft model sharing the target's "
        "tokenizer; greedy and seeded outputs stay the target's (default: off)",
    )
    parser.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=defaults.num_speculative_tokens,
        help=f"draft tokens per sequence and step at most; fewer, down to none, as the batch grows "
        f"(default: {defaults.num_speculative_tokens})",
    )
    parser.add_argument(
        "--speculative-quantization",
        default=None,
        choices=list(QUANTIZATION_MODES),
        help="the draft model's weight format, as --quantization; q4_0 makes a Q8/Q5 draft's pass "
        "12-16%% cheaper for 5-10%% lower acceptance (default: --quantization's)",
    )
    parser.add_argument(
        "--speculative-vocab-size",
        type=int,
        default=None,
        metavar="N",
        help=f"the draft model drafts only from its vocabulary's first N token ids (BPE merge "
        f"order: the most frequent) plus its special tokens; its LM head computes N logits "
        f"instead of all; the vocabulary's size drafts from all of it (default: "
        f"{DRAFT_VOCAB_SIZE} where the vocabulary is larger)",
    )
    parser.add_argument(
        "--ngram-min",
        type=int,
        default=defaults.ngram_min,
        help=f"shortest n-gram the ngram drafter matches (default: {defaults.ngram_min})",
    )
    parser.add_argument(
        "--ngram-max",
        type=int,
        default=defaults.ngram_max,
        help=f"longest n-gram the ngram drafter matches (default: {defaults.ngram_max})",
    )


def engine_config(args: argparse.Namespace) -> EngineConfig:
    names = EngineConfig.__dataclass_fields__
    return EngineConfig(**{k: v for k, v in vars(args).items() if k in names})

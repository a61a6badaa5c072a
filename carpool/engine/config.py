from dataclasses import dataclass, field

import torch

from carpool.engine.slo import check_slos
from carpool.kernels import kernel_path
from carpool.kernels.isa import BF16_PATHS
from carpool.models.quantization import check_quantization, resolve_matmul

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# The draft model's default vocabulary subset (speculative_vocab_size): its first ids, in BPE merge order. Qwen2.5-
# Coder-0.5B drafting for 1.5B (k = 4, greedy): 65536 keeps acceptance within 2-4% of the full 151,936 (chat 0.556
# vs 0.580, docs 0.773 vs 0.788) for a 15% cheaper draft pass; 32768 saves 22% but loses 7-11%.
DRAFT_VOCAB_SIZE = 65536


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name != "auto":
        return DTYPES[name]
    if device.type == "cuda":
        return torch.bfloat16
    # bf16 pays only where both carpool's kernels (their amx and avx512 paths: AMX-BF16 tiles, AVX512-BF16 dot
    # products) and torch's oneDNN matmuls have bf16 units; the avxvnni, avx2 and portable paths widen bf16 to fp32
    # at every use, so a CPU without them (or a run forced onto such a path) gets float32, as a real AVX2 machine would.
    try:
        native_bf16 = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    except (AttributeError, RuntimeError):
        native_bf16 = False
    return torch.bfloat16 if native_bf16 and kernel_path() in BF16_PATHS else torch.float32


@dataclass
class EngineConfig:
    """Engine arguments, shared by `LLM(...)`, `carpool serve` and the benchmarks."""

    model: str | None = None  # GGUF file or safetensors directory; None = the embedded SmolLM2-135M-Instruct
    device: str | None = None  # None: cuda when available, else cpu
    # float32 reproduces the reference implementation exactly; bfloat16 halves the bytes every decode step
    # streams (weights and KV) and runs matmuls on bf16 units where the CPU has them (AVX512-BF16, AMX).
    # "auto": bfloat16 where the hardware has such units (and on CUDA), else float32.
    dtype: str = "auto"
    # Weight format (carpool.models.quantization): "auto" keeps a GGUF file's Q4_0/Q4_1/Q8_0 blocks and runs
    # them with block kernels (a decode step streams ~3x fewer bytes than bf16); "none" dequantizes everything
    # to `dtype`; "q8_0", "q4_1", "q4_0" quantize every weight matrix at load.
    quantization: str = "auto"
    # How block-format linear layers multiply (carpool.models.quantization.MATMUL_MODES): "int8-dot" (llama.cpp's
    # method) quantizes activations to int8 and runs integer dot products at decode's few rows, 2-3x faster at batch
    # 1; "int8-dot-all" does so for prompt chunks too; "exact" dequantizes the weights and multiplies the activations
    # as they are (bit-faithful to gguf-py). "auto" (resolved at init, resolve_matmul): int8-dot-all on the avx2 and
    # avxvnni kernel paths, int8-dot elsewhere.
    matmul: str = "auto"
    # Whether a token's logits are the same bits whatever its step holds (the batch beside it, a prompt chunk or a
    # decode row, a prefix-cache hit, a chunk boundary, a preemption): every block-format linear row through the int8
    # kernels' one arithmetic, prompt attention through the decode kernel's (docs/features/reproducible.md).
    # None: on where that holds (the CPU, block-format weights, matmul "auto" or "int8-dot-all"), off where a
    # setting changes the arithmetic with the batch (cuda's matmuls; matmul "exact" or "int8-dot"; quantization
    # "none"); True where it cannot hold is a ValueError naming the setting. Resolved to a bool at init.
    reproducible: bool | None = None
    block_size: int = 16
    num_kv_blocks: int | None = None  # exact pool size; overrides kv_cache_gb
    kv_cache_gb: float = 1.0
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512  # per-step token budget; long prompts are chunked under it
    max_model_len: int | None = None  # None: the model's context window
    enable_prefix_caching: bool = True
    # Share of the KV pool that cache breakpoints' TTL pins may hold (carpool.engine.block_manager). A quarter:
    # pinned blocks leave LRU eviction, so the other three quarters stay for running sequences and the automatic
    # (LRU) cache the OpenAI routes live on; on the default 1 GB pool that is ~11k tokens of SmolLM2-135M's KV
    # (23,040 bytes a token in bf16), three 3k-token system prompts with room to spare. The engine lowers it
    # further where pins would leave no room for one request of max_request_tokens, so pins never stall one.
    cache_pin_fraction: float = 0.25
    # A breakpoint's prefix shorter than this is cached as any other, not pinned (the price sheet's [cache]
    # min_tokens: `carpool serve` sets it from the sheet; 1024 is Anthropic's minimum for most models).
    cache_min_tokens: int = 1024
    # Sliding-window layers (Gemma 3's local ones) give back the KV blocks before their window; False keeps
    # them, as full-attention layers do (the reference the tests compare against).
    free_sliding_window_blocks: bool = True
    # A waiting request gains one tier of priority per `priority_aging_seconds` waited, at most
    # `max_priority_boost` tiers, so no tier starves behind a steady stream of higher ones.
    priority_aging_seconds: float = 30.0
    max_priority_boost: int = 2
    num_threads: int | None = None  # torch intra-op threads on CPU; None = torch's default
    # Speculative decoding (carpool.engine.spec_decode): None = off; "ngram" = prompt lookup (drafts copied from
    # the prompt and output so far, n-grams of ngram_min..ngram_max tokens); else a draft model (GGUF, directory
    # or catalog name) sharing the target's tokenizer, with its own KV pool inside kv_cache_gb.
    speculative_model: str | None = None
    num_speculative_tokens: int = 4  # drafts per sequence per step at most; the engine picks 0..this by load
    # A draft model's weight format (as `quantization`); None: the target's.
    speculative_quantization: str | None = None
    # A draft model drafts from its vocabulary's first speculative_vocab_size ids (plus its special tokens):
    # its LM head computes only those logits (carpool.engine.spec_decode.draft_model). None: the default,
    # DRAFT_VOCAB_SIZE where the vocabulary is larger; the vocabulary's size: all of it.
    speculative_vocab_size: int | None = None
    ngram_min: int = 1
    ngram_max: int = 4
    # SLO-driven step sizing (carpool.engine.slo): {tier: milliseconds}. With any set, each step's token budget
    # and sequence cap follow measured step times, up to max_num_batched_tokens / max_num_seqs, so the highest
    # tier present with an ITL SLO gets its inter-token latency and TTFT-bound prompts still land in time.
    slo_itl_ms: dict[str, float] = field(default_factory=dict)
    slo_ttft_ms: dict[str, float] = field(default_factory=dict)

    def _resolve_reproducible(self) -> bool:
        if self.reproducible not in (None, True, False):
            raise ValueError(f"reproducible must be true, false or unset, got {self.reproducible!r}")
        cuda = self.device == "cuda" or (self.device is None and torch.cuda.is_available())
        # What keeps a row's arithmetic from being one: the setting that says so, in the words of the ValueError.
        obstacle = (
            "device cuda (cuBLAS picks its reductions by batch size)"
            if cuda
            else f"matmul={self.matmul!r} (the exact path multiplies decode rows and batches differently)"
            if self.matmul in ("exact", "int8-dot")
            else "quantization='none' (torch's dense matmuls pick their reductions by batch size)"
            if self.quantization == "none"
            else None
        )
        if self.reproducible and obstacle:
            raise ValueError(f"reproducible=True cannot hold with {obstacle}; leave reproducible unset or false")
        return obstacle is None if self.reproducible is None else self.reproducible

    def settle_reproducible(self, dense_layer: str | None) -> None:
        """After the weights load: a dense linear layer (`dense_layer`, None without one) multiplies through torch's
        matmuls, whose reductions follow the batch size. Asked for, reproducible is then a ValueError; by default
        it turns off, `matmul` back to its own setting."""
        if not (self.reproducible and dense_layer):
            return
        if self._asked["reproducible"]:
            raise ValueError(
                f"reproducible=True cannot hold with dense weights ({dense_layer}: torch's matmuls pick their "
                "reductions by batch size); leave reproducible unset or false"
            )
        self.reproducible = False
        self.matmul = resolve_matmul(self._asked["matmul"], kernel_path())

    def __post_init__(self):
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.num_kv_blocks is not None and (not isinstance(self.num_kv_blocks, int) or self.num_kv_blocks <= 0):
            raise ValueError(f"num_kv_blocks must be a positive integer, got {self.num_kv_blocks!r}")
        if not 0 <= self.cache_pin_fraction <= 1:
            raise ValueError(f"cache_pin_fraction must be in [0, 1], got {self.cache_pin_fraction!r}")
        if (
            isinstance(self.cache_min_tokens, bool)
            or not isinstance(self.cache_min_tokens, int)
            or self.cache_min_tokens < 0
        ):
            raise ValueError(f"cache_min_tokens must be a non-negative integer, got {self.cache_min_tokens!r}")
        if self.kv_cache_gb <= 0:
            raise ValueError(f"kv_cache_gb must be > 0, got {self.kv_cache_gb!r}")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be > 0, got {self.max_model_len!r}")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(DTYPES)}, got {self.dtype!r}")
        check_quantization(self.quantization)
        self._asked = {"reproducible": self.reproducible, "matmul": self.matmul}  # for settle_reproducible
        fast = resolve_matmul(self.matmul, kernel_path())  # checks the setting too
        self.reproducible = self._resolve_reproducible()
        self.matmul = "int8-dot-all" if self.reproducible else fast
        if self.priority_aging_seconds <= 0:
            raise ValueError(f"priority_aging_seconds must be > 0, got {self.priority_aging_seconds!r}")
        for name in ("num_speculative_tokens", "ngram_min", "ngram_max"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.speculative_quantization is not None:
            check_quantization(self.speculative_quantization, "speculative_quantization")
        vocab = self.speculative_vocab_size
        if vocab is not None and (isinstance(vocab, bool) or not isinstance(vocab, int) or vocab <= 0):
            raise ValueError(f"speculative_vocab_size must be a positive integer, got {vocab!r}")
        self.slo_itl_ms = check_slos("slo_itl_ms", self.slo_itl_ms)
        self.slo_ttft_ms = check_slos("slo_ttft_ms", self.slo_ttft_ms)
        if self.ngram_min > self.ngram_max:
            raise ValueError(f"ngram_min ({self.ngram_min}) must not exceed ngram_max ({self.ngram_max})")

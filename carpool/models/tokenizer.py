"""Tokenizer and chat template, built from GGUF metadata or read from a model directory's tokenizer.json."""

import json
from pathlib import Path

from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Tokenizer as HFTokenizer, decoders, models, pre_tokenizers

_GGUF_CONTROL_TOKEN = 3
# llama.cpp pre-tokenizer names whose rule is "digits one by one, then GPT-2 byte-level splitting".
_DIGIT_SPLIT_PRE = {"smollm", "llama3", "llama-bpe", "qwen2", "starcoder"}


def tokenizer_files_from_gguf(gguf_file) -> tuple[HFTokenizer, dict]:
    """The tokenizer.json and tokenizer_config.json contents equivalent to a GGUF file's tokenizer metadata."""
    kind = gguf_file.field("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"model: unsupported GGUF tokenizer {kind!r} (supported: gpt2 byte-level BPE)")
    tokens = gguf_file.field("tokenizer.ggml.tokens")
    token_types = gguf_file.field("tokenizer.ggml.token_type")
    merges = [tuple(m.split(" ", 1)) for m in gguf_file.field("tokenizer.ggml.merges")]
    tokenizer = HFTokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges, ignore_merges=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if gguf_file.field("tokenizer.ggml.pre") in _DIGIT_SPLIT_PRE:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        tokenizer.pre_tokenizer = byte_level
    tokenizer.decoder = decoders.ByteLevel()
    specials = [t for t, kind in zip(tokens, token_types) if kind == _GGUF_CONTROL_TOKEN]
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])

    def token(key):
        index = gguf_file.field(f"tokenizer.ggml.{key}_token_id")
        return None if index is None else tokens[index]

    config = {
        "chat_template": gguf_file.field("tokenizer.chat_template"),
        "bos_token": token("bos"),
        "eos_token": token("eos"),
        "add_bos_token": bool(gguf_file.field("tokenizer.ggml.add_bos_token", False)),
    }
    return tokenizer, config


def _read_tokenizer_dir(directory: Path) -> tuple[HFTokenizer, dict]:
    tokenizer = HFTokenizer.from_file(str(directory / "tokenizer.json"))
    config_file = directory / "tokenizer_config.json"
    config = json.loads(config_file.read_text()) if config_file.exists() else {}

    def token(key):
        value = config.get(key)
        return value.get("content") if isinstance(value, dict) else value

    info = {
        "chat_template": config.get("chat_template"),
        "bos_token": token("bos_token"),
        "eos_token": token("eos_token"),
        "add_bos_token": bool(config.get("add_bos_token", False)),
    }
    return tokenizer, info


class Tokenizer:
    """Text <-> token ids, plus the model's chat template."""

    def __init__(self, tokenizer: HFTokenizer, info: dict):
        self._tokenizer = tokenizer
        self.chat_template = info["chat_template"]
        self.bos_token = info["bos_token"]
        self.eos_token = info["eos_token"]
        self.add_bos_token = info["add_bos_token"]
        self.bos_token_id = tokenizer.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_token_id = tokenizer.token_to_id(self.eos_token) if self.eos_token else None
        self.vocab_size = tokenizer.get_vocab_size()
        self._template = None
        if self.chat_template:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise_template_error
            self._template = env.from_string(self.chat_template)

    @classmethod
    def from_dir(cls, directory: Path) -> "Tokenizer":
        return cls(*_read_tokenizer_dir(Path(directory)))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._tokenizer.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str:
        return self._tokenizer.id_to_token(token_id)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if self._template is None:
            raise ValueError("messages: this model has no chat template; send a raw prompt instead")
        return self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )


def _raise_template_error(message: str):
    raise ValueError(f"messages: {message}")

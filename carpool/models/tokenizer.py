"""Tokenizer and chat template, built from GGUF metadata or read from a model directory's tokenizer.json.

A GGUF file carries its vocabulary, not a tokenizer.json; the `tokenizers` objects built here are the ones
transformers builds from the same metadata (transformers.integrations.gguf), so both tokenize alike:
- "gpt2": byte-level BPE with the file's merges, split first by the regex its `tokenizer.ggml.pre` names;
- "llama" in a Gemma file: SentencePiece-style BPE with byte fallback and no prefix space; the file has no
  merges, so they are rebuilt from the vocabulary, best first in the order the tokens appear.
"""

import json
from pathlib import Path

from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

_CONTROL, _USER_DEFINED = 3, 4  # GGUF token types
# Pre-tokenizer regexes by llama.cpp's `tokenizer.ggml.pre` name (the ones transformers uses for them).
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS = {"qwen2": _QWEN2_SPLIT, "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT}
# Pre-tokenizers whose rule is "digits one by one, then GPT-2 byte-level splitting".
_DIGIT_SPLIT_PRE = {"smollm", "starcoder"}
_SENTENCEPIECE_ARCHITECTURES = {"gemma3"}
# Tokens that end a turn in the chat formats carpool's models use: generation stops at any of them, as
# llama.cpp does, besides the file's own EOS (Gemma's is <eos>, its chat turns end with <end_of_turn>).
_END_OF_TURN_TOKENS = ("<end_of_turn>", "<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>")


def tokenizer_files_from_gguf(field) -> tuple[HFTokenizer, dict]:
    """The tokenizer.json and tokenizer_config.json contents equivalent to a GGUF file's tokenizer metadata.
    `field(key, default=None)` reads one metadata value."""
    kind = field("tokenizer.ggml.model")
    architecture = field("general.architecture")
    tokens = list(field("tokenizer.ggml.tokens"))
    token_types = field("tokenizer.ggml.token_type") or []
    if kind == "gpt2":
        tokenizer = _byte_level_bpe(field, tokens)
        # A control token spelled outside the byte alphabet is a llama.cpp mislabel: adding it would grow the
        # vocabulary past the model's.
        alphabet = set(_bytes_to_unicode().values())
        specials = [t if set(t) <= alphabet else None for t in tokens]
    elif kind == "llama" and architecture in _SENTENCEPIECE_ARCHITECTURES:
        tokenizer, specials = _sentencepiece_bpe(tokens), tokens
    else:
        raise ValueError(
            f"model: unsupported GGUF tokenizer {kind!r} for architecture {architecture!r} (supported: gpt2 "
            f"byte-level BPE; llama SentencePiece for {sorted(_SENTENCEPIECE_ARCHITECTURES)})"
        )
    control = [t for t, kind in zip(specials, token_types) if kind == _CONTROL and t is not None]
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    # User-defined tokens (Gemma's "\n", "<table>"...) are matched whole in the text, as llama.cpp does.
    vocab = tokenizer.get_vocab()
    user_defined = [t for t, kind in zip(tokens, token_types) if kind == _USER_DEFINED and t in vocab]
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in user_defined])

    def token(key):
        index = field(f"tokenizer.ggml.{key}_token_id")
        return None if index is None else tokens[index]

    config = {
        "chat_template": field("tokenizer.chat_template"),
        "bos_token": token("bos"),
        "eos_token": token("eos"),
        # llama.cpp adds BOS to a SentencePiece vocabulary that does not say otherwise.
        "add_bos_token": bool(field("tokenizer.ggml.add_bos_token", kind == "llama")),
    }
    return tokenizer, config


def _byte_level_bpe(field, tokens: list[str]) -> HFTokenizer:
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    # Every token in byte-level spelling (a few files store some as plain text).
    vocab = {
        t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")): i for i, t in enumerate(tokens)
    }
    merges = [tuple(m.split(" ", 1)) for m in field("tokenizer.ggml.merges")]
    tokenizer = HFTokenizer(models.BPE(vocab, merges, ignore_merges=False))
    pre = field("tokenizer.ggml.pre")
    if pre in _SPLITS:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    elif pre in _DIGIT_SPLIT_PRE:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False),
            ]
        )
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _sentencepiece_bpe(tokens: list[str]) -> HFTokenizer:
    # Gemma stores its tokens of two or more spaces as real spaces; text is looked up with spaces as "▁".
    tokens = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {t: i for i, t in enumerate(tokens)}
    tokenizer = HFTokenizer(
        models.BPE(vocab, _merges_by_position(vocab), unk_token="<unk>", fuse_unk=True, byte_fallback=True)
    )
    tokenizer.normalizer = normalizers.Replace(" ", "\u2581")
    tokenizer.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    tokenizer.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    return tokenizer


def _merges_by_position(vocab: dict[str, int]) -> list[tuple[str, str]]:
    """Every split of a token into two tokens of the vocabulary is a merge; earlier tokens merge first, and
    among one token's splits the longer left piece first (transformers' generate_merges with position scores)."""
    merges = []
    for token, index in vocab.items():
        pairs = [(token[:cut], token[cut:]) for cut in range(1, len(token))]
        pairs = sorted((p for p in pairs if p[0] in vocab and p[1] in vocab), key=lambda p: (vocab[p[0]], vocab[p[1]]))
        merges.extend((index, p) for p in pairs)
    merges.sort(key=lambda m: (m[0], -len(m[1][0]), -len(m[1][1])))
    return [pair for _, pair in merges]


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table that byte-level BPE vocabularies are spelled in."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    extra = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(extra)}}


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
        ends = [tokenizer.token_to_id(t) for t in _END_OF_TURN_TOKENS]
        self.stop_token_ids = frozenset(i for i in [self.eos_token_id, *ends] if i is not None)
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

    def to_json(self) -> str:
        """The tokenizer as a tokenizer.json text (what grammar libraries build their token tables from)."""
        return self._tokenizer.to_str()

    @property
    def added_token_ids(self) -> frozenset[int]:
        """The ids of tokens added to the vocabulary: special and control tokens (chat turn markers, EOS, tool tags)."""
        return frozenset(self._tokenizer.get_added_tokens_decoder())

    def id_to_token(self, token_id: int) -> str:
        return self._tokenizer.id_to_token(token_id)

    @property
    def supports_tools(self) -> bool:
        """Whether the chat template renders a `tools` list (Qwen2.5's does; SmolLM2's and Gemma 3's do not)."""
        return "tools" in (self.chat_template or "")

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None
    ) -> str:
        if self._template is None:
            raise ValueError("messages: this model has no chat template; send a raw prompt instead")
        return self._template.render(
            messages=messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )


def _raise_template_error(message: str):
    raise ValueError(f"messages: {message}")

"""Tokenizers and chat templates built from GGUF metadata, against transformers' from the same files."""

import pytest

from carpool import SamplingParams

TEXTS = [
    "Hello, world! How's it going? I'm fine, they'll see.",
    "你好，世界！今天的天气很好，我们去公园散步吧。",
    "こんにちは、世界。東京は日本の首都です。カタカナとひらがな。",
    "مرحبا بالعالم، كيف حالك اليوم؟",
    "Emoji: 🚀🔥👍🏽 and a family 👨‍👩‍👧 ✨",
    "def square(x):\n    return x ** 2  # 平方\n\n\tprint(f'{square(3)=}')",
    "   leading,   inner    and trailing spaces   \n\n\nthree newlines",
    "Numbers 1234567, 3.14159 and 1e-10; Ünïcödé naïve café",
    "<|im_start|>user\nhi<|im_end|> <start_of_turn>model\n<end_of_turn>",
]


def test_encode_and_decode_match_transformers(real_model):
    ours, reference = real_model.exact.tokenizer, real_model.hf_tokenizer
    for text in TEXTS:
        ids = ours.encode(text, add_special_tokens=False)
        assert ids == reference.encode(text, add_special_tokens=False), text
        assert ours.encode(text) == reference.encode(text), text  # BOS where the model wants one (Gemma)
        assert ours.decode(ids, skip_special_tokens=False) == reference.decode(ids, skip_special_tokens=False), text


def test_chat_template_renders_as_transformers(real_model):
    ours, reference = real_model.exact.tokenizer, real_model.hf_tokenizer
    if reference.chat_template is None:  # Gemma 3 270M is the base model: its file has no chat template
        with pytest.raises(ValueError, match="no chat template"):
            ours.apply_chat_template([{"role": "user", "content": "hi"}])
        return
    conversations = [
        [{"role": "user", "content": "Write a haiku about the sea."}],
        [
            {"role": "system", "content": "You answer in French."},
            {"role": "user", "content": "Hello!"},
            {"role": "assistant", "content": "Bonjour !"},
            {"role": "user", "content": "你好吗？"},
        ],
    ]
    for messages in conversations:
        for generation_prompt in (True, False):
            expected = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
            assert ours.apply_chat_template(messages, add_generation_prompt=generation_prompt) == expected


END_OF_TURN = {"qwen2.5-coder-0.5b": ["<|im_end|>", "<|endoftext|>"], "gemma-3-270m": ["<eos>", "<end_of_turn>"]}


def test_generation_stops_at_the_models_end_of_turn_tokens(real_model):
    """Qwen's chat turns end with <|im_end|> (its EOS), Gemma's with <end_of_turn> (not its EOS): both stop."""
    tokenizer = real_model.exact.tokenizer
    for token in END_OF_TURN[real_model.name]:
        token_id = tokenizer.encode(token, add_special_tokens=False)
        assert len(token_id) == 1 and token_id[0] in tokenizer.stop_token_ids
        forced = SamplingParams(max_tokens=8, temperature=0, logit_bias={token_id[0]: 100})
        output = real_model.blocks.generate([tokenizer.encode("Hi")], forced)[0]
        assert output.token_ids == token_id and output.finish_reason == "stop"

"""Loading: GGUF blocks used in place, safetensors directories of every architecture, and bad files."""

import shutil

import gguf
import numpy as np
import pytest
import torch

from carpool import LLM, SamplingParams
from carpool.models import load_model
from carpool.models.loader import default_model_path, resolve_model_dir


@pytest.fixture
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CARPOOL_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path


def _file_mappings(path: str) -> list[tuple[int, int]]:
    """The address ranges of this process that map `path`."""
    ranges = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            if len(fields) >= 6 and fields[5] == path:
                start, end = (int(x, 16) for x in fields[0].split("-"))
                ranges.append((start, end))
    return ranges


def test_gguf_blocks_are_used_from_the_file_in_place(llm):
    """The embedding table (tied LM head) is read straight from the mapped GGUF file: no copy, no fp32."""
    model = llm.engine.model
    mapped = _file_mappings(default_model_path())
    assert mapped
    address = model.embed_tokens.qweight.data_ptr()
    assert any(start <= address < end for start, end in mapped)
    assert model.lm_head.qweight.data_ptr() == address


def _write_gguf(path, architecture: str, tensor_type: gguf.GGMLQuantizationType):
    writer = gguf.GGUFWriter(str(path), architecture)
    block_size, type_size = gguf.GGML_QUANT_SIZES[tensor_type]
    raw = np.zeros((4, 256 // block_size * type_size), dtype=np.uint8)
    writer.add_tensor("blk.0.attn_q.weight", raw, raw_dtype=tensor_type)  # 4 rows of 256 weights
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_an_unsupported_architecture_is_named_with_the_supported_ones(own_cache):
    path = _write_gguf(own_cache / "mamba.gguf", "mamba", gguf.GGMLQuantizationType.Q8_0)
    with pytest.raises(ValueError, match=r"unsupported architecture 'mamba'.*supported: llama.*qwen2.*gemma3"):
        load_model(str(path))


def test_an_unsupported_block_type_is_named_with_the_supported_ones(own_cache):
    path = _write_gguf(own_cache / "iq.gguf", "qwen2", gguf.GGMLQuantizationType.IQ4_NL)
    with pytest.raises(ValueError, match=r"blk.0.attn_q.weight .* block type IQ4_NL.*supported: .*Q4_K.*Q6_K"):
        load_model(str(path))


@pytest.mark.parametrize("keep", [0.5, 1000], ids=["half", "header"])
def test_a_truncated_file_fails_with_its_path_and_the_cause(own_cache, keep):
    source = default_model_path()
    with open(source, "rb") as file:
        data = file.read()
    cut = own_cache / "cut.gguf"
    cut.write_bytes(data[: int(len(data) * keep) if keep < 1 else keep])
    with pytest.raises(ValueError, match="truncated") as error:
        load_model(str(cut))
    assert str(cut) in str(error.value)
    assert not list((own_cache / "cache").glob("cut-*")), "nothing is cached for a file that failed"


def _tiny_hf_model(architecture: str):
    """A small random model of each architecture, with the features that set it apart."""
    transformers = pytest.importorskip("transformers")
    common = {
        "vocab_size": 49152,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,  # random tied embeddings make a model that repeats its last token
    }
    if architecture == "LlamaForCausalLM":
        config = transformers.LlamaConfig(**common)
    elif architecture == "Qwen2ForCausalLM":
        config = transformers.Qwen2Config(**common)
    else:
        config = transformers.Gemma3TextConfig(
            **common,
            sliding_window=4,
            query_pre_attn_scalar=24,
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"],
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            },
        )
    config.architectures = [architecture]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # weights of a trained model's scale, so greedy choices are not near-ties
        for name, parameter in model.named_parameters():
            if "norm" not in name:
                parameter.normal_(0, 0.3)
    model.generation_config.eos_token_id = None
    return model


@pytest.mark.parametrize("architecture", ["LlamaForCausalLM", "Qwen2ForCausalLM", "Gemma3ForCausalLM"])
def test_a_safetensors_directory_matches_transformers(tmp_path, architecture):
    """Hugging Face's own layout and config.json (transformers 5 spelling), through the same model classes;
    Gemma's window of 4 keys is crossed by a prompt prefilled in two chunks and by every decode step."""
    reference = _tiny_hf_model(architecture)
    directory = tmp_path / architecture
    reference.save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(resolve_model_dir(None) / name, directory / name)
    llm = LLM(model=str(directory), quantization="none", dtype="float32", max_num_batched_tokens=7, num_kv_blocks=64)
    prompt = torch.randint(100, 40000, (11,), generator=torch.Generator().manual_seed(1)).tolist()  # chunks: 7, 4
    output = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=0))[0]
    with torch.inference_mode():
        expected = reference.generate(
            torch.tensor([prompt]),
            max_new_tokens=8,
            do_sample=False,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        )
    assert output.token_ids == expected.sequences[0, len(prompt) :].tolist()
    for step, (token, logprob) in enumerate(zip(output.token_ids, output.logprobs)):
        reference_logprob = torch.log_softmax(expected.logits[step][0], dim=-1)[token].item()
        assert logprob.logprob == pytest.approx(reference_logprob, abs=1e-4), step

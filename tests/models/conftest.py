"""The real models of the architecture tests, each loaded once per session: by carpool exactly (fp32, dense),
by carpool on its GGUF blocks, and by transformers from the same GGUF file (the reference, computed here in
the run: fp32 near-ties flip between CPUs, so a stored reference would not hold everywhere)."""

from functools import cached_property
from pathlib import Path

import pytest
import torch

from carpool import LLM
from carpool.models.catalog import model_path

REAL_MODELS = ["qwen2.5-coder-0.5b", "gemma-3-270m"]


class RealModel:
    def __init__(self, name: str):
        self.name = name
        self.path = Path(model_path(name, progress=False))

    @cached_property
    def exact(self) -> LLM:
        return LLM(model=self.name, quantization="none", dtype="float32", max_num_seqs=8, num_kv_blocks=512)

    @cached_property
    def blocks(self) -> LLM:
        return LLM(
            model=self.name, quantization="auto", dtype="float32", max_num_seqs=8, num_kv_blocks=512, matmul="exact"
        )

    @cached_property
    def hf(self):
        transformers = pytest.importorskip("transformers")
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(self.path.parent), gguf_file=self.path.name, dtype=torch.float32
        )
        model.generation_config.eos_token_id = None  # run every requested token, as ignore_eos does on our side
        return model.eval()

    @cached_property
    def hf_tokenizer(self):
        transformers = pytest.importorskip("transformers")
        return transformers.AutoTokenizer.from_pretrained(str(self.path.parent), gguf_file=self.path.name)


@pytest.fixture(scope="session", params=REAL_MODELS)
def real_model(request) -> RealModel:
    """One model at a time (pytest groups the tests by it), its parts built as tests ask for them."""
    return RealModel(request.param)

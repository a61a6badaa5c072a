import pytest

from carpool import LLM


@pytest.fixture(scope="session")
def llm():
    """The default model in fp32 (exact, so outputs can be compared token for token), loaded once for the
    whole session; engine tests must leave it idle and empty."""
    return LLM(max_num_seqs=32, dtype="float32", matmul="exact")


@pytest.fixture(scope="session")
def tokenizer(llm):
    return llm.tokenizer

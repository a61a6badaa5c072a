import pytest

from carpool import LLM


@pytest.fixture(scope="session")
def llm():
    """The default model, loaded once for the whole session (engine tests must leave it idle and empty)."""
    return LLM(max_num_seqs=32)


@pytest.fixture(scope="session")
def tokenizer(llm):
    return llm.tokenizer

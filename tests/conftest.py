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


@pytest.fixture(scope="session")
def postgres_server():
    """A real PostgreSQL server for the tests of the shared stores (carpool.bench.postgres_server), started once."""
    from carpool.bench.postgres_server import PostgresServer, postgres_bin_dir

    bin_dir = postgres_bin_dir()
    if bin_dir is None:
        pytest.fail("PostgreSQL is not installed: `make test` installs Debian's postgresql package")
    server = PostgresServer(bin_dir).start()
    yield server
    server.stop()


@pytest.fixture
def postgres_url(postgres_server, request):
    """A fresh, empty database (a schema of its own) on the session's server, for one test."""
    import re

    return postgres_server.create_schema(re.sub(r"\W", "_", request.node.name)[:40].lower() + f"_{id(request) % 10**6}")

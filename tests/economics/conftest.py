import pytest
from economics_helpers import TEST_SHEET, Clock

from carpool.economics.ledger_gate import LedgerGate
from carpool.economics.prices import load_price_sheet


@pytest.fixture
def prices(tmp_path):
    path = tmp_path / "prices.toml"
    path.write_text(TEST_SHEET)
    return load_price_sheet(path)


@pytest.fixture
def db_path(tmp_path):
    return tmp_path / "carpool.db"


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def gate(db_path, prices, clock):
    gate = LedgerGate(db_path, prices, clock=clock)
    yield gate
    gate.close()

import itertools

import pytest
from economics_helpers import TEST_SHEET, usage

from carpool.economics.prices import (
    SHIPPED_PRICES,
    PriceSheetError,
    load_price_sheet,
)
from carpool.engine.tiers import TIER_NAMES, TIERS

# Prompt of 1000 tokens; a cache read covers 400 of them, a cache write 300 of the uncached rest; a finished
# request generated 200 tokens, an aborted one 50. Test prices: $1 per 1M input, $4 per 1M output.
#   input part, in millionths of a dollar:  no cache 1000 | write 700 + 300*1.25 = 1075
#                                           read 600 + 400*0.1 = 640 | read+write 300 + 375 + 40 = 715
#   output part: finished 800, aborted 200; then times the tier: priority 2, default 1, flex and batch 0.5.
EXPECTED_DOLLARS = {
    # (tier, cache read, cache write, aborted): cost
    ("priority", False, False, False): 0.0036,
    ("priority", False, False, True): 0.0024,
    ("priority", False, True, False): 0.00375,
    ("priority", False, True, True): 0.00255,
    ("priority", True, False, False): 0.00288,
    ("priority", True, False, True): 0.00168,
    ("priority", True, True, False): 0.00303,
    ("priority", True, True, True): 0.00183,
    ("default", False, False, False): 0.0018,
    ("default", False, False, True): 0.0012,
    ("default", False, True, False): 0.001875,
    ("default", False, True, True): 0.001275,
    ("default", True, False, False): 0.00144,
    ("default", True, False, True): 0.00084,
    ("default", True, True, False): 0.001515,
    ("default", True, True, True): 0.000915,
    ("flex", False, False, False): 0.0009,
    ("flex", False, False, True): 0.0006,
    ("flex", False, True, False): 0.0009375,
    ("flex", False, True, True): 0.0006375,
    ("flex", True, False, False): 0.00072,
    ("flex", True, False, True): 0.00042,
    ("flex", True, True, False): 0.0007575,
    ("flex", True, True, True): 0.0004575,
    ("batch", False, False, False): 0.0009,
    ("batch", False, False, True): 0.0006,
    ("batch", False, True, False): 0.0009375,
    ("batch", False, True, True): 0.0006375,
    ("batch", True, False, False): 0.00072,
    ("batch", True, False, True): 0.00042,
    ("batch", True, True, False): 0.0007575,
    ("batch", True, True, True): 0.0004575,
}


def test_expected_table_covers_every_combination():
    assert set(EXPECTED_DOLLARS) == set(itertools.product(TIER_NAMES, (False, True), (False, True), (False, True)))


def combination_usage(tier, read, write, aborted):
    return usage(
        cached=400 if read else 0,
        cache_write=300 if write else 0,
        output=50 if aborted else 200,
        tier=tier,
        finish_reason="abort" if aborted else "stop",
    )


@pytest.mark.parametrize("combination", sorted(EXPECTED_DOLLARS))
def test_cost_equals_hand_computed(prices, combination):
    assert prices.cost(combination_usage(*combination)) == pytest.approx(EXPECTED_DOLLARS[combination], rel=1e-12)


def test_shipped_sheet_has_the_issue_multipliers_and_output_above_input():
    sheet = load_price_sheet()
    assert (sheet.cache_read, sheet.cache_write) == (0.1, 1.25)
    assert sheet.tiers == {"priority": 2.0, "default": 1.0, "flex": 0.5, "batch": 0.5}
    assert sheet.tiers == {tier.name: tier.price_multiplier for tier in TIERS}  # the tier table's defaults
    for name, price in sheet.models.items():
        assert price.output > price.input, name
    assert sheet.covers("some-model-without-an-entry")


def test_unknown_model_falls_back_to_star_entry_or_fails_naming_it(prices, tmp_path):
    assert not prices.covers("other")
    with pytest.raises(PriceSheetError, match='models."other"'):
        prices.cost(usage(model="other"))
    path = tmp_path / "star.toml"
    path.write_text(TEST_SHEET + '\n[models."*"]\ninput = 2.0\noutput = 8.0\n')
    assert load_price_sheet(path).cost(usage(model="other", output=0)) == pytest.approx(0.002)


def test_a_tier_the_sheet_leaves_out_costs_its_default(tmp_path):
    path = tmp_path / "partial.toml"
    path.write_text(TEST_SHEET.replace("priority = 2.0", "priority = 3.0").replace("flex = 0.5", ""))
    tiers = load_price_sheet(path).tiers
    assert tiers["priority"] == 3.0
    assert tiers["flex"] == next(tier.price_multiplier for tier in TIERS if tier.name == "flex")
    path.write_text(TEST_SHEET.split("[tiers]")[0] + "[models" + TEST_SHEET.split("[models", 1)[1])
    assert load_price_sheet(path).tiers == {tier.name: tier.price_multiplier for tier in TIERS}


def test_unknown_tier_is_refused(prices):
    with pytest.raises(ValueError, match="'auto'"):
        prices.cost(usage(tier="auto"))


BAD_SHEETS = {
    "missing model field": (TEST_SHEET.replace("output = 4.0", ""), 'models."test-model".output is missing'),
    "negative price": (
        TEST_SHEET.replace("input = 1.0", "input = -1.0"),
        'models."test-model".input must not be negative',
    ),
    "price not a number": (
        TEST_SHEET.replace("input = 1.0", 'input = "1.0"'),
        'models."test-model".input must be a number',
    ),
    "misspelt field": (TEST_SHEET.replace("input = 1.0", "inptu = 1.0"), 'unknown entry models."test-model".inptu'),
    "misspelt tier": (TEST_SHEET.replace("flex = 0.5", "flexible = 0.5"), "unknown entry tiers.flexible"),
    "tiers not a table": (
        "tiers = 2\n" + TEST_SHEET.replace("[tiers]\npriority = 2.0\ndefault = 1.0\nflex = 0.5\nbatch = 0.5", ""),
        r"\[tiers\] must be a table",
    ),
    "missing section": (TEST_SHEET.replace("[cache]\nread = 0.1\nwrite = 1.25", ""), r"\[cache\] is missing"),
    "no models": (TEST_SHEET.split("[models")[0], r"\[models\] is missing or empty"),
    "model not a table": (
        TEST_SHEET.split("[models")[0] + '[models]\n"test-model" = 3\n',
        'models."test-model" must be a table',
    ),
    "malformed TOML": (TEST_SHEET.replace("input = 1.0", "input = "), "not valid TOML"),
    "unknown section": (TEST_SHEET + "\n[discounts]\nx = 1\n", "unknown entry discounts"),
}


@pytest.mark.parametrize("case", sorted(BAD_SHEETS))
def test_bad_sheet_fails_with_message_naming_file_and_entry(tmp_path, case):
    text, message = BAD_SHEETS[case]
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(PriceSheetError, match=message) as raised:
        load_price_sheet(path)
    assert str(path) in str(raised.value)


def test_missing_file_fails_naming_it(tmp_path):
    with pytest.raises(PriceSheetError, match="nope.toml: cannot read"):
        load_price_sheet(tmp_path / "nope.toml")


def test_shipped_sheet_is_the_default():
    assert load_price_sheet().source == str(SHIPPED_PRICES)


def test_shipped_sheet_prices_every_catalog_model_under_its_served_name():
    """A catalog model served by its short name (or the default one by its file's name) gets its own price, not
    the catch-all's, which is several times the small models' rate."""
    from carpool.models.catalog import MODELS, served_name

    sheet = load_price_sheet()
    assert {*MODELS, served_name(None)} <= sheet.models.keys()

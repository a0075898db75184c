import pytest

from hfsplit.budget import parse_max_memory, parse_size
from hfsplit.errors import BudgetError

GiB = 2**30


@pytest.mark.parametrize("text, expected", [
    ("24GiB", 24 * GiB), ("24gib", 24 * GiB), ("24GB", 24 * 10**9), ("512MiB", 512 * 2**20),
    ("512mb", 512 * 10**6), ("1.5GiB", int(1.5 * GiB)), (1024, 1024), ("2048", 2048),
])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("spec, expected", [
    ("4x24GiB", {str(i): 24 * GiB for i in range(4)}),
    ("24GiB,12GiB,12GiB", {"0": 24 * GiB, "1": 12 * GiB, "2": 12 * GiB}),
    ("2x24GiB, 12GiB", {"0": 24 * GiB, "1": 24 * GiB, "2": 12 * GiB}),
    ({0: "24GiB", 1: "12GiB"}, {"0": 24 * GiB, "1": 12 * GiB}),
    ({0: 1000, "cpu": "64GiB"}, {"0": 1000, "cpu": 64 * GiB}),
    ({"cuda:1": "1GB"}, {"cuda:1": 10**9}),
    ("16GiB", {"0": 16 * GiB}),
])
def test_parse_max_memory(spec, expected):
    assert parse_max_memory(spec) == expected


@pytest.mark.parametrize("spec, names", [
    ("24GiX", "24GiX"), ("4x", "4x"), ("0x24GiB", "0x24GiB"), ("24GiB,,12GiB", "''"),
    ({0: "lots"}, "max_memory[0]"), ({"gpu0": "1GiB"}, "gpu0"), ("-3GiB", "-3GiB"), ({}, "empty"),
    ({"disk": "1TiB"}, "disk"), ("1.5", "no unit"),
])
def test_malformed_budget_names_the_bad_part_and_shows_an_example(spec, names):
    with pytest.raises(BudgetError) as err:
        parse_max_memory(spec)
    message = str(err.value)
    assert names in message
    if "disk" not in message:
        assert "4x24GiB" in message  # a valid example is shown

from batch_fakes import EchoEndpoint, request_line, write_lines

from carpool.server.batch.limits import BatchLimits
from carpool.server.batch.validation import validate_file

ENDPOINT = "/v1/completions"


def test_blank_lines_are_skipped_but_counted_in_line_numbers(tmp_path):
    path = tmp_path / "in.jsonl"
    write_lines(path, [request_line("a", "x"), "", "  ", '{"custom_id": "b"}'])
    result = validate_file(path, ENDPOINT, EchoEndpoint().check_body, BatchLimits())
    assert result.total == 2
    assert [(e["line"], e["code"], e["param"]) for e in result.errors] == [(4, "invalid_method", "method")]


def test_more_requests_than_the_limit_fail_with_one_clear_error(tmp_path):
    path = tmp_path / "in.jsonl"
    write_lines(path, [request_line(f"r{i}", "x") for i in range(4)])
    result = validate_file(path, ENDPOINT, EchoEndpoint().check_body, BatchLimits(max_requests=3))
    assert [e["code"] for e in result.errors] == ["too_many_requests"]
    assert "more than 3 requests" in result.errors[0]["message"]


def test_an_empty_file_is_an_error(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text("\n\n")
    result = validate_file(path, ENDPOINT, EchoEndpoint().check_body, BatchLimits())
    assert [e["code"] for e in result.errors] == ["empty_file"]


def test_past_the_reporting_cap_errors_are_counted_not_listed(tmp_path):
    path = tmp_path / "in.jsonl"
    write_lines(path, ["nope"] * 7)
    result = validate_file(path, ENDPOINT, EchoEndpoint().check_body, BatchLimits(max_reported_errors=5))
    assert [e["line"] for e in result.errors[:5]] == [1, 2, 3, 4, 5]
    assert result.errors[5]["code"] == "too_many_errors" and "2 more lines" in result.errors[5]["message"]
    assert result.num_errors == 7

"""The greedy-token bench checks the kernel against max's indices before it times either, and prints a row a size."""

from carpool.bench import greedy


def test_prints_a_row_per_size(capsys):
    greedy.main(["--rows", "1", "3", "--vocab", "300", "--threads", "1"])
    lines = capsys.readouterr().out.splitlines()[2:]
    assert [line.split(" | ")[:2] for line in lines] == [["| 1", "1"], ["| 1", "3"]]
    assert all(float(line.split(" | ")[4].rstrip("x")) > 0 for line in lines)

"""`python -m carpool.bench.weights_memory` on the default model: each process's figures, and the layout file the
first one writes."""

from carpool.bench import weights_memory


def test_the_memory_bench_reports_each_process_and_writes_the_layout_file(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("CARPOOL_CACHE_DIR", str(tmp_path))  # the children inherit it
    assert weights_memory.main(["--cold"]) == 0
    lines = capsys.readouterr().out.splitlines()
    labels = ["first", "second", "replica 1", "replica 2", "both, #1", "both, #2", "both up"]
    assert [line.split("  ")[0].split(":")[0].strip() for line in lines] == labels
    assert all("RSS" in line and "PSS" in line for line in lines)
    assert len(list(tmp_path.glob("*/layouts-auto-*.bin"))) == 1


def test_memory_reads_this_process():
    figures = weights_memory.memory()
    assert 0 < figures["pss"] <= figures["rss"] <= figures["hwm"]
    assert figures["rss_anon"] > 0 and figures["rss_file"] > 0

"""test_reproducible.py's batch, prefix-cache and chunk-boundary cases on every other kernel path this CPU can run
(kernel_paths.py: a fresh interpreter per path), each path's own arithmetic held to the same promise. The portable
path runs the prefix-cache cases only: its plain-C GEMV takes every row count (no batched kernel), and the batch
cases took it 4.5 minutes on a 2-core VM."""

from pathlib import Path

import pytest
from kernel_paths import OTHER_PATHS, run_on_path

TESTS = str(Path(__file__).with_name("test_reproducible.py"))


@pytest.mark.parametrize("path", OTHER_PATHS)
def test_reproducible_on_every_path_this_cpu_runs(path):
    cases = "defaults or prefix" if path == "portable" else "defaults or batch or prefix or chunk"
    run_on_path(path, [TESTS], 900, "-k", cases)

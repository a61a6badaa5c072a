"""`carpool serve --step-log FILE`: every engine step's shape and time, one JSON line each, for `carpool cost whatif
--steps FILE` to fit its step model on the steps the recorded traffic really took.

A step model fitted on a fresh engine (carpool.bench.simulate.measured_steps) is a second measurement of the
machine, at another moment: three quiet fits within half an hour differed by 40% in the base cost and 2x in the
context term, and moved whatif's ITL p50s by 10-25% against real runs (docs/benchmarks/journal.md, 2026-12-06 11:51).
The served engine's own steps are the traffic's, on the machine as it was while serving it. Lines are buffered and
written by the engine thread (a few microseconds a step); the file is appended to, so a restart keeps the past.
"""

import json
import time
from pathlib import Path

from carpool.engine.llm_engine import StepStats
from carpool.engine.step_shape import FIT_FIELDS, fit_row

FLUSH_STEPS = 200  # about 10 s of steps at a 50 ms cadence; a crash loses at most these


class StepLog:
    def __init__(self, path: str):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", encoding="utf-8")
        self._pending = 0

    def listener(self, model: str):
        """A step listener (AsyncEngine.add_step_listener) that logs `model`'s steps."""

        def on_step(stats: StepStats | None, outputs) -> None:
            if stats is None or not stats.num_tokens:  # an abort, or a step that scheduled nothing
                return
            self._file.write(json.dumps(step_line(model, stats)) + "\n")
            self._pending += 1
            if self._pending >= FLUSH_STEPS:
                self.flush()

        return on_step

    def flush(self) -> None:
        self._file.flush()
        self._pending = 0

    def close(self) -> None:
        self._file.close()


def step_line(model: str, stats: StepStats) -> dict:
    return {"time": time.time(), "model": model, **dict(zip(FIT_FIELDS, fit_row(stats)))}


def read_steps(path: str, model: str, since: float | None = None, until: float | None = None) -> list[tuple]:
    """`model`'s logged steps in [since, until) as StepModel.fit reads them: (prompt tokens, decoding sequences,
    KV tokens the decodes read, prompt chunks' query-key pairs, seconds). ValueError naming --steps for a file that
    is not a step log."""
    steps = []
    try:
        with open(path, encoding="utf-8") as lines:
            for number, line in enumerate(lines, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                    at, fields = row["time"], tuple(row[k] for k in FIT_FIELDS)
                except (ValueError, KeyError, TypeError) as error:
                    if number > 1 and not line.endswith("\n"):  # the last line of a server still writing
                        break
                    raise ValueError(
                        f"--steps: {path} line {number} is not a `carpool serve --step-log` line: {error!r}"
                    ) from None
                if row["model"] == model and (since is None or at >= since) and (until is None or at < until):
                    steps.append(fields)
    except OSError as error:
        raise ValueError(f"--steps: cannot read {path}: {error}") from None
    return steps

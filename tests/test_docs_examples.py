"""Every code example in README.md and docs/ runs, so the docs cannot drift from the code.

What runs, by the fence's language:
- python: executed in this process against the library (the default SmolLM2-135M, few tokens); a block that
  talks to `http://127.0.0.1:8000` (the address `make serve` listens on) runs against a real `carpool serve`
  started for these tests (tests/live_server.py), the address rewritten to its port.
- sh: run by bash (`set -euo pipefail`) in a scratch folder, with `carpool` and `python` on the PATH (this
  checkout and this interpreter, as in an activated venv; `carpool` through tests/cli_fork_server.py, so thirty
  calls do not import torch thirty times), a scratch `CARPOOL_DB` and `CARPOOL_BATCH_DIR`, and the same rewrite
  for the live server.
- toml, json, jsonl: parsed; a TOML file declaring `[[cascade]]` is loaded as `carpool serve --cascades` would
  load it, a price sheet as `--prices` would.
Anything else (mermaid, text) is not code. A block that cannot run here (it starts a long-lived server, runs a
benchmark for minutes, needs PostgreSQL or Ray) says so on the line before it, `<!-- not-run: REASON -->`, and
the reason is checked to be there. The dated journal is a record of commands as they were run, exempt whole.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest
from cli_fork_server import CliForkServer
from live_server import LiveServer

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
# Kept as the commands were run when each dated figure was measured (minutes to hours each, some on other CPUs).
RECORDS = {"docs/benchmarks/journal.md"}
SERVER_ADDRESS = "http://127.0.0.1:8000"
RUNNABLE = {"python", "sh", "toml", "json", "jsonl"}
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
NOT_RUN = re.compile(r"<!--\s*not-run:\s*(.*?)\s*-->\s*\Z", re.DOTALL)
SHELL_SECONDS = 120


@dataclass(frozen=True)
class Example:
    page: str
    line: int
    language: str
    code: str
    not_run: str | None  # the reason, when the page marks the block as not run

    @property
    def name(self) -> str:
        return f"{self.page}:{self.line}"


def examples() -> list[Example]:
    found = []
    for path in PAGES:
        page = str(path.relative_to(ROOT))
        if page in RECORDS:
            continue
        text = path.read_text()
        for match in FENCE.finditer(text):
            marker = NOT_RUN.search(text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1])
            line = text.count("\n", 0, match.start()) + 1
            found.append(Example(page, line, match.group(1), match.group(2), marker.group(1) if marker else None))
    return found


EXAMPLES = examples()


@pytest.fixture(scope="module")
def live():
    """Started the first time a block asks for it; without keys, like `make serve`."""
    server = LiveServer()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def carpool_on_path(tmp_path_factory) -> Path:
    """`carpool` running this checkout's code (forked from one process that imported it: a call costs
    milliseconds, not the seconds of importing torch), and `python` its interpreter, as in an activated venv."""
    folder = tmp_path_factory.mktemp("bin")
    server = CliForkServer()
    server.install(folder)
    python = folder / "python"
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    python.chmod(0o755)
    yield folder
    server.stop()


def test_the_pages_have_examples_and_every_marker_gives_a_reason():
    assert len([e for e in EXAMPLES if e.language in RUNNABLE and e.not_run is None]) >= 20
    vague = [e.name for e in EXAMPLES if e.not_run is not None and len(e.not_run.split()) < 3]
    assert vague == [], "a not-run marker says why, in a few words"


def test_every_fence_names_its_language():
    """An unnamed fence would be neither run nor exempt."""
    assert [e.name for e in EXAMPLES if not e.language] == []


@pytest.mark.parametrize("example", [e for e in EXAMPLES if e.language in RUNNABLE], ids=lambda e: e.name)
def test_example_runs(example: Example, request, tmp_path, monkeypatch):
    if example.not_run is not None:
        pytest.skip(f"not run: {example.not_run}")
    code = example.code
    if SERVER_ADDRESS in code:  # started before the chdir below: it runs `python -m carpool.cli` from this checkout
        code = code.replace(SERVER_ADDRESS, request.getfixturevalue("live").url)
    monkeypatch.chdir(tmp_path)
    if example.language == "python":
        _run_python(code, example)
    elif example.language == "sh":
        _run_shell(code, example, tmp_path, request.getfixturevalue("carpool_on_path"))
    elif example.language == "toml":
        _check_toml(code, tmp_path)
    elif example.language == "json":
        json.loads(code)
    else:
        for line in code.splitlines():
            json.loads(line)


def _run_python(code: str, example: Example) -> None:
    # The docs' own snippets, run as a reader would paste them: executing them is this test's purpose.
    exec(compile(code, example.name, "exec"), {"__name__": "__docs__"})  # noqa: S102


def _run_shell(code: str, example: Example, folder: Path, bin_dir: Path) -> None:
    env = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH")))),  # this checkout
        "CARPOOL_DB": str(folder / "carpool.db"),
        "CARPOOL_BATCH_DIR": str(folder / "batches"),
    }
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", code],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=SHELL_SECONDS,
    )
    assert done.returncode == 0, f"{example.name} exited {done.returncode}:\n{done.stdout[-3000:]}{done.stderr[-3000:]}"


def _check_toml(code: str, folder: Path) -> None:
    document = tomllib.loads(code)
    if "cascade" in document:
        from carpool.server.cascade.config import load_cascades

        path = folder / "cascades.toml"
        path.write_text(code)
        served = [step["model"] for cascade in document["cascade"] for step in cascade["step"]]
        load_cascades(str(path), list(dict.fromkeys(served)))
    elif "models" in document:
        from carpool.economics.prices import load_price_sheet

        path = folder / "prices.toml"
        path.write_text(code)
        load_price_sheet(path)


def test_the_readme_links_resolve():
    """README.md lives outside docs/, where `mkdocs build --strict` checks every link: its links are checked here."""
    text = (ROOT / "README.md").read_text()
    for target in re.findall(r"\]\(([^)#]+\.md)(?:#([\w-]+))?\)", text):
        page = ROOT / target[0]
        assert page.is_file(), target[0]
        if target[1]:
            headings = re.findall(r"^#+ (.+)$", page.read_text(), re.MULTILINE)
            assert target[1] in {re.sub(r"[^\w\- ]", "", h).strip().lower().replace(" ", "-") for h in headings}, target


def test_the_runner_runs_shell_with_carpool_on_the_path(carpool_on_path, tmp_path):
    assert shutil.which("carpool", path=str(carpool_on_path)) is not None
    example = Example("x.md", 1, "sh", "false\n", None)
    with pytest.raises(AssertionError, match="exited 1"):
        _run_shell(example.code, example, tmp_path, carpool_on_path)


def test_a_marker_applies_only_to_the_block_right_after_it(tmp_path, monkeypatch):
    page = tmp_path / "page.md"
    page.write_text(
        "<!-- not-run: needs a GPU machine -->\n```sh\nnvidia-smi\n```\n\ntext\n\n```sh\ncarpool --help\n```\n"
    )
    monkeypatch.setattr(sys.modules[__name__], "PAGES", [page])
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    first, second = examples()
    assert first.not_run == "needs a GPU machine" and second.not_run is None


def test_the_api_reference_names_every_route():
    """Every path the server's modules declare (`@app.get("/...")`, `@router.post("/...")`) is in docs/api.md
    (the dashboard's page paths, named through a constant, are listed there by hand)."""
    routes = set()
    for path in (ROOT / "carpool").rglob("*.py"):
        routes.update(
            re.findall(r'@(?:app|router)\.(?:get|post|put|delete)\(\s*(?:PAGE_PATHS\[\d\]|"([^"]+)")', path.read_text())
        )
    routes.discard("")
    reference = (ROOT / "docs" / "api.md").read_text()
    missing = sorted(route for route in routes if re.sub(r"\{(\w+)(:path)?\}", "{\\1}", route) not in reference)
    assert len(routes) >= 15 and missing == []


def test_the_api_reference_names_every_request_field():
    """Every field a completion body may carry, standard or extension or refused, is in docs/api.md."""
    from carpool.server.protocol import ChatCompletionRequest, CompletionRequest

    reference = (ROOT / "docs" / "api.md").read_text()
    fields = {
        field.alias or name
        for model in (ChatCompletionRequest, CompletionRequest)
        for name, field in model.model_fields.items()
    }
    assert sorted(name for name in fields if f"`{name}`" not in reference) == []


def test_the_paths_the_pages_name_exist():
    """A page that names a file (`carpool/engine/door.py`, `kernels/csrc/ggml_gemm.cpp`) names one that exists."""
    named = {
        (str(path.relative_to(ROOT)), name)
        for path in PAGES
        if str(path.relative_to(ROOT)) not in RECORDS
        for name in re.findall(r"`((?:carpool|tests|docs|kernels)/[\w./-]+)`", path.read_text())
    }
    assert len(named) >= 20
    assert (
        sorted(item for item in named if not ((ROOT / item[1]).exists() or (ROOT / "carpool" / item[1]).exists())) == []
    )

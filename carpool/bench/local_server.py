"""A carpool server on a thread of this process, with a ledger and a batch dir of its own in a work folder:
benchmarks that report the ledger's figures read them straight from its gate."""

import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Self

import httpx
import uvicorn

from carpool.economics.ledger_gate import LedgerGate
from carpool.economics.prices import load_price_sheet
from carpool.engine.async_engine import AsyncEngine
from carpool.engine.config import EngineConfig
from carpool.models.loader import default_model_path, model_name
from carpool.server.app import create_app

STARTUP_SECONDS = 300


class LocalServer:
    def __init__(self, config: EngineConfig, workdir: Path):
        self.model = model_name(config.model or default_model_path())
        self.gate = LedgerGate(workdir / "ledger.db", load_price_sheet())
        app = create_app(AsyncEngine(config), self.gate, model_name=self.model, batch_dir=str(workdir / "batches"))
        port = free_port()
        self.url = f"http://127.0.0.1:{port}/v1"
        self._server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        self._thread = threading.Thread(target=self._server.run, name="carpool-bench-server", daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        deadline = time.monotonic() + STARTUP_SECONDS
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the benchmark's server did not start")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc) -> None:
        self._server.should_exit = True
        self._thread.join()
        self.gate.close()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_healthy(url: str, process: subprocess.Popen, timeout: float, on_answer=None) -> bool:
    """Poll `url`/health until it answers 200 (True), or `process` exits or `timeout` seconds pass (False);
    `on_answer(status, body)` sees every answer (a warming server's 503s included)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and process.poll() is None:
        try:
            response = httpx.get(f"{url}/health", timeout=1)
            if on_answer is not None:
                on_answer(response.status_code, response.json())
            if response.status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.02)
    return False

"""A real `carpool serve` process on a free loopback port, with its own ledger and batch folder; or any ASGI app
served in a thread of the test process."""

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

import httpx
import openai
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from carpool.bench.local_server import free_port, wait_healthy

STARTUP_SECONDS = 180


class LiveServer:
    def __init__(self, *args: str, api_key: str | None = None, home: str | None = None, warmup: bool = False):
        # No warm-up unless asked: it runs every step shape once (seconds a server, minutes on a loaded CI
        # machine) and most tests are about behaviour, not first-request latency (tests/server/test_warmup.py).
        args = args if warmup or "--no-warmup" in args else ("--no-warmup", *args)
        self.args, self.api_key, self.warmup = args, api_key, warmup
        self.home = home or tempfile.mkdtemp(prefix="carpool-test-home-")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        keys = ["--api-key", api_key] if api_key else []
        env = {
            **os.environ,
            "CARPOOL_DB": os.path.join(self.home, "carpool.db"),
            "CARPOOL_BATCH_DIR": os.path.join(self.home, "batches"),
        }
        self.log = tempfile.NamedTemporaryFile("w+", prefix="carpool-serve-", suffix=".log")
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "carpool.cli",
                "serve",
                "--port",
                str(self.port),
                "--log-level",
                "warning",
                *keys,
                *args,
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        self._wait_ready()

    def _wait_ready(self, on_answer=None) -> None:
        if wait_healthy(self.url, self.process, STARTUP_SECONDS, on_answer):
            return
        self.stop()
        raise AssertionError(f"carpool serve did not become healthy:\n{self.output()}")

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()[-5000:]

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.close()

    def kill(self) -> None:
        """No shutdown of any kind: what a power cut or the OOM killer would do."""
        self.process.send_signal(signal.SIGKILL)
        self.process.wait()
        self.log.close()

    def restart(self) -> "LiveServer":
        """A new process on the same ledger and batch folder."""
        return LiveServer(*self.args, api_key=self.api_key, home=self.home, warmup=self.warmup)

    def client(self, **options) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=self.api_key or "unused", max_retries=0, **options)

    def http(self) -> httpx.Client:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=60)

    def metrics(self) -> dict[tuple[str, frozenset], float]:
        """Every sample on /metrics, keyed by (name, labels other than model_name)."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        return {
            (sample.name, frozenset((k, v) for k, v in sample.labels.items() if k != "model_name")): sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
        }

    def wait_idle(self, timeout: float = 60) -> dict[tuple[str, frozenset], float]:
        """The metrics once no request runs or waits and every KV block is back in the pool."""
        idle = frozenset()
        deadline = time.monotonic() + timeout
        while True:
            sample = self.metrics()
            if (
                sample[("carpool:num_requests_running", idle)] == 0
                and sample[("carpool:num_requests_waiting", idle)] == 0
                and sample[("carpool:kv_cache_usage_perc", idle)] == 0
            ):
                return sample
            if time.monotonic() > deadline:
                raise AssertionError(f"server not idle after {timeout}s: {sample}")
            time.sleep(0.05)


class ServedApp:
    """The app served by uvicorn on a loopback port in a thread (lifespan included), with an httpx client."""

    def __init__(self, app):
        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> httpx.Client:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        self.client = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=60)
        return self.client

    def __exit__(self, *exc):
        self.client.close()
        self.server.should_exit = True
        self.thread.join(30)

"""Warm start, measured: the first request's time to first token against the same request's steady state, in a
fresh `carpool serve` per trial (a cold start needs a new process), with the warm-up and with `--no-warmup`.

    python -m carpool.bench.warm_start --trials 3 [-- any carpool serve flags]

Prints one line per trial and, per mode, the median first/steady ratio and the median time until /health said ok.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import httpx

from carpool.bench.local_server import free_port, wait_healthy

PROMPT = [{"role": "user", "content": "Write a haiku about carpools."}]
REQUESTS = 6  # the first, one more, and four whose median is the steady state
STARTUP_SECONDS = 600


def time_to_first_token(url: str, model: str) -> float:
    body = {"model": model, "messages": PROMPT, "max_tokens": 2, "temperature": 0, "stream": True}
    start = time.monotonic()
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=300) as response:
        for line in response.iter_lines():
            if line.startswith("data:") and '"content"' in line:
                return time.monotonic() - start
    raise RuntimeError(f"no token came back from {url}")


def trial(serve_flags: list[str]) -> dict:
    port, home = free_port(), tempfile.mkdtemp(prefix="carpool-warm-start-")
    url = f"http://127.0.0.1:{port}"
    env = {
        **os.environ,
        "CARPOOL_DB": os.path.join(home, "carpool.db"),
        "CARPOOL_BATCH_DIR": os.path.join(home, "batches"),
    }
    start = time.monotonic()
    server = subprocess.Popen(
        [sys.executable, "-m", "carpool.cli", "serve", "--port", str(port), "--log-level", "warning", *serve_flags],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        if not wait_healthy(url, server, STARTUP_SECONDS):
            raise RuntimeError(f"carpool serve {' '.join(serve_flags)} did not become healthy")
        ready = time.monotonic() - start
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        times = [time_to_first_token(url, model) for _ in range(REQUESTS)]
    finally:
        server.terminate()
        server.wait(30)
    steady = statistics.median(times[2:])
    return {"ready_s": ready, "first_s": times[0], "second_s": times[1], "steady_s": steady, "ratio": times[0] / steady}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=3, help="fresh servers per mode (default: 3)")
    parser.add_argument("--json", default=None, help="also write every trial here")
    parser.add_argument("serve_flags", nargs="*", help="flags for carpool serve (after --)")
    args = parser.parse_args(argv)
    results = {"warm-up": [], "--no-warmup": []}
    for _ in range(args.trials):
        for mode, flags in (("warm-up", []), ("--no-warmup", ["--no-warmup"])):
            row = trial([*flags, *args.serve_flags])
            results[mode].append(row)
            print(
                f"{mode:12s} ready {row['ready_s']:6.1f} s  first {1000 * row['first_s']:7.1f} ms  second "
                f"{1000 * row['second_s']:7.1f} ms  steady {1000 * row['steady_s']:7.1f} ms  first/steady "
                f"{row['ratio']:5.2f}",
                flush=True,
            )
    for mode, rows in results.items():
        print(
            f"{mode:12s} median first/steady {statistics.median(r['ratio'] for r in rows):.2f}, median ready "
            f"{statistics.median(r['ready_s'] for r in rows):.1f} s"
        )
    if args.json:
        with open(args.json, "w") as out:
            json.dump(results, out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

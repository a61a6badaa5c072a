"""Where a loaded model's memory goes: load time, steady RSS and PSS split into anonymous and file-backed pages, the
peak while loading (VmHWM), and two replicas side by side, each in a fresh process (`carpool.llm`, one short request
so the weights used in place are paged in).

    python -m carpool.bench.weights_memory --model qwen2.5-coder-1.5b [--cold]

--cold deletes the model's layout files first (carpool.models.layout_cache), so the first process builds the fused
and rearranged matrices into one and the others map it.
"""

import argparse
import json
import subprocess
import sys
import time

GIB = 1 << 30


def memory(pid: str = "self") -> dict:
    """Bytes from /proc: RSS (anonymous, file-backed), PSS (anonymous, file-backed) and the peak RSS (VmHWM)."""
    fields = {}
    for name in ("status", "smaps_rollup"):
        with open(f"/proc/{pid}/{name}") as file:
            for line in file:
                key, _, value = line.partition(":")
                if value.strip().endswith("kB"):
                    fields[key] = int(value.split()[0]) * 1024
    keys = {"rss": "VmRSS", "rss_anon": "RssAnon", "rss_file": "RssFile", "hwm": "VmHWM", "pss": "Pss"}
    keys |= {"pss_anon": "Pss_Anon", "pss_file": "Pss_File"}
    return {ours: fields.get(theirs, 0) for ours, theirs in keys.items()}


def child(model: str) -> None:
    """Load, answer one request, print the figures; print them again when told (the other replica is up)."""
    start = time.monotonic()
    from carpool.engine.sampling_params import SamplingParams
    from carpool.llm import LLM

    llm = LLM(model)
    load_s = time.monotonic() - start
    llm.generate("def fib(n):", SamplingParams(max_tokens=4, temperature=0))
    _, kv_resident = llm.engine.kv_pool_memory()
    print(json.dumps({"load_s": load_s, "kv_resident": kv_resident, **memory()}), flush=True)
    sys.stdin.readline()
    print(json.dumps({"kv_resident": kv_resident, **memory()}), flush=True)
    sys.stdin.readline()  # up until the other replica has been measured too


def spawn(model: str) -> subprocess.Popen:
    command = [sys.executable, "-m", __spec__.name, "--child", *(["--model", model] if model else [])]
    return subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def row(label: str, figures: dict) -> str:
    load = f"load {figures['load_s']:5.1f} s  " if "load_s" in figures else ""
    gib = {k: v / GIB for k, v in figures.items() if k != "load_s"}
    return (
        f"{label:10s} {load}RSS {gib['rss']:.2f} GiB (anon {gib['rss_anon']:.2f}, file {gib['rss_file']:.2f})  "
        f"PSS {gib['pss']:.2f} (anon {gib['pss_anon']:.2f}, file {gib['pss_file']:.2f})  peak {gib['hwm']:.2f}  "
        f"KV resident {gib['kv_resident']:.2f}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a GGUF file or catalog name (default: the default model)")
    parser.add_argument("--cold", action="store_true", help="delete the model's cached weight layout first")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args.model)
        return 0
    if args.cold:
        from carpool.models.layout_cache import forget_layouts

        forget_layouts(args.model)
    for label in ("first", "second"):  # one at a time: the first builds the layout file (with --cold), the second maps
        alone = spawn(args.model)
        print(row(label, json.loads(alone.stdout.readline())), flush=True)
        alone.communicate("\n\n")
    replicas = []
    for i in range(2):  # started one after the other, then measured again with both up
        replicas.append(spawn(args.model))
        print(row(f"replica {i + 1}", json.loads(replicas[-1].stdout.readline())), flush=True)
    both = []
    for replica in replicas:  # PSS splits the pages they share between them
        replica.stdin.write("\n")
        replica.stdin.flush()
        both.append(json.loads(replica.stdout.readline()))
    for i, figures in enumerate(both):
        print(row(f"both, #{i + 1}", figures))
    print(
        f"both up: PSS total {sum(f['pss'] for f in both) / GIB:.2f} GiB, RSS total {sum(f['rss'] for f in both) / GIB:.2f}"
    )
    for replica in replicas:
        replica.communicate("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

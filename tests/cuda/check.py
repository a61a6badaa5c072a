"""carpool's CUDA path checked against its CPU fp32 path, for a session lent a GPU (CI has none; pytest never
collects this file). The GPU machine takes at most 64 MiB of working tree, so the check runs on the default model
cut to its first 6 layers (45 MiB; the shallower model's near-ties make token-for-token checks harder to pass):

    .venv/bin/python tests/cuda/check.py cut .gpucheck/smollm2-6layers.gguf      # here, once
    python3 tests/cuda/check.py .gpucheck/smollm2-6layers.gguf [cuda|cpu]         # there (cpu: a dry run here)

There the kernels must be built first and the packages its image lacks carried as wheels: docs/benchmarks/journal.md
("CUDA") has the whole command. Each check prints PASS or FAIL and the run goes on; the last line counts failures.
"""

import json
import os
import subprocess
import sys
import tempfile
import time
import traceback

import torch

from carpool import LLM, SamplingParams
from carpool.bench.local_server import free_port, wait_healthy
from carpool.engine.structured.spec import StructuredOutput

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away,",
    "List three colours: red,",
    "The quick brown fox jumps over the lazy dog. " * 6,
    "1, 2, 3, 4, 5,",
    "In 1969, astronauts",
    "import numpy as np\n",
]
GREEDY = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
EXACT = {"dtype": "float32", "matmul": "exact"}  # CPU: dequantized weights, as CUDA always runs them


def cut_layers(destination: str, keep: int = 6) -> None:
    """The default model's GGUF with only its first `keep` decoder layers (metadata and tokenizer kept)."""
    import numpy as np
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    from carpool.models.catalog import default_model_path

    reader = GGUFReader(default_model_path())
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    writer = GGUFWriter(destination, arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        kind, parts = field.types[0], field.parts

        def value(i, sub):
            return bytes(parts[i]).decode() if sub == GGUFValueType.STRING else parts[i].tolist()[0]

        if kind == GGUFValueType.ARRAY:
            writer.add_key_value(name, [value(i, field.types[-1]) for i in field.data], kind, sub_type=field.types[-1])
        else:
            writer.add_key_value(name, keep if name == f"{arch}.block_count" else value(field.data[0], kind), kind)
    for tensor in reader.tensors:
        if not tensor.name.startswith("blk.") or int(tensor.name.split(".")[1]) < keep:
            data = np.asarray(tensor.data)
            writer.add_tensor(tensor.name, data, raw_shape=data.shape, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def tokens(llm: LLM, prompts=PROMPTS, params=GREEDY) -> list[list[int]]:
    return [output.token_ids for output in llm.generate(prompts, params)]


def agreeing(a: list[list[int]], b: list[list[int]]) -> str:
    """Tokens equal up to each sequence's first difference, over all tokens; an error below 90%."""
    same = sum(next((i for i, (x, y) in enumerate(zip(s, t)) if x != y), len(s)) for s, t in zip(a, b))
    total = sum(len(s) for s in a)
    assert same >= 0.9 * total, f"{same}/{total} tokens agree"
    return f"{same}/{total} tokens agree"


def check_fp32_tokens(model, device, cpu, fp32):
    return agreeing(tokens(fp32), tokens(cpu))


def check_fp32_logprobs(model, device, cpu, fp32):
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    text = "The quick brown fox jumps over the lazy dog while the cat sleeps in the warm afternoon sun. " * 4
    a, b = cpu.generate([text], params)[0], fp32.generate([text], params)[0]
    diffs = [abs(x.logprob - y.logprob) for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:])]
    assert max(diffs) < 1e-2, f"max |dlogprob| {max(diffs):.2e}"
    return f"{len(diffs)} positions, max |dlogprob| {max(diffs):.2e}"


def check_bf16_argmax(model, device, cpu, fp32):
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1)
    text = "".join(PROMPTS) * 2
    a, b = cpu.generate([text], params)[0], LLM(model, device=device).generate([text], params)[0]
    same = sum(x.top[0][0] == y.top[0][0] for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]))
    diffs = [abs(x.logprob - y.logprob) for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:])]
    assert same >= 0.9 * len(diffs), f"argmax {same}/{len(diffs)}"
    return f"argmax {same}/{len(diffs)}, mean |dlogprob| {sum(diffs) / len(diffs):.3f}, max {max(diffs):.3f}"


def check_batching(model, device, cpu, fp32):
    prompts = [p + f" {i}" for i, p in enumerate(PROMPTS * 3)]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    return agreeing(tokens(fp32, prompts, params), [tokens(fp32, [p], params)[0] for p in prompts])


def check_prefix_cache(model, device, cpu, fp32):
    prompt = "You are a helpful assistant. " * 12 + "Question: what is 2 + 2?"
    first, second = fp32.generate([prompt], GREEDY)[0], fp32.generate([prompt], GREEDY)[0]
    assert second.num_cached_tokens > 0, "no cached tokens"
    assert first.token_ids == second.token_ids
    return f"{second.num_cached_tokens}/{len(second.prompt_token_ids)} prompt tokens cached"


def check_seeded_sampling(model, device, cpu, fp32):
    params = SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, seed=7)
    assert tokens(fp32, PROMPTS[:4], params) == tokens(fp32, PROMPTS[:4], params)
    return "the same tokens twice"


def check_speculation(model, device, cpu, fp32):
    found = []
    for drafter in ("ngram", model):
        spec = LLM(model, device=device, speculative_model=drafter, num_speculative_tokens=3, max_num_seqs=8, **EXACT)
        found.append(f"{'ngram' if drafter == 'ngram' else 'draft model'}: {agreeing(tokens(spec), tokens(fp32))}")
    return "; ".join(found)


def check_structured(model, device, cpu, fp32):
    schema = {
        "type": "object",
        "additionalProperties": False,
        "required": ["name", "age"],
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
        },
    }
    params = SamplingParams(max_tokens=64, temperature=0.7, seed=1, structured=StructuredOutput("json", schema))
    text = fp32.generate(["Give a person as JSON:"], params)[0].text
    assert isinstance(json.loads(text)["age"], int), text
    return text


def check_preemption(model, device, cpu, fp32):
    small = LLM(model, device=device, num_kv_blocks=24, block_size=16, max_num_seqs=16, **EXACT)
    outputs = small.generate(
        [p + str(i) for i, p in enumerate(PROMPTS * 2)], SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    )
    assert all(len(output.token_ids) == 64 for output in outputs)
    return f"{sum(output.num_preemptions for output in outputs)} preemptions"


def check_throughput(model, device, cpu, fp32):
    bf16 = LLM(model, device=device, max_num_seqs=64)
    bf16.generate(PROMPTS[:1], SamplingParams(max_tokens=8))
    found = []
    for streams in (1, 32):
        start = time.perf_counter()
        outputs = bf16.generate(
            [PROMPTS[i % len(PROMPTS)] + str(i) for i in range(streams)],
            SamplingParams(max_tokens=128, temperature=0, ignore_eos=True),
        )
        rate = sum(len(output.token_ids) for output in outputs) / (time.perf_counter() - start)
        found.append(f"{streams} streams: {rate:.0f} tok/s")
    return "bf16, 128 tokens each: " + "; ".join(found)


def check_server(model, device, cpu, fp32):
    """The server on `device`, through the openai SDK, and its /metrics."""
    import httpx
    import openai

    port, home = free_port(), tempfile.mkdtemp(prefix="carpool-cuda-check-")
    env = {**os.environ, "CARPOOL_DB": f"{home}/carpool.db", "CARPOOL_BATCH_DIR": f"{home}/batches"}
    with open(f"{home}/serve.log", "w") as log:
        server = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "carpool.cli",
                "serve",
                "--model",
                model,
                "--device",
                device,
                "--port",
                str(port),
                "--dtype",
                "float32",
                "--matmul",
                "exact",
                "--no-warmup",
                "--log-level",
                "warning",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
    try:
        assert wait_healthy(f"http://127.0.0.1:{port}", server, 180), open(f"{home}/serve.log").read()[-3000:]
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        name = client.models.list().data[0].id
        request = {
            "model": name,
            "messages": [{"role": "user", "content": "Say hello."}],
            "max_tokens": 16,
            "temperature": 0,
        }
        whole = client.chat.completions.create(**request)
        streamed = "".join(
            chunk.choices[0].delta.content or ""
            for chunk in client.chat.completions.create(**request, stream=True)
            if chunk.choices
        )
        assert streamed == whole.choices[0].message.content, (streamed, whole.choices[0].message.content)
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics").text
        firsts = sum(
            float(line.rsplit(" ", 1)[1])
            for line in metrics.splitlines()
            if line.startswith("carpool:time_to_first_token_seconds_count")
        )
        assert firsts == 2, f"/metrics counts {firsts} first tokens for 2 requests"
        return f"{name}: {whole.usage.completion_tokens} tokens, the stream equals the answer, /metrics counts both"
    finally:
        server.terminate()
        server.wait(timeout=30)


CHECKS = {
    "fp32 greedy tokens equal CPU fp32's": check_fp32_tokens,
    "fp32 teacher-forced logprobs within 1e-2 of CPU fp32's": check_fp32_logprobs,
    "bf16 (cuda's default) teacher-forced argmax agrees with CPU fp32's": check_bf16_argmax,
    "continuous batching: 24 requests together decode as each alone": check_batching,
    "prefix cache: a repeated prompt hits the cache and decodes the same": check_prefix_cache,
    "seeded sampling repeats": check_seeded_sampling,
    "speculative decoding (ngram, draft model) is lossless": check_speculation,
    "structured output (a JSON schema)": check_structured,
    "KV pressure: 16 requests on 24 blocks all finish (preemption)": check_preemption,
    "throughput, offline": check_throughput,
    "server: the openai SDK's chat, whole and streamed": check_server,
}


def main(model: str, device: str) -> int:
    print("torch", torch.__version__, "cuda:", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none")
    cpu = LLM(model, device="cpu", max_num_seqs=32, **EXACT)
    fp32 = LLM(model, device=device, max_num_seqs=32, **EXACT)
    failed = 0
    for name, check in CHECKS.items():
        start = time.perf_counter()
        try:
            detail, verdict = check(model, device, cpu, fp32), "PASS"
        except Exception as error:  # reported, and the other checks still run
            detail, verdict = f"{type(error).__name__}: {error}\n{traceback.format_exc()[-1500:]}", "FAIL"
            failed += 1
        print(f"[{verdict}] {name} ({time.perf_counter() - start:.1f} s): {detail}", flush=True)
    print(f"FAILED {failed} of {len(CHECKS)}")
    return 1 if failed else 0


if __name__ == "__main__":
    if sys.argv[1] == "cut":
        cut_layers(sys.argv[2])
    else:
        sys.exit(main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "cuda"))

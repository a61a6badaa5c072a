"""`carpool bench offline`: the same prompts through carpool and through transformers' `generate`, in one run.

carpool gets all N prompts at once and batches them continuously; transformers gets them as one static,
left-padded batch of the same size (what a user without a serving engine would write). Both decode greedily
from the same GGUF weights with activations in the same dtype, outputs capped at --max-tokens and ended by EOS.
transformers dequantizes the file's blocks; carpool keeps them (--quantization auto) unless told "none". The figure of merit is
useful output tokens per second; carpool's prefill and decode throughput are reported separately, from the
engine's own step timings (the same PhaseMeter the server exports).
"""

import argparse
import json
import time
from pathlib import Path

import torch

from carpool.bench.datasets import first_human_turns
from carpool.economics.phase_meter import PhaseMeter
from carpool.engine.config import EngineConfig
from carpool.engine.llm_engine import LLMEngine
from carpool.engine.sampling_params import SamplingParams
from carpool.models.catalog import served_name
from carpool.models.quantization import QUANTIZATION_MODES


def add_parser(modes) -> None:
    parser = modes.add_parser("offline", help="offline throughput: carpool vs transformers generate")
    parser.add_argument(
        "--num-prompts",
        type=int,
        nargs="+",
        default=[1, 64],
        help="batch sizes to run, each a batch of that many prompts at once",
    )
    parser.add_argument("--model", default=None, help="catalog name or GGUF path (default: the embedded model)")
    parser.add_argument("--max-tokens", type=int, default=128, help="output tokens per prompt at most")
    parser.add_argument("--max-prompt-chars", type=int, default=2000, help="skip longer prompts")
    parser.add_argument("--skip-transformers", action="store_true", help="run carpool only, without the comparison")
    parser.add_argument(
        "--dtype", default="auto", choices=["auto", "float32", "bfloat16"], help="for both carpool and transformers"
    )
    parser.add_argument(
        "--quantization",
        default="auto",
        choices=list(QUANTIZATION_MODES),
        help="carpool's weight format (transformers always runs dense weights)",
    )
    parser.add_argument("--out", default="bench-results/offline.json", help="where the JSON report goes")
    parser.set_defaults(func=main)


def run_carpool(engine: LLMEngine, prompts: list[str], max_tokens: int) -> dict:
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"bench-{i}", prompt, params)
    meter, output_tokens = PhaseMeter(), 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        outputs = engine.step()
        output_tokens += len(outputs)
        meter(engine.last_step, outputs)
    elapsed = time.perf_counter() - start
    phases = meter.totals()
    return {
        "seconds": elapsed,
        "output_tokens": output_tokens,
        "output_tokens_per_s": output_tokens / elapsed,
        "prefill_tokens_per_s": phases.prefill_tokens / phases.prefill_seconds if phases.prefill_seconds else None,
        "decode_tokens_per_s": phases.decode_tokens / phases.decode_seconds if phases.decode_seconds else None,
        "phases": phases.as_dict(),
    }


def load_transformers_model(model: str | None, dtype: torch.dtype):
    import transformers

    from carpool.models.catalog import resolve

    path = Path(resolve(model))
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tokenizer.padding_side = "left"
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
    return model.eval(), tokenizer


def run_transformers(model, tokenizer, prompts: list[str], max_tokens: int) -> dict:
    batch = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    eos = tokenizer.eos_token_id

    def generate(new_tokens: int):
        with torch.inference_mode():
            return model.generate(**batch, max_new_tokens=new_tokens, do_sample=False, pad_token_id=eos)

    start = time.perf_counter()
    generate(1)
    prefill_s = time.perf_counter() - start
    start = time.perf_counter()
    out = generate(max_tokens)
    elapsed = time.perf_counter() - start
    new = out[:, batch["input_ids"].shape[1] :]
    # Useful tokens end at each row's first EOS (inclusive), as they do in carpool.
    useful = sum(int((row == eos).nonzero()[0]) + 1 if (row == eos).any() else len(row) for row in new)
    steps = new.shape[1]
    return {
        "seconds": elapsed,
        "output_tokens": useful,
        "output_tokens_per_s": useful / elapsed,
        "decode_tokens_per_s": len(prompts) * (steps - 1) / max(elapsed - prefill_s, 1e-9) if steps > 1 else None,
    }


def main(args: argparse.Namespace) -> int:
    engine = LLMEngine(
        EngineConfig(
            model=args.model,
            max_num_seqs=max(args.num_prompts),
            enable_prefix_caching=False,
            dtype=args.dtype,
            quantization=args.quantization,
        )
    )
    texts = first_human_turns(max(args.num_prompts), max_chars=args.max_prompt_chars)
    tokenizer = engine.tokenizer
    # A model without a chat template (Gemma 3 270M's GGUF) gets the turns as raw prompts.
    if tokenizer.chat_template:
        chats = [tokenizer.apply_chat_template([{"role": "user", "content": t}]) for t in texts]
    else:
        chats = texts
    hf = None if args.skip_transformers else load_transformers_model(args.model, engine.dtype)
    results = []
    for n in args.num_prompts:
        row = {"num_prompts": n, "carpool": run_carpool(engine, chats[:n], args.max_tokens)}
        if hf is not None:
            row["transformers"] = run_transformers(*hf, chats[:n], args.max_tokens)
            row["output_speedup"] = row["carpool"]["output_tokens_per_s"] / row["transformers"]["output_tokens_per_s"]
            if row["transformers"]["decode_tokens_per_s"] and row["carpool"]["decode_tokens_per_s"]:
                row["decode_speedup"] = (
                    row["carpool"]["decode_tokens_per_s"] / row["transformers"]["decode_tokens_per_s"]
                )
        results.append(row)
        print(_format_row(row), flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    # "phases": the largest run's engine time split, which `carpool cost model --bench` prices.
    summary = {
        "model": served_name(args.model),
        "max_tokens": args.max_tokens,
        "dtype": str(engine.dtype),
        "quantization": args.quantization,
        "threads": torch.get_num_threads(),
        "phases": results[-1]["carpool"]["phases"],
        "results": results,
    }
    out.write_text(json.dumps(summary, indent=2))
    print(f"wrote {out}")
    return 0


def _format_row(row: dict) -> str:
    c = row["carpool"]
    fmt = lambda v: f"{v:.1f}" if v else "-"
    line = (
        f"N={row['num_prompts']:>3}  carpool {c['output_tokens_per_s']:.1f} out tok/s "
        f"(prefill {fmt(c['prefill_tokens_per_s'])} tok/s, decode {fmt(c['decode_tokens_per_s'])} tok/s)"
    )
    if "transformers" in row:
        t = row["transformers"]
        line += (
            f" | transformers {t['output_tokens_per_s']:.1f} out tok/s (decode {fmt(t['decode_tokens_per_s'])} tok/s)"
            f" | output x{row['output_speedup']:.2f}"
        )
        if "decode_speedup" in row:
            line += f", decode x{row['decode_speedup']:.2f}"
    return line

"""The `carpool` command. Each area registers its own subcommands; this file only wires them together."""

import argparse
import sys

from carpool.bench.cli import add_bench_parser
from carpool.economics.cli import add_cost_parser, add_keys_parser
from carpool.engine.config import DTYPES, EngineConfig
from carpool.kernels.probe import add_info_parser
from carpool.models.cli import add_models_parser
from carpool.models.quantization import QUANTIZATION_MODES
from carpool.server.batch.cli import add_batch_parser
from carpool.server.cli import add_serve_parser


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    defaults = EngineConfig()
    parser.add_argument("--model", default=None, help="GGUF file or safetensors directory (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--dtype", default=defaults.dtype, choices=["auto", *DTYPES],
                        help="weights, activations and KV cache (default: auto, bfloat16 where the hardware has "
                             "native bf16 units; float32 reproduces the reference implementation exactly)")
    parser.add_argument("--quantization", default=defaults.quantization, choices=list(QUANTIZATION_MODES),
                        help="weight format: auto keeps a GGUF file's Q4_0/Q4_1/Q8_0 blocks (CPU kernels), none "
                             "dequantizes to --dtype, q8_0/q4_1/q4_0 quantize at load (default: auto)")
    parser.add_argument("--block-size", type=int, default=defaults.block_size)
    parser.add_argument("--num-kv-blocks", type=int, default=None)
    parser.add_argument("--kv-cache-gb", type=float, default=defaults.kv_cache_gb)
    parser.add_argument("--max-num-seqs", type=int, default=defaults.max_num_seqs)
    parser.add_argument("--max-num-batched-tokens", type=int, default=defaults.max_num_batched_tokens)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false")
    parser.add_argument("--priority-aging-seconds", type=float, default=defaults.priority_aging_seconds)
    parser.add_argument("--max-priority-boost", type=int, default=defaults.max_priority_boost)
    parser.add_argument("--num-threads", type=int, default=None)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    names = EngineConfig.__dataclass_fields__
    return EngineConfig(**{k: v for k, v in vars(args).items() if k in names})


def _generate(args: argparse.Namespace) -> int:
    from carpool.engine.llm_engine import LLMEngine
    from carpool.engine.sampling_params import SamplingParams

    engine = LLMEngine(engine_config(args))
    prompt = args.prompt
    if not args.raw:
        prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    engine.add_request("cli", prompt, params)
    while engine.has_unfinished_requests():
        for output in engine.step():
            sys.stdout.write(output.delta_text)
            sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def _add_generate(subparsers) -> None:
    parser = subparsers.add_parser("generate", help="stream a completion for one prompt to the terminal")
    parser.add_argument("prompt")
    parser.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=None)
    add_engine_args(parser)
    parser.set_defaults(func=_generate)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="carpool", description="LLM serving where every token's cost is visible")
    subparsers = parser.add_subparsers(dest="command", required=True)
    _add_generate(subparsers)
    add_serve_parser(subparsers, add_engine_args, engine_config)
    add_batch_parser(subparsers)
    add_bench_parser(subparsers)
    add_keys_parser(subparsers)
    add_cost_parser(subparsers)
    add_info_parser(subparsers)
    add_models_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args) or 0
    except ValueError as error:
        print(f"carpool: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

"""The `carpool` command. Each area registers its own subcommands; this file only wires them together."""

import argparse
import sys


def _generate(args: argparse.Namespace) -> int:
    from carpool.engine.args import engine_config
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
    from carpool.engine.args import add_engine_args

    parser = subparsers.add_parser("generate", help="stream a completion for one prompt to the terminal")
    parser.add_argument("prompt", help="the user's message (sent through the chat template unless --raw)")
    parser.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    parser.add_argument("--max-tokens", type=int, default=256, help="output tokens at most (default: 256)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 picks the likeliest token (default: 0)")
    parser.add_argument("--seed", type=int, default=None, help="makes sampling at a temperature above 0 repeatable")
    add_engine_args(parser)
    parser.set_defaults(func=_generate)


def build_parser() -> argparse.ArgumentParser:
    """Every area's subcommands, imported here rather than at the top: importing them loads the kernels, whose
    choice of path can fail (CARPOOL_KERNEL_ISA naming a path this CPU cannot run), and `main` turns that into
    one line instead of a traceback."""
    from carpool.bench import whatif
    from carpool.bench.cli import add_bench_parser
    from carpool.economics.cli import add_capacity_parser, add_cost_parser, add_keys_parser
    from carpool.kernels.probe import add_info_parser
    from carpool.models.cli import add_models_parser
    from carpool.server.batch.cli import add_batch_parser
    from carpool.server.cascade.cli import add_cascade_parser
    from carpool.server.cli import add_serve_parser
    from carpool.server.compression.cli import add_compress_parser

    parser = argparse.ArgumentParser(prog="carpool", description="LLM serving where every token's cost is visible")
    subparsers = parser.add_subparsers(dest="command", required=True)
    _add_generate(subparsers)
    add_serve_parser(subparsers)
    add_batch_parser(subparsers)
    add_bench_parser(subparsers)
    add_keys_parser(subparsers)
    whatif.add_parser(add_cost_parser(subparsers))
    add_capacity_parser(subparsers)
    add_info_parser(subparsers)
    add_models_parser(subparsers)
    add_cascade_parser(subparsers)
    add_compress_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        parser = build_parser()
    except ValueError as error:  # the kernels' path cannot load here (the message names the variable and why)
        print(f"carpool: {error}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    try:
        return args.func(args) or 0
    except ValueError as error:
        print(f"carpool: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

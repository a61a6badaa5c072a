"""`carpool compress`: a prompt (a file, or stdin) through a running server's POST /v1/compress; the compressed
text on stdout, the token counts on stderr."""

import argparse
import json
import os
import sys


def add_compress_parser(subparsers) -> None:
    parser = subparsers.add_parser("compress", help="compress a prompt with a running server (POST /v1/compress)")
    parser.add_argument("file", nargs="?", default="-", help="the prompt's text (default: stdin)")
    budget = parser.add_mutually_exclusive_group(required=True)
    budget.add_argument("--rate", type=float, help="the share of the prompt's tokens to keep, in (0, 1]")
    budget.add_argument("--target-tokens", type=int, help="how many of the prompt's tokens to keep")
    parser.add_argument(
        "--protect",
        action="append",
        default=[],
        metavar="TEXT",
        help="a span kept verbatim (repeatable); the last paragraph is always kept",
    )
    parser.add_argument("--model", default=None, help="the served model whose tokens count (default: the scorer's)")
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the server (default: http://127.0.0.1:8000)")
    parser.add_argument(
        "--api-key", default=os.environ.get("CARPOOL_API_KEY"), help="the server's API key (default: $CARPOOL_API_KEY)"
    )
    parser.set_defaults(func=compress)


def compress(args: argparse.Namespace) -> int:
    import httpx

    text = sys.stdin.read() if args.file == "-" else open(args.file, encoding="utf-8").read()
    body = {
        "prompt": text,
        "rate": args.rate,
        "target_tokens": args.target_tokens,
        "protected": args.protect or None,
        "model": args.model,
    }
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        response = httpx.post(
            f"{args.url.rstrip('/')}/v1/compress",
            headers=headers,
            timeout=None,
            json={key: value for key, value in body.items() if value is not None},
        )
    except httpx.HTTPError as error:
        raise ValueError(f"--url: cannot reach {args.url}: {error}") from error
    answer = response.json()
    if response.status_code != 200:
        raise ValueError(f"the server answered {response.status_code}: {json.dumps(answer.get('error', answer))}")
    sys.stdout.write(answer["prompt"])
    print(
        f"{answer['original_tokens']} -> {answer['compressed_tokens']} tokens (kept {answer['kept_ratio']:.1%}, "
        f"{answer['model']}; scored by {answer['scorer_model']})",
        file=sys.stderr,
    )
    return 0

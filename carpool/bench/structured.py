"""`carpool bench structured`: are constrained outputs valid, and what does the constraint cost, in one run.

Validity: --requests requests per format through a carpool server on this process, with the official `openai`
SDK as agents call it (sampled at temperature 0.7 with a seed each, so the requests differ): `parse` with a
Pydantic model (json_schema strict), json_object, a regex, a choice list and, on a model whose chat template
has tools, tool_choice "required" and a named function. An output counts as valid when it parses and validates
(a finish_reason "length" cut is counted invalid: that is what a client sees).

Overhead: the same prompts through the engine with every request constrained by a JSON schema vs none, at each
of --streams concurrent streams, side by side: decode tokens per second (over the steps that only decode) and
their ratio. Outputs run to about --max-tokens either way (an array with no maxItems; ignore_eos unconstrained).
"""

import argparse
import json
import re
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path

from pydantic import BaseModel, Field, ValidationError

from carpool.bench.structured_jobs import batch_extraction, compare_servers
from carpool.engine.args import add_engine_args, engine_config
from carpool.engine.llm_engine import LLMEngine
from carpool.engine.sampling_params import SamplingParams
from carpool.engine.structured import StructuredOutput
from carpool.models.loader import resolve_model_dir
from carpool.models.tokenizer import Tokenizer

REGEX = r"[A-Z][a-z]{1,8}, [0-9]{2} years"
COLOURS = ["red", "green", "blue", "yellow"]
VALIDITY_TIMEOUT_S = 3600
LONG_LIST = {
    "type": "object",
    "additionalProperties": False,
    "required": ["people"],
    "properties": {
        "people": {
            "type": "array",
            "items": {
                "type": "object",
                "additionalProperties": False,
                "required": ["name", "age"],
                "properties": {"name": {"type": "string", "maxLength": 16}, "age": {"type": "integer"}},
            },
        }
    },
}


class Person(BaseModel):
    name: str = Field(max_length=20)
    age: int
    city: str = Field(max_length=20)


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "additionalProperties": False,
            "required": ["city", "unit"],
            "properties": {
                "city": {"type": "string", "maxLength": 24},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
        },
    },
}
SEARCH = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the web",
        "parameters": {
            "type": "object",
            "additionalProperties": False,
            "required": ["query"],
            "properties": {"query": {"type": "string", "maxLength": 40}},
        },
    },
}
TOOL_ARGUMENTS = {"get_weather": ({"city", "unit"}, {"unit": ("celsius", "fahrenheit")}), "search": ({"query"}, {})}


def add_parser(modes) -> None:
    parser = modes.add_parser("structured", help="structured outputs: validity per format, constrained vs free tok/s")
    parser.add_argument("--requests", type=int, default=20, help="requests per format in the validity run")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8, 32], help="concurrent streams to compare")
    parser.add_argument("--max-tokens", type=int, default=64, help="output tokens per request in the overhead run")
    parser.add_argument("--skip-validity", action="store_true", help="run the overhead comparison only")
    parser.add_argument("--skip-overhead", action="store_true", help="skip the constrained vs free tok/s comparison")
    parser.add_argument("--validity-max-tokens", type=int, default=96, help="max_tokens of each validity request")
    parser.add_argument(
        "--validity-concurrency",
        type=int,
        default=8,
        help="validity requests in flight at once (the engine batches them)",
    )
    parser.add_argument(
        "--formats", nargs="+", choices=list(FORMATS), default=None, help="validity formats to run, in this order"
    )
    parser.add_argument(
        "--batch-lines",
        type=int,
        default=0,
        help="also run an extraction job of this many lines through the Batch API (0: none)",
    )
    parser.add_argument(
        "--url",
        action="append",
        default=[],
        help="a server (no /v1; e.g. llama-server) to send the extraction schema to, repeatable",
    )
    parser.add_argument("--server-requests", type=int, default=64, help="requests per --url server")
    parser.add_argument("--server-concurrency", type=int, default=8, help="requests in flight per --url server")
    parser.add_argument("--out", default="bench-results/structured.json", help="where the JSON report goes")
    add_engine_args(parser)
    parser.set_defaults(func=lambda args: main(args, engine_config(args)))


def main(args: argparse.Namespace, config) -> int:
    for name in (
        "requests",
        "max_tokens",
        "validity_max_tokens",
        "validity_concurrency",
        "server_requests",
        "server_concurrency",
    ):
        if getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive")
    config.max_num_seqs = max(config.max_num_seqs, *args.streams)
    report = {"engine": asdict(config)}
    if not args.skip_validity:
        report["validity"] = validity(args, config)
    if args.batch_lines > 0:
        job = report["batch_extraction"] = batch_extraction(config, args.batch_lines, args.validity_max_tokens)
        print(
            f"batch extraction: {job['valid']}/{job['lines']} valid ({job['status']}), {job['seconds']:.0f} s, "
            f"{job['output_tokens']} output tokens, cost ${job['cost']:.6f}",
            flush=True,
        )
    if args.url:
        report["servers"] = compare_servers(
            args.url, args.server_requests, args.server_concurrency, args.validity_max_tokens
        )
        for row in report["servers"]:
            print(
                f"{row['url']} ({row['model']}): {row['valid']}/{row['requests']} valid, {row['tok_s']:.1f} "
                f"output tok/s at {args.server_concurrency} in flight",
                flush=True,
            )
    if not args.skip_overhead:
        report["overhead"] = overhead(LLMEngine(config), args.streams, args.max_tokens)
        print(f"{'streams':>7} {'free tok/s':>11} {'json tok/s':>11} {'ratio':>6}")
        for row in report["overhead"]:
            print(
                f"{row['streams']:>7} {row['free_tok_s']:>11.1f} {row['constrained_tok_s']:>11.1f} {row['ratio']:>6.2f}"
            )
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {path}")
    return 0


# Validity ------------------------------------------------------------------------------------------------


def validity(args: argparse.Namespace, config) -> dict:
    import openai

    from carpool.bench.local_server import LocalServer

    with (
        tempfile.TemporaryDirectory(prefix="carpool-bench-structured-") as workdir,
        LocalServer(config, Path(workdir)) as server,
    ):
        # A loaded machine can take minutes per request: the SDK's 10-minute default would end the run.
        client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=VALIDITY_TIMEOUT_S)
        formats = {name: FORMATS[name] for name in args.formats or FORMATS}
        if not supports_tools(config):
            formats = {name: check for name, check in formats.items() if not name.startswith("tools")}
        report = {}
        for name, check in formats.items():

            def outcome(i: int, check=check) -> str:
                try:
                    return "valid" if check(client, server.model, i, args.validity_max_tokens) else "invalid"
                except (Cut, openai.LengthFinishReasonError):
                    return "length"
                except (ValueError, ValidationError) as error:
                    return type(error).__name__

            with ThreadPoolExecutor(args.validity_concurrency) as pool:
                outcomes = Counter(pool.map(outcome, range(args.requests)))
            valid = outcomes.pop("valid", 0)
            report[name] = {"requests": args.requests, "valid": valid, "invalid": dict(outcomes)}
            print(
                f"{name:14} {valid}/{args.requests} valid ({100 * valid / args.requests:.1f}%)"
                f"{'; invalid: ' + json.dumps(dict(outcomes)) if outcomes else ''}",
                flush=True,
            )
        return report


class Cut(ValueError):
    """The output ended at max_tokens (finish_reason "length"): invalid, as a client sees it."""


def supports_tools(config) -> bool:
    return Tokenizer.from_dir(resolve_model_dir(config.model)).supports_tools


def _ask(i: int, what: str) -> list[dict]:
    return [{"role": "user", "content": f"{what} (example {i})"}]


def _create(client, model: str, i: int, max_tokens: int, what: str, **kwargs):
    choice = client.chat.completions.create(
        model=model, messages=_ask(i, what), max_tokens=max_tokens, temperature=0.7, seed=i, **kwargs
    ).choices[0]
    if choice.finish_reason == "length":
        raise Cut(choice.message.content)
    return choice


def check_parse(client, model: str, i: int, max_tokens: int) -> bool:
    choice = client.chat.completions.parse(
        model=model,
        messages=_ask(i, "Invent a person and their city."),
        response_format=Person,
        max_tokens=max_tokens,
        temperature=0.7,
        seed=i,
    ).choices[0]
    return isinstance(choice.message.parsed, Person)


def check_json_object(client, model: str, i: int, max_tokens: int) -> bool:
    return isinstance(
        json.loads(
            _create(
                client,
                model,
                i,
                max_tokens,
                "Describe a book as a JSON object.",
                response_format={"type": "json_object"},
            ).message.content
        ),
        dict,
    )


def check_regex(client, model: str, i: int, max_tokens: int) -> bool:
    text = _create(
        client, model, i, max_tokens, "Name a person and their age.", extra_body={"guided_regex": REGEX}
    ).message.content
    return re.fullmatch(REGEX, text) is not None


def check_choice(client, model: str, i: int, max_tokens: int) -> bool:
    text = _create(
        client, model, i, max_tokens, "Pick a colour.", extra_body={"guided_choice": COLOURS}
    ).message.content
    return text in COLOURS


def check_tools(client, model: str, i: int, max_tokens: int, tool_choice="required") -> bool:
    choice = _create(
        client,
        model,
        i,
        max_tokens,
        "What is the weather in Rome, and what is new in Rome today?",
        tools=[WEATHER, SEARCH],
        tool_choice=tool_choice,
    )
    calls = choice.message.tool_calls or []
    return choice.finish_reason == "tool_calls" and bool(calls) and all(_valid_call(call) for call in calls)


def check_named_tool(client, model: str, i: int, max_tokens: int) -> bool:
    return check_tools(client, model, i, max_tokens, {"type": "function", "function": {"name": "search"}})


def _valid_call(call) -> bool:
    keys, enums = TOOL_ARGUMENTS[call.function.name]
    arguments = json.loads(call.function.arguments)
    return set(arguments) == keys and all(arguments[k] in allowed for k, allowed in enums.items())


FORMATS = {
    "parse_pydantic": check_parse,
    "json_object": check_json_object,
    "regex": check_regex,
    "choice": check_choice,
    "tools_required": check_tools,
    "tools_named": check_named_tool,
}


# Overhead ------------------------------------------------------------------------------------------------


def overhead(engine: LLMEngine, streams: list[int], max_tokens: int) -> list[dict]:
    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": "List people and their ages as JSON."}])
    free = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    constrained = SamplingParams(
        max_tokens=max_tokens, temperature=0, structured=StructuredOutput("json", LONG_LIST, "bench")
    )
    run(engine, [prompt], constrained)  # compiles the schema and builds the grammar's token table once
    rows = []
    for count in streams:
        free_rate, constrained_rate = run(engine, [prompt] * count, free), run(engine, [prompt] * count, constrained)
        rows.append(
            {
                "streams": count,
                "free_tok_s": free_rate,
                "constrained_tok_s": constrained_rate,
                "ratio": constrained_rate / free_rate,
            }
        )
    return rows


def run(engine: LLMEngine, prompts: list[str], params: SamplingParams) -> float:
    """Decode tokens per second with all prompts in flight at once, over the steps that only decode (the mask is
    a decode-time cost; prefill steps would dilute it, and constrained outputs may end sooner)."""
    for i, prompt in enumerate(prompts):
        engine.add_request(f"structured-bench-{time.monotonic_ns()}-{i}", prompt, params)
    tokens, seconds = 0, 0.0
    while engine.has_unfinished_requests():
        engine.step()
        step = engine.last_step
        if step is not None and step.num_prefill_tokens == 0:
            tokens, seconds = tokens + step.num_decode_tokens, seconds + step.duration
    return tokens / seconds

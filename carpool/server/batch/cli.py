"""`carpool batch submit|status|results|cancel`: a client of any OpenAI-compatible Batch API, carpool's included."""

import argparse
import json
import os
import sys
import time
from pathlib import Path

TERMINAL = {"completed", "failed", "expired", "cancelled"}
DEFAULT_URL = "http://127.0.0.1:8000/v1"


def add_batch_parser(subparsers) -> None:
    parser = subparsers.add_parser("batch", help="submit and follow batches: half price, run when there is room")
    commands = parser.add_subparsers(dest="batch_command", required=True)

    submit = commands.add_parser("submit", help="upload a JSONL file of requests and start a batch")
    submit.add_argument("file", type=Path, help="the JSONL file: one request per line, as OpenAI's Batch API takes")
    submit.add_argument("--endpoint", default=None, help="default: the `url` of the file's first request")
    submit.add_argument(
        "--metadata", action="append", default=[], metavar="KEY=VALUE", help="a label kept with the batch (repeatable)"
    )
    submit.add_argument("--wait", action="store_true", help="follow the batch with a progress bar until it ends")
    submit.set_defaults(func=_reporting_api_errors(_submit))

    status = commands.add_parser("status", help="print a batch as JSON")
    status.add_argument("batch_id", help="the id `submit` printed")
    status.set_defaults(func=_reporting_api_errors(_status))

    results = commands.add_parser("results", help="print a batch's output lines, then its error lines")
    results.add_argument("batch_id", help="the id `submit` printed")
    results.add_argument("-o", "--output", type=Path, default=None, help="write to this file instead of stdout")
    results.set_defaults(func=_reporting_api_errors(_results))

    cancel = commands.add_parser("cancel", help="stop a batch; finished results are kept")
    cancel.add_argument("batch_id", help="the id `submit` printed")
    cancel.set_defaults(func=_reporting_api_errors(_cancel))

    for command in (submit, status, results, cancel):
        command.add_argument("--url", default=os.environ.get("CARPOOL_URL", DEFAULT_URL), help="the API's base URL")
        command.add_argument("--api-key", default=None, help="default: $CARPOOL_API_KEY, else $OPENAI_API_KEY")
        command.add_argument(
            "--poll-interval", type=float, default=1.0, help="seconds between status checks while following a batch"
        )


def _reporting_api_errors(command):
    """The server's own words on failure, not a traceback."""

    def run(args: argparse.Namespace) -> int:
        import openai

        try:
            return command(args)
        except openai.APIStatusError as error:
            body = error.body if isinstance(error.body, dict) else {}
            message = body.get("message") or str(error)
            print(f"carpool batch: {error.status_code}: {message}", file=sys.stderr)
        except openai.APIConnectionError:
            print(f"carpool batch: cannot reach {args.url}", file=sys.stderr)
        return 1

    return run


def _client(args: argparse.Namespace):
    from openai import OpenAI

    api_key = args.api_key or os.environ.get("CARPOOL_API_KEY") or os.environ.get("OPENAI_API_KEY")
    # The SDK insists on a key; an open carpool server ignores whatever is sent.
    return OpenAI(base_url=args.url, api_key=api_key or "unused")


def _first_url(path: Path) -> str:
    with open(path, "rb") as lines:
        for raw in lines:
            if raw.strip():
                try:
                    url = json.loads(raw).get("url")
                except (ValueError, AttributeError):
                    break
                if isinstance(url, str):
                    return url
                break
    return "/v1/chat/completions"


def _metadata(pairs: list[str]) -> dict[str, str] | None:
    if not pairs:
        return None
    if any("=" not in pair for pair in pairs):
        raise ValueError("--metadata takes KEY=VALUE")
    return dict(pair.split("=", 1) for pair in pairs)


def _submit(args: argparse.Namespace) -> int:
    if not args.file.is_file():
        raise ValueError(f"{args.file}: no such file")
    client = _client(args)
    with open(args.file, "rb") as data:
        uploaded = client.files.create(file=(args.file.name, data), purpose="batch")
    endpoint = args.endpoint or _first_url(args.file)
    create = {"input_file_id": uploaded.id, "endpoint": endpoint, "completion_window": "24h"}
    metadata = _metadata(args.metadata)
    if metadata:
        create["metadata"] = metadata
    batch = client.batches.create(**create)
    print(batch.id)
    if not args.wait:
        return 0
    batch = _follow(client, batch, args.poll_interval)
    print(_summary(batch), file=sys.stderr)
    return 0 if batch.status == "completed" else 1


def _follow(client, batch, poll_interval: float):
    """Poll until the batch ends, drawing requests answered out of the total."""
    from tqdm import tqdm

    with tqdm(total=None, unit="req", desc=batch.status, file=sys.stderr) as bar:
        while batch.status not in TERMINAL:
            time.sleep(poll_interval)
            batch = client.batches.retrieve(batch.id)
            counts = batch.request_counts
            if counts is not None and counts.total:
                bar.total = counts.total
                bar.n = counts.completed + counts.failed
            bar.set_description(batch.status)
            bar.refresh()
    return batch


def _summary(batch) -> str:
    counts = batch.request_counts
    text = f"{batch.id} {batch.status}"
    if counts is not None:
        text += f": {counts.completed} completed, {counts.failed} failed of {counts.total}"
    if batch.errors and batch.errors.data:
        text += "".join(f"\n  line {e.line}: {e.code}: {e.message}" for e in batch.errors.data)
    return text


def _status(args: argparse.Namespace) -> int:
    print(_client(args).batches.retrieve(args.batch_id).model_dump_json(indent=2))
    return 0


def _results(args: argparse.Namespace) -> int:
    client = _client(args)
    batch = client.batches.retrieve(args.batch_id)
    if batch.status not in TERMINAL:
        raise ValueError(f"{batch.id} is {batch.status}; results come when it ends")
    parts = [client.files.content(file_id).text for file_id in (batch.output_file_id, batch.error_file_id) if file_id]
    text = "".join(parts)
    if args.output is None:
        sys.stdout.write(text)
    else:
        args.output.write_text(text)
    print(_summary(batch), file=sys.stderr)
    return 0


def _cancel(args: argparse.Namespace) -> int:
    batch = _client(args).batches.cancel(args.batch_id)
    print(f"{batch.id} {batch.status}")
    return 0

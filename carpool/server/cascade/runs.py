"""A labeled set through each model of a cascade, once: every answer with its token logprobs, tokens and cost,
saved as JSONL so calibration and evaluation can be refitted and re-read without running the models again."""

import json
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from carpool.economics.contract import UsageRecord
from carpool.engine.tiers import DEFAULT_TIER


@dataclass
class Example:
    prompt: str  # the user's message
    answer: str | None = None  # None: unlabeled (calibrate against the strongest model's answers instead)
    max_tokens: int | None = None  # this example's own output limit (a mixed workload's short turns), else the run's


@dataclass
class Attempt:
    """One model's answer to one example."""

    text: str
    logprobs: list[float]  # of each chosen token
    prompt_tokens: int
    output_tokens: int
    finish_reason: str
    cost: float  # dollars, by the price sheet, as the ledger would bill it (no prefix-cache reads assumed)

    @property
    def hit_length(self) -> bool:
        return self.finish_reason == "length"


def load_examples(path: str | Path, offset: int = 0, limit: int | None = None, suffix: str = "") -> list[Example]:
    """JSONL lines with `prompt` (or `question`, as GSM8K's) and optionally `answer` and `max_tokens`; lines
    offset..offset+limit. `suffix` is appended to every prompt (an instruction such as how to state the final
    answer)."""
    examples = []
    with Path(path).open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            record = json.loads(line)
            prompt = record.get("prompt", record.get("question"))
            if not isinstance(prompt, str):
                raise ValueError(f"data: line {number} of {path} has no string `prompt` (or `question`)")
            limit_tokens = record.get("max_tokens")
            if limit_tokens is not None and (not isinstance(limit_tokens, int) or limit_tokens < 1):
                raise ValueError(f"data: line {number} of {path}: `max_tokens` must be a positive integer")
            examples.append(Example(prompt + suffix, record.get("answer"), limit_tokens))
    examples = examples[offset : None if limit is None else offset + limit]
    if not examples:
        raise ValueError(f"data: no examples in {path} at offset {offset}")
    return examples


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def final_number(text: str) -> str | None:
    """The last number in a text (GSM8K's `#### 72` answers and a model's "The answer is 72."), as a canonical
    string: commas dropped, `72.00` read as `72`."""
    text = text.split("####")[-1]
    found = _NUMBER.findall(text)
    if not found:
        return None
    value = float(found[-1].replace(",", ""))
    return str(int(value)) if value.is_integer() else str(value)


def same_answer(output: str, reference: str) -> bool:
    """Numeric answers compare by their final number; anything else (a label) by its case-folded text, without the
    whitespace, quotes, markdown stars and end punctuation a model wraps one word in ("**Money**.")."""
    expected = final_number(reference)
    if expected is not None:
        return final_number(output) == expected
    return _bare(output) == _bare(reference)


def _bare(text: str) -> str:
    return text.strip().strip("\"'`*.!,;:").strip().casefold()


def run_model(
    model: str,
    examples: list[Example],
    max_tokens: int,
    cost: Callable[[UsageRecord], float],
    num_threads: int | None = None,
    llm=None,
) -> list[Attempt]:
    """Greedy answers of `model` (a catalog name or path; `llm`: that model already loaded, a carpool.LLM) to
    every example's chat prompt, one batch; `max_tokens` where an example sets none of its own."""
    from carpool.engine.sampling_params import SamplingParams
    from carpool.llm import LLM

    llm = llm or LLM(model, num_threads=num_threads)
    prompts = [llm.chat_prompt([{"role": "user", "content": example.prompt}]) for example in examples]
    params = [
        SamplingParams(max_tokens=example.max_tokens or max_tokens, temperature=0.0, logprobs=0) for example in examples
    ]
    outputs = llm.generate(prompts, params)
    attempts = []
    for output in outputs:
        usage = UsageRecord(
            "calibration",
            model,
            DEFAULT_TIER,
            len(output.prompt_token_ids),
            0,
            0,
            len(output.token_ids),
            0.0,
            0.0,
            0.0,
            output.finish_reason,
        )
        attempts.append(
            Attempt(
                output.text,
                [lp.logprob for lp in output.logprobs],
                usage.prompt_tokens,
                usage.output_tokens,
                output.finish_reason,
                cost(usage),
            )
        )
    return attempts


def cached_runs(
    runs_dir: str | Path | None,
    model: str,
    examples: list[Example],
    max_tokens: int,
    cost: Callable[[UsageRecord], float],
    num_threads: int | None = None,
) -> list[Attempt]:
    """run_model, with the answers `<runs_dir>/<model>.jsonl` holds to the same prompts at the same output limit
    read back, and the model run on the rest only: a set cut into other splits, or with some prompts edited,
    reruns only what it has not answered (the 1.5B took 413 s over 66 turns of the help-line mix, 18 of them GSM8K)."""
    path = None if runs_dir is None else Path(runs_dir) / f"{Path(model).name}.jsonl"
    answered = _read_runs(path)
    keys = [(example.prompt, example.max_tokens or max_tokens) for example in examples]
    missing = {key: example for key, example in zip(keys, examples) if key not in answered}
    if missing:
        answered.update(zip(missing, run_model(model, list(missing.values()), max_tokens, cost, num_threads)))
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            header = {
                "max_tokens": max_tokens,
                "prompts": [prompt for prompt, _ in answered],
                "example_max_tokens": [limit for _, limit in answered],
            }
            lines = [json.dumps(header)] + [json.dumps(asdict(attempt)) for attempt in answered.values()]
            path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return [answered[key] for key in keys]


def _read_runs(path: Path | None) -> dict[tuple[str, int], Attempt]:
    """{(prompt, max_tokens): Attempt} of a runs file: a header naming each row's prompt (and its own limit where
    `example_max_tokens` has one), then one Attempt a line."""
    if path is None or not path.exists():
        return {}
    header, *rows = path.read_text(encoding="utf-8").splitlines()
    header = json.loads(header)
    limits = header.get("example_max_tokens") or [None] * len(rows)
    return {
        (prompt, limit or header["max_tokens"]): Attempt(**json.loads(row))
        for prompt, limit, row in zip(header["prompts"], limits, rows)
    }


@dataclass
class PromptPass:
    """A model's one prefill of an example's chat prompt (a prompt-pass router's features)."""

    surprisals: list[float]  # nats, of each prompt token after the first
    prompt_tokens: int
    cost: float  # dollars: the prompt and the one output token a request must ask for, as the ledger bills it


# The engine serves a prompt's cached KV in whole blocks and never its last token: the routed-to request after a
# prompt pass reads at least this much of it back.
_BLOCK = 16


def reused_cost(model: str, attempt: Attempt, cost: Callable[[UsageRecord], float]) -> float:
    """The attempt's cost when a prompt pass on the same model ran first: the whole blocks of its prompt before
    the last token are prefix-cache reads."""
    cached = (attempt.prompt_tokens - 1) // _BLOCK * _BLOCK
    usage = UsageRecord(
        "calibration", model, DEFAULT_TIER, attempt.prompt_tokens, cached, 0, attempt.output_tokens, 0, 0, 0, "stop"
    )
    return cost(usage)


def run_prompt_passes(
    model: str,
    examples: list[Example],
    cost: Callable[[UsageRecord], float],
    num_threads: int | None = None,
    llm=None,
) -> list[PromptPass]:
    """`model`'s surprisal of every example's chat prompt (`llm`: that model already loaded, a carpool.LLM), one
    batch of prefills (one output token each)."""
    from carpool.engine.sampling_params import SamplingParams
    from carpool.llm import LLM

    llm = llm or LLM(model, num_threads=num_threads)
    prompts = [llm.chat_prompt([{"role": "user", "content": example.prompt}]) for example in examples]
    outputs = llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0))
    passes = []
    for output in outputs:
        tokens = len(output.prompt_token_ids)
        usage = UsageRecord("calibration", model, DEFAULT_TIER, tokens, 0, 0, len(output.token_ids), 0, 0, 0, "stop")
        surprisals = [-entry.logprob for entry in output.prompt_logprobs[1:]]
        passes.append(PromptPass(surprisals, tokens, cost(usage)))
    return passes


def cached_prompt_passes(
    runs_dir: str | Path | None,
    model: str,
    examples: list[Example],
    cost: Callable[[UsageRecord], float],
    num_threads: int | None = None,
) -> list[PromptPass]:
    """run_prompt_passes, cached in `<runs_dir>/<model>.prompt-pass.jsonl` per prompt as cached_runs caches
    answers."""
    path = None if runs_dir is None else Path(runs_dir) / f"{Path(model).name}.prompt-pass.jsonl"
    passed = {}
    if path is not None and path.exists():
        header, *rows = path.read_text(encoding="utf-8").splitlines()
        passed = {p: PromptPass(**json.loads(row)) for p, row in zip(json.loads(header)["prompts"], rows)}
    missing = {example.prompt: example for example in examples if example.prompt not in passed}
    if missing:
        passed.update(zip(missing, run_prompt_passes(model, list(missing.values()), cost, num_threads)))
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            lines = [json.dumps({"prompts": list(passed)})] + [json.dumps(asdict(p)) for p in passed.values()]
            path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return [passed[example.prompt] for example in examples]

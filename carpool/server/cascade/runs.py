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
    """JSONL lines with `prompt` (or `question`, as GSM8K's) and optionally `answer`; lines offset..offset+limit.
    `suffix` is appended to every prompt (an instruction such as how to state the final answer)."""
    examples = []
    with Path(path).open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            record = json.loads(line)
            prompt = record.get("prompt", record.get("question"))
            if not isinstance(prompt, str):
                raise ValueError(f"data: line {number} of {path} has no string `prompt` (or `question`)")
            examples.append(Example(prompt + suffix, record.get("answer")))
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
    """Numeric answers compare by their final number; anything else by its stripped, case-folded text."""
    expected = final_number(reference)
    if expected is not None:
        return final_number(output) == expected
    return output.strip().casefold() == reference.strip().casefold()


def run_model(
    model: str,
    examples: list[Example],
    max_tokens: int,
    cost: Callable[[UsageRecord], float],
    num_threads: int | None = None,
    llm=None,
) -> list[Attempt]:
    """Greedy answers of `model` (a catalog name or path; `llm`: that model already loaded, a carpool.LLM) to
    every example's chat prompt, one batch."""
    from carpool.engine.sampling_params import SamplingParams
    from carpool.llm import LLM

    llm = llm or LLM(model, num_threads=num_threads)
    prompts = [llm.chat_prompt([{"role": "user", "content": example.prompt}]) for example in examples]
    outputs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=0))
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
    """run_model, read from `<runs_dir>/<model>.jsonl` when that file holds these very prompts and max_tokens."""
    path = None if runs_dir is None else Path(runs_dir) / f"{Path(model).name}.jsonl"
    key = {"max_tokens": max_tokens, "prompts": [example.prompt for example in examples]}
    if path is not None and path.exists():
        header, *rows = path.read_text(encoding="utf-8").splitlines()
        if json.loads(header) == key:
            return [Attempt(**json.loads(row)) for row in rows]
    attempts = run_model(model, examples, max_tokens, cost, num_threads)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        lines = [json.dumps(key)] + [json.dumps(asdict(attempt)) for attempt in attempts]
        path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return attempts

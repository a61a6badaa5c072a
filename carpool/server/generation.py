"""One API request's engine work: a task per choice, started at admission, with outputs merged as they come.

Bookkeeping (the tier's queue slot, metrics, the gate's usage record) hangs on the tasks' completion callbacks
rather than on `finally` blocks, so it happens exactly once even for a request cancelled before its first step.
Cancelling the tasks aborts their engine requests: the blocks are back in the pool by the next engine step.
A generation is `done` only once the gate has made its usage durable, so no response ends before its ledger row.
"""

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import dataclass, replace
from functools import partial

from carpool.economics.contract import (
    WITHHELD,
    Gate,
    GateError,
    Principal,
    UsageRecord,
    block_chain_text,
    ttl_write_tokens,
)
from carpool.engine.async_engine import AsyncEngine
from carpool.engine.block_manager import prompt_hash_chain
from carpool.engine.outputs import RequestOutput, best_of
from carpool.engine.request import EngineRequest
from carpool.engine.sequence import SequenceTimes
from carpool.server.admission import TierQueues
from carpool.server.metrics import Metrics


@dataclass
class Choice:
    index: int
    request: EngineRequest  # checked at the engine's door when the Generation was made
    bills_prompt: bool  # the first choice of each prompt: n choices share one prompt, billed once
    prompt_index: int = 0
    echo: str = ""  # the prompt's text, shown before the output's (completions' `echo`)
    last: RequestOutput | None = None
    finish_reason: str | None = None

    @property
    def num_output_tokens(self) -> int:
        return len(self.last.token_ids) if self.last else 0


class GenerationFailed(Exception):
    """The engine failed a request (not the caller's fault)."""


@dataclass
class Backends:
    """What a generation reports to besides its caller."""

    engine: AsyncEngine
    gate: Gate
    metrics: Metrics
    queues: TierQueues
    model_name: str


class Generation:
    def __init__(
        self,
        backends: Backends,
        request_id: str,
        tier: str,
        principal: Principal,
        choices: list[Choice],
        streaming: bool,
        keep: int | None = None,
        ledger_id: str | None = None,
    ):
        self.gate, self.metrics, self.queues = backends.gate, backends.metrics, backends.queues
        self.model_name = backends.model_name
        self.block_size = backends.engine.config.block_size  # for the ledger's block-hash chain
        self.request_id, self.tier, self.principal, self.choices = request_id, tier, principal, choices
        self.ledger_id = ledger_id or request_id  # its ledger row's request_id (contract.UsageRecord)
        self.abandoned = False  # stopped for another run to answer: its row is withheld (`abandon`)
        # Whether the prefix cache's automatic writes are billed as writes (the price sheet's `[cache] write`), as on
        # OpenAI's routes; False: as plain input (Anthropic's Messages API, where only a breakpoint writes).
        self.bills_automatic_writes = True
        self.keep = keep  # best_of: the number of each prompt's candidates that the response shows
        self.created = int(time.time())
        self.arrival = time.monotonic()
        self.error: BaseException | None = None
        self.unrecorded: GateError | None = None  # the gate could not make the usage durable: answer this instead
        # Extra UsageRecord fields, computed from the finished generation as its row is written (a cascade's step).
        self.ledger_fields: Callable[[Generation], dict] | None = None
        self.original_prompt_tokens: int | None = None  # prompt_compression: the prompt's tokens before it
        self.done = asyncio.Event()
        self._recording: asyncio.Task | None = None
        # Only a stream reads outputs one by one; a whole response is built from each choice's last output.
        self._events: asyncio.Queue | None = asyncio.Queue() if streaming else None
        self._open = len(choices)
        structured = choices[0].request.params.structured if choices else None
        self.constraint_kind = None if structured is None else structured.constraint_kind  # the ledger's column
        if structured is not None:  # counted once per request, whatever its n
            self.metrics.on_structured("tools" if structured.source == "tools" else structured.kind)
        self._tasks = []
        for choice in choices:
            task = asyncio.create_task(self._run(backends.engine, choice))
            task.add_done_callback(partial(self._choice_done, choice))
            self._tasks.append(task)

    async def _run(self, engine: AsyncEngine, choice: Choice) -> None:
        outputs = engine.generate(choice.request)
        async for output in outputs:
            if choice.last is None:
                self.queues.release(self.tier)
                self.metrics.on_first_output(self.tier, output)
            self.metrics.on_tokens(self.tier, output, choice.last)
            choice.last = output
            if self._events is not None:
                self._events.put_nowait((choice, output))

    def _choice_done(self, choice: Choice, task: asyncio.Task) -> None:
        if choice.last is None:
            self.queues.release(self.tier)
        if choice.last is not None and choice.last.finished:
            choice.finish_reason = choice.last.finish_reason
        elif task.cancelled():
            choice.finish_reason = "abort"
        else:
            choice.finish_reason = "error"
            self.error = self.error or task.exception()
        self.metrics.on_finished(self.tier, choice.finish_reason, choice.last)
        if self._events is not None:
            self._events.put_nowait((choice, None))
        self._open -= 1
        if self._open == 0:
            try:
                durable = self.gate.record(self.principal, self.usage_record())
            except Exception as error:  # a gate that fails to record must not leave the caller waiting forever
                durable = Future()
                durable.set_exception(error)
            if durable is None:
                self.done.set()
            else:
                self._recording = asyncio.ensure_future(self._await_durable(durable))

    async def _await_durable(self, durable: Future) -> None:
        try:
            await asyncio.wrap_future(durable)
        except Exception as error:
            self.unrecorded = (
                error
                if isinstance(error, GateError)
                else GateError(
                    503,
                    f"The request ran, but its usage could not be recorded ({error}); its result is withheld.",
                    "usage_not_recorded",
                )
            )
        finally:
            self.done.set()

    def cancel(self) -> None:
        for task in self._tasks:
            task.cancel()

    def abandon(self) -> None:
        """Cancel it, never to be answered: another run answers and bills it (a batch line whose server stops or
        lost its lease), so its row is written withheld, at no cost."""
        self.abandoned = True
        self.cancel()

    async def wait(self) -> None:
        """Until every choice is done and the usage is durable: GenerationFailed, or the gate's GateError."""
        await self.done.wait()
        if self.error is not None:
            raise GenerationFailed(repr(self.error))
        if self.unrecorded is not None:
            raise self.unrecorded

    async def stream(self) -> AsyncIterator[tuple[Choice, RequestOutput]]:
        """(choice, output) for every output of every choice, in arrival order, until all choices are done and
        the usage is durable (so what the caller sends after it, usage and [DONE], follows the ledger row)."""
        open_choices = len(self.choices)
        while open_choices:
            choice, output = await self._events.get()
            if output is not None:
                yield choice, output
                continue
            open_choices -= 1
            if self.error is not None:
                raise GenerationFailed(repr(self.error))
        await self.wait()

    def shown_choices(self) -> list[Choice]:
        """The choices a whole response shows: all of them, or with best_of the `keep` of each prompt's candidates
        with the highest cumulative logprob, numbered from 0 (the others are still billed)."""
        if self.keep is None:
            return self.choices
        shown = []
        for prompt_index in dict.fromkeys(c.prompt_index for c in self.choices):
            candidates = {id(c.last): c for c in self.choices if c.prompt_index == prompt_index}
            for output in best_of([c.last for c in candidates.values()], self.keep):
                shown.append(replace(candidates[id(output)], index=len(shown)))
        return shown

    # Usage ---------------------------------------------------------------------------------------------

    @property
    def prompt_tokens(self) -> int:
        return sum(len(c.request.prompt_token_ids) for c in self.choices if c.bills_prompt)

    @property
    def cached_tokens(self) -> int:
        return sum(c.last.num_cached_tokens for c in self.choices if c.bills_prompt and c.last)

    @property
    def cache_write_tokens(self) -> int:
        """Prompt tokens written to the prefix cache without a TTL pin (automatic, LRU)."""
        return sum(c.last.num_cache_write_tokens for c in self.choices if c.bills_prompt and c.last)

    @property
    def ttl_write_tokens(self) -> tuple[int, int]:
        """(5m, 1h): prompt tokens written under a cache breakpoint's TTL pin. A breakpoint the pins' bound refused,
        or one shorter than the minimum, wrote its prefix as an ordinary (automatic) write, in cache_write_tokens."""
        by_ttl: dict[float, int] = {}
        for choice in self.choices:
            if choice.bills_prompt and choice.last:
                for ttl, tokens in choice.last.cache_write_tokens_by_ttl.items():
                    by_ttl[ttl] = by_ttl.get(ttl, 0) + tokens
        return ttl_write_tokens(by_ttl)

    @property
    def completion_tokens(self) -> int:
        return sum(c.num_output_tokens for c in self.choices)

    def usage(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens}
            | ({} if self.original_prompt_tokens is None else {"original_prompt_tokens": self.original_prompt_tokens}),
        }

    def usage_record(self) -> UsageRecord:
        queue, prefill, decode = self._phase_seconds()
        reasons = {c.finish_reason for c in self.choices}
        writes_5m, writes_1h = self.ttl_write_tokens
        created = time.time()
        record = UsageRecord(
            created=created,
            arrived=created - (time.monotonic() - self.arrival),
            prompt_block_chain=self._prompt_block_chain(),
            request_id=self.ledger_id,
            model=self.model_name,
            tier=self.tier,
            prompt_tokens=self.prompt_tokens,
            cached_tokens=self.cached_tokens,
            cache_write_tokens=self.cache_write_tokens if self.bills_automatic_writes else 0,
            cache_write_5m_tokens=writes_5m,
            cache_write_1h_tokens=writes_1h,
            output_tokens=self.completion_tokens,
            queue_seconds=queue,
            prefill_seconds=prefill,
            decode_seconds=decode,
            finish_reason=WITHHELD
            if self.abandoned
            else next((r for r in ("error", "abort", "length") if r in reasons), "stop"),
            key_id=self.principal.key_id,
            tenant=self.principal.tenant,
            original_prompt_tokens=self.original_prompt_tokens,
            constraint_kind=self.constraint_kind,
        )
        return replace(record, **self.ledger_fields(self)) if self.ledger_fields else record

    def _prompt_block_chain(self) -> str | None:
        """Each billed prompt's chain of prefix-cache keys (salted as its cache lookups are), for replays."""
        return block_chain_text(
            [
                prompt_hash_chain(c.request.prompt_token_ids, self.block_size, c.request.cache_salt)
                for c in self.choices
                if c.bills_prompt
            ]
        )

    def _phase_seconds(self) -> tuple[float, float, float]:
        """Queue, prefill and decode seconds of the request as a whole: from its first choice's arrival to its
        last choice's end. A phase a choice never reached (aborted early) counts as zero."""
        now = time.monotonic()
        times = [c.last.times if c.last and c.last.times else SequenceTimes(arrival=self.arrival) for c in self.choices]
        end = max(t.finished or now for t in times)
        arrival = min(t.arrival for t in times)
        scheduled = min((t.first_scheduled for t in times if t.first_scheduled is not None), default=end)
        first_token = min((t.first_token for t in times if t.first_token is not None), default=end)
        return scheduled - arrival, first_token - scheduled, end - first_token

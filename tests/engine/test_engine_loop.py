"""One EngineLoop driving several engines (what `carpool serve --model A --model B` runs on its main thread):
busy engines take turns a step each, idle ones cost nothing, and a failure fails every engine on the loop."""

import asyncio
import time

import pytest

from carpool.engine.async_engine import AsyncEngine, EngineLoop
from carpool.engine.request import EngineRequest
from carpool.engine.sampling_params import SamplingParams


class StepCounter:
    """Stands in for an LLMEngine: has `work` steps to do and logs each one it takes."""

    def __init__(self, name: str, log: list[str], work: int = 0, fails: bool = False):
        self.name, self.log, self.work, self.fails = name, log, work, fails
        self.config = self.tokenizer = self.door = None
        self.max_model_len = 64
        self.last_step = None
        self.has_work_calls = 0

    def has_unfinished_requests(self) -> bool:
        self.has_work_calls += 1
        return self.work > 0

    def step(self) -> list:
        if self.fails:
            raise RuntimeError(f"{self.name} broke")
        self.work -= 1
        self.log.append(self.name)
        return []

    def enqueue(self, request: EngineRequest):
        self.work += 1


def engines_on_one_loop(*fakes: StepCounter) -> tuple[EngineLoop, list[AsyncEngine]]:
    loop = EngineLoop()
    return loop, [AsyncEngine(engine=fake, engine_loop=loop) for fake in fakes]


def run_until(loop: EngineLoop, done, timeout: float = 5) -> None:
    loop.start()
    deadline = time.monotonic() + timeout
    while not done() and time.monotonic() < deadline:
        time.sleep(0.01)
    loop.stop()


def test_busy_engines_take_turns_one_step_each():
    log = []
    long, short = StepCounter("long", log, work=5), StepCounter("short", log, work=2)
    loop, _ = engines_on_one_loop(long, short)
    run_until(loop, lambda: len(log) == 7)
    assert log == ["long", "short", "long", "short", "long", "long", "long"]


def test_idle_engines_leave_the_loop_asleep():
    log = []
    fakes = StepCounter("a", log), StepCounter("b", log)
    loop, _ = engines_on_one_loop(*fakes)
    loop.start()
    time.sleep(0.3)
    loop.stop()
    # A spinning loop would ask hundreds of thousands of times in 0.3 s; a sleeping one asks once per wake-up.
    assert sum(fake.has_work_calls for fake in fakes) <= 6
    assert log == []


def test_a_request_wakes_the_loop_and_runs_on_its_own_engine():
    log = []
    loop, (_, b) = engines_on_one_loop(StepCounter("a", log), StepCounter("b", log))
    loop.start()
    time.sleep(0.05)  # asleep by now
    b.engine_loop.send(b, EngineRequest("r", [1], SamplingParams(max_tokens=1)))
    run_until(loop, lambda: log)
    assert log == ["b"]


def test_a_failing_engine_fails_alone_and_the_loop_steps_the_others():
    log = []
    ok, bad = StepCounter("ok", log, work=3), StepCounter("bad", log, work=1, fails=True)
    loop, engines = engines_on_one_loop(ok, bad)
    run_until(loop, lambda: ok.work == 0 and engines[1].error is not None)
    assert log == ["ok", "ok", "ok"]  # the loop went on stepping the engine that works
    assert engines[0].error is None and repr(engines[1].error) == repr(RuntimeError("bad broke"))

    async def generate(engine):
        request = EngineRequest("r", [1], SamplingParams(max_tokens=1))
        return [output async for output in engine.generate(request)]

    with pytest.raises(RuntimeError, match="engine stopped"):
        asyncio.run(generate(engines[1]))

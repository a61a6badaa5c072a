"""Tier order, aging and preemption, on the scheduler alone (no model): fast and exact."""

import time

from carpool.engine.block_manager import BlockManager
from carpool.engine.config import EngineConfig
from carpool.engine.sampling_params import SamplingParams
from carpool.engine.scheduler import Scheduler
from carpool.engine.sequence import Sequence

PARAMS = SamplingParams(max_tokens=50)


def make(max_num_seqs=2, num_blocks=64, budget=64, aging=30.0, prefix_caching=False):
    config = EngineConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, priority_aging_seconds=aging)
    return Scheduler(config, BlockManager(num_blocks, 16, prefix_caching))


def request(name, priority, length=8, arrival=None):
    seq = Sequence(name, list(range(100, 100 + length)), PARAMS, priority=priority)
    if arrival is not None:
        seq.times.arrival = arrival
    return seq


def step(scheduler):
    """Schedule, then pretend the model ran: computed tokens advance and finished prompts sample a token."""
    batch = scheduler.schedule()
    for seq, n in zip(batch.seqs, batch.num_new_tokens):
        seq.num_computed_tokens += n
        if seq.num_computed_tokens == seq.num_tokens:
            seq.token_ids.append(7)
    return batch


def test_priority_arrival_preempts_lower_tier_when_sequence_slots_are_full():
    scheduler = make(max_num_seqs=2)
    flex = [request("flex-0", 2), request("flex-1", 2)]
    for seq in flex:
        scheduler.add(seq)
    step(scheduler)
    assert {s.request_id for s in scheduler.running} == {"flex-0", "flex-1"}
    urgent = request("priority", 0)
    scheduler.add(urgent)
    batch = step(scheduler)
    assert urgent in scheduler.running
    assert [s.request_id for s in batch.preempted] == ["flex-1"]  # the later arrival of the lowest tier
    assert flex[1].num_computed_tokens == 0 and flex[1].block_table == []


def test_preempted_request_keeps_its_place_in_its_queue():
    scheduler = make(max_num_seqs=1)
    first = request("flex-first", 2)
    scheduler.add(first)
    step(scheduler)
    later = request("flex-later", 2)
    scheduler.add(later)
    scheduler.add(request("priority", 0, length=4))
    step(scheduler)  # priority preempts flex-first
    assert first.num_preemptions == 1
    scheduler.running[0].token_ids.extend([7] * 60)  # let the priority request finish
    scheduler.remove(scheduler.running[0])
    step(scheduler)
    assert [s.request_id for s in scheduler.running] == ["flex-first"]


def test_aging_lets_a_starved_tier_in_without_preemption_ping_pong():
    scheduler = make(max_num_seqs=1, aging=0.05)
    old_flex = request("flex", 2, arrival=time.monotonic() - 1.0)  # waited 20 aging periods: boost capped at 2
    scheduler.add(request("default", 1))
    step(scheduler)
    scheduler.add(old_flex)
    preemptions = sum(len(step(scheduler).preempted) for _ in range(30))
    assert preemptions <= 1


def test_waiting_priority_prompt_is_not_stuck_behind_a_lower_tier_prompt_in_progress():
    scheduler = make(max_num_seqs=4, budget=32)
    long_batch_prompt = request("batch", 3, length=200)
    scheduler.add(long_batch_prompt)
    step(scheduler)
    urgent = request("priority", 0, length=20)
    scheduler.add(urgent)
    batch = step(scheduler)
    assert batch.seqs[0] is urgent and batch.num_new_tokens[0] == 20


def test_flex_waits_while_priority_requests_keep_the_slots():
    scheduler = make(max_num_seqs=1)
    scheduler.add(request("flex", 2))
    scheduler.add(request("priority", 0))
    step(scheduler)
    assert [s.request_id for s in scheduler.running] == ["priority"]


def test_background_decodes_sit_out_steps_that_compute_a_foreground_prompt():
    scheduler = make(max_num_seqs=4, budget=64)
    background = [request(f"batch-{i}", 3) for i in range(2)]
    for seq in background:
        scheduler.add(seq)
    step(scheduler)  # both prompts computed; both now decode
    assert {s.request_id for s in step(scheduler).seqs} == {"batch-0", "batch-1"}
    urgent = request("priority", 0, length=20)
    scheduler.add(urgent)
    batch = step(scheduler)
    assert batch.seqs == [urgent]  # the interactive prompt gets the step to itself
    batch = step(scheduler)  # now the priority request decodes too: everyone shares the step again
    assert set(batch.seqs) == {urgent, *background}

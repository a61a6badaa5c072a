"""Block accounting checks shared by the engine tests."""


def check_block_invariants(engine):
    """Every block is exactly one of: empty-free, cached-unreferenced (free, hashed), referenced by live seqs."""
    manager = engine.block_manager
    holders: dict[int, int] = {}
    for seq in engine.scheduler.running:
        for block_id in seq.block_table:
            holders[block_id] = holders.get(block_id, 0) + 1
    for seq in engine.scheduler.waiting:
        assert seq.block_table == []
    for block in manager.blocks:
        assert block.ref_count == holders.get(block.block_id, 0)
        assert (block.ref_count == 0) == (block.block_id in manager.free_queue)
        if block.block_hash is not None:
            assert manager.cached[block.block_hash] == block.block_id
    assert len(manager.cached) == sum(1 for b in manager.blocks if b.block_hash is not None)


def run_with_aborts(engine, aborts: dict[int, list[str]]) -> int:
    """Step the engine to idle, aborting the named requests after the given step numbers and checking the
    accounting after every step. Returns the number of preemptions, and asserts every block came back."""
    steps = preemptions = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        preemptions += engine.last_step.num_preemptions
        for request_id in aborts.get(steps, []):
            engine.abort(request_id)
        check_block_invariants(engine)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return preemptions

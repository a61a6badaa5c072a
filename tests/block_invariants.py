"""Block accounting checks shared by the engine tests."""


def _check_group(manager, table_of, running, waiting, placeholder=None):
    holders: dict[int, int] = {}
    for seq in running:
        for block_id in table_of(seq):
            if block_id != placeholder:
                holders[block_id] = holders.get(block_id, 0) + 1
    for seq in waiting:
        assert table_of(seq) == []
    for block in manager.blocks:
        assert block.ref_count == holders.get(block.block_id, 0)
        # A pinned block is never on the free queue (LRU eviction cannot reach it), whatever its references.
        assert (block.ref_count == 0 and not block.pinned_until) == (block.block_id in manager.free_queue)
        assert bool(block.pinned_until) == (block.block_id in manager.pinned)
        if block.pinned_until:
            assert block.block_hash is not None and block.pin_ttl > 0  # only a cached prefix is pinned
        if block.block_hash is not None:
            assert manager.cached[block.block_hash] == block.block_id
    assert len(manager.cached) == sum(1 for b in manager.blocks if b.block_hash is not None)
    assert len(manager.pinned) <= manager.max_pinned_blocks
    assert sum(manager.pin_stats.pinned_blocks.values()) == len(manager.pinned)


def check_block_invariants(engine):
    """Every block is exactly one of: empty-free, cached-unreferenced (free, hashed), referenced by live seqs;
    in the sliding-window group too, where a table's placeholder for out-of-window keys holds no block."""
    manager, scheduler = engine.block_manager, engine.scheduler
    _check_group(manager, lambda seq: seq.block_table, scheduler.running, scheduler.waiting)
    if manager.sliding:
        _check_group(
            manager.sliding,
            lambda seq: seq.sliding_block_table,
            scheduler.running,
            scheduler.waiting,
            manager.sliding.null_block,
        )
        for seq in scheduler.running:
            assert len(seq.sliding_block_table) == len(seq.block_table)


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
    check_idle(engine)
    return preemptions


def check_idle(engine):
    """An idle engine holds no block but its pins: each block is free, or pinned with no reference (its TTL
    live, or lapsed and not yet expired: expiry runs at the next schedule). After `expire_pins` at a time past every
    TTL, every block is free."""
    for manager in filter(None, (engine.block_manager, engine.block_manager.sliding)):
        assert all(block.ref_count == 0 for block in manager.blocks)
        assert manager.num_free_blocks + len(manager.pinned) == manager.num_blocks

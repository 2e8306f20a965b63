"""
Tests of the block pool: BlockManager and Sequence driven by hand, with no model (pure Python, fast).

Each test checks one rule of the block manager, calls bm.check_invariants() after
every operation, and ends by freeing every sequence and checking that the whole pool is free or
cached again. The engine's way of computing a prompt is simulated by `computed` below.

    python -m pytest -q tests/test_block_manager.py
"""
from collections import deque

import pytest

from nanopaged import BlockManager, Sequence
from conftest import SEQ_IDS


def toks(start, n):
    """n distinct token ids from start: different starts give sequences with nothing in common."""
    return list(range(start, start + n))


def alloc(bm, seq):
    bm.allocate(seq)
    bm.check_invariants()
    return seq


def computed(bm, seq):
    """What the engine does for a prompt: allocate, compute every token, register the full blocks."""
    alloc(bm, seq)
    seq.num_computed_tokens = len(seq)
    bm.cache_full_blocks(seq)
    bm.check_invariants()
    return seq


def free_all(bm, *seqs):
    for seq in seqs:
        bm.free(seq)
        bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks


def test_allocate_and_free_basics():
    """A 40-token sequence at block_size 16 takes 3 blocks from the front of an O(1) pool; free returns them."""
    bm = BlockManager(8, 16)
    assert isinstance(bm.device.empty_block_ids, deque)   # popleft/append: O(1) allocate and free
    seq = alloc(bm, Sequence(next(SEQ_IDS), toks(0, 40)))
    assert seq.block_table == [0, 1, 2]
    assert bm.num_free_blocks == 5 and [bm.device.blocks[i].ref_count for i in range(4)] == [1, 1, 1, 0]
    free_all(bm, seq)
    assert seq.block_table == [] and list(bm.device.empty_block_ids) == [3, 4, 5, 6, 7, 2, 1, 0]   # tail first
    assert not bm.device.cached_block_ids   # never registered, so nothing to keep


def test_prefix_hit_through_hash_chain():
    """A second sequence sharing a 64-token prefix gets its 4 full blocks from the prefix cache."""
    bm = BlockManager(16, 16)
    prefix = toks(0, 64)
    a = computed(bm, Sequence(next(SEQ_IDS), prefix + toks(500, 5)))   # 69 tokens: 4 full blocks registered
    assert len(bm.device.hash_to_block_ids) == 4
    assert (bm.counts["prefix_cache_queries"], bm.counts["prefix_cache_hits"]) == (69, 0)
    b = alloc(bm, Sequence(next(SEQ_IDS), prefix + toks(900, 10)))
    assert b.num_cached_tokens == b.num_computed_tokens == 64
    assert b.block_table[:4] == a.block_table[:4] and b.block_table[4] not in a.block_table
    assert [bm.device.blocks[i].ref_count for i in b.block_table] == [2, 2, 2, 2, 1]
    assert (bm.counts["prefix_cache_queries"], bm.counts["prefix_cache_hits"]) == (69 + 74, 64)
    bm.free(a)
    bm.check_invariants()
    assert [bm.device.blocks[i].ref_count for i in b.block_table[:4]] == [1, 1, 1, 1]
    free_all(bm, b)


def test_fully_cached_prompt_still_computes_last_token():
    """A prompt cached in full still leaves the block holding its last token to compute: 48 of 64 hit."""
    bm = BlockManager(16, 16)
    a = computed(bm, Sequence(next(SEQ_IDS), toks(0, 64)))
    assert len(bm.device.hash_to_block_ids) == 4
    b = alloc(bm, Sequence(next(SEQ_IDS), toks(0, 64)))
    assert b.num_cached_tokens == 48
    assert b.block_table[:3] == a.block_table[:3] and b.block_table[3] != a.block_table[3]
    assert bm.counts["prefix_cache_hits"] == 48
    free_all(bm, a, b)


def test_chain_needs_first_block_to_match():
    """A sequence whose first block differs gets no hit, even though its later blocks are equal."""
    bm = BlockManager(16, 16)
    a = computed(bm, Sequence(next(SEQ_IDS), toks(0, 64) + [7]))
    b = alloc(bm, Sequence(next(SEQ_IDS), toks(1000, 16) + toks(16, 48) + [7]))
    assert b.num_cached_tokens == 0 and not set(a.block_table) & set(b.block_table)
    assert bm.counts["prefix_cache_hits"] == 0
    free_all(bm, a, b)


COLLIDING_HASHES = {   # name -> (compute_hash, tokens seq C gets from the cache)
    "constant": (lambda parent_hash, token_ids: 42, 8),   # every block in one bucket: tokens and parent decide
    "ignores parent": (lambda parent_hash, token_ids: hash(tuple(token_ids)), 8),
}


@pytest.mark.parametrize("name", COLLIDING_HASHES)
def test_forced_hash_collisions_never_hand_out_wrong_blocks(monkeypatch, name):
    """Under a colliding hash, hits are checked against tokens and parent: no wrong block is shared."""
    fn, c_hits = COLLIDING_HASHES[name]
    monkeypatch.setattr(BlockManager, "compute_hash", staticmethod(fn))
    bm = BlockManager(16, 4)
    X, Y, Z = toks(0, 4), toks(10, 4), toks(20, 4)
    a = computed(bm, Sequence(next(SEQ_IDS), X + Y + [99]))
    b = alloc(bm, Sequence(next(SEQ_IDS), Z + Y + [99]))   # Y after Z is not Y after X
    assert b.num_cached_tokens == 0 and not set(a.block_table) & set(b.block_table)
    c = alloc(bm, Sequence(next(SEQ_IDS), X + Y + [99]))
    assert c.num_cached_tokens == c_hits
    assert c.block_table[:c_hits // 4] == a.block_table[:c_hits // 4]
    for i in range(c_hits // 4):
        assert bm.device.blocks[c.block_table[i]].token_ids == tuple(c.token_ids[4 * i:4 * i + 4])
    free_all(bm, a, b, c)


def test_collision_one_block_up_never_hands_out_wrong_blocks(monkeypatch):
    """A collision one block up never hands out K/V computed after another prefix: a hit needs its exact parent."""
    monkeypatch.setattr(BlockManager, "compute_hash", staticmethod(COLLIDING_HASHES["ignores parent"][0]))
    bm = BlockManager(16, 4)
    W, X, Z = toks(0, 4), toks(10, 4), toks(20, 4)
    a = computed(bm, Sequence(next(SEQ_IDS), X + [99]))            # registers X at position 0
    d = computed(bm, Sequence(next(SEQ_IDS), W + X + Z + [99]))    # registers W, and Z after W X (X's hash is taken)
    e = alloc(bm, Sequence(next(SEQ_IDS), X + Z + [99]))           # Z after X: d's Z block holds K/V of Z after W X
    assert e.block_table[0] == a.block_table[0]     # X at position 0 is a correct hit
    assert d.block_table[2] not in e.block_table, "e got d's K/V for Z, computed after W X, not after X"
    assert e.num_cached_tokens == 4
    free_all(bm, a, d, e)


def test_eviction_keeps_cached_blocks_and_evicts_least_recently_freed():
    """Freed registered blocks stay cached; fresh allocations evict the earliest freed, tail first."""
    bm = BlockManager(6, 4)
    a = computed(bm, Sequence(next(SEQ_IDS), toks(100, 8)))   # blocks [0, 1]
    b = computed(bm, Sequence(next(SEQ_IDS), toks(200, 8)))   # blocks [2, 3]
    assert (a.block_table, b.block_table) == ([0, 1], [2, 3])
    bm.free(a)
    bm.check_invariants()
    bm.free(b)
    bm.check_invariants()
    assert list(bm.device.cached_block_ids) == [1, 0, 3, 2] and list(bm.device.empty_block_ids) == [4, 5]
    assert bm.num_free_blocks == 6 and len(bm.device.hash_to_block_ids) == 4
    f1 = alloc(bm, Sequence(next(SEQ_IDS), toks(300, 12)))    # truly free blocks first, then a's tail
    assert f1.block_table == [4, 5, 1] and bm.counts["num_evictions"] == 1
    f2 = alloc(bm, Sequence(next(SEQ_IDS), toks(400, 8)))     # then a's head, then b's tail
    assert f2.block_table == [0, 3] and bm.counts["num_evictions"] == 3
    assert list(bm.device.cached_block_ids) == [2] and len(bm.device.hash_to_block_ids) == 1
    free_all(bm, f1, f2)
    lost = alloc(bm, Sequence(next(SEQ_IDS), toks(100, 8) + [1]))   # a's prefix was evicted
    assert lost.num_cached_tokens == 0
    kept = alloc(bm, Sequence(next(SEQ_IDS), toks(200, 4) + [1]))   # b's first block survived
    assert kept.num_cached_tokens == 4 and kept.block_table[0] == 2
    free_all(bm, lost, kept)


def test_fork_shares_blocks_and_copies_shared_last_block_on_write():
    """Forked sequences share every block; writing a shared partly filled block copies it, except for the last holder."""
    bm = BlockManager(8, 16)
    parent = alloc(bm, Sequence(next(SEQ_IDS), toks(0, 20)))   # blocks [0, 1], block 1 holds 4 tokens
    parent.num_computed_tokens = 20
    children = []
    for _ in range(3):
        child = Sequence(next(SEQ_IDS), parent.token_ids, request_id=parent.request_id)
        bm.fork(parent, child)
        bm.check_invariants()
        children.append(child)
    assert all(c.block_table == [0, 1] and c.num_computed_tokens == 20 for c in children)
    assert (bm.device.blocks[0].ref_count, bm.device.blocks[1].ref_count) == (4, 4)
    copies = []
    for t, seq in enumerate([parent] + children):
        seq.append_token(1000 + t)
        bm.check_invariants()
        assert bm.can_append(seq)
        copies.append(bm.append_slot(seq))
        bm.check_invariants()
    assert copies[:3] == [(1, 2), (1, 3), (1, 4)] and copies[3] is None
    assert [s.block_table for s in [parent] + children] == [[0, 2], [0, 3], [0, 4], [0, 1]]
    assert [bm.device.blocks[i].ref_count for i in range(5)] == [4, 1, 1, 1, 1]
    assert bm.counts["num_cow_copies"] == 3
    free_all(bm, parent, *children)


def test_append_slot_takes_a_block_exactly_when_last_token_starts_one():
    """append_slot adds a block only when len(seq)-1 is a multiple of block_size; can_append is False with none left."""
    bm = BlockManager(3, 4)
    seq = alloc(bm, Sequence(next(SEQ_IDS), [0]))
    grew_at = []
    for t in range(1, 12):
        seq.append_token(t)
        bm.check_invariants()
        before = len(seq.block_table)
        assert bm.can_append(seq)
        assert bm.append_slot(seq) is None
        bm.check_invariants()
        if len(seq.block_table) > before:
            grew_at.append(len(seq))
    assert grew_at == [5, 9] and seq.block_table == [0, 1, 2] and bm.num_free_blocks == 0
    seq.append_token(12)                 # token 12 starts block 3: the pool has none
    bm.check_invariants()
    assert not bm.can_append(seq)
    free_all(bm, seq)


def test_can_allocate_respects_watermark_and_counts_hits_on_held_blocks_as_free():
    """can_allocate keeps `watermark` blocks free; hits on held blocks cost none, hits on cached ones cost one."""
    bm = BlockManager(10, 16)
    seq = Sequence(next(SEQ_IDS), toks(0, 40))              # 3 blocks
    assert bm.can_allocate(seq, watermark=7) and not bm.can_allocate(seq, watermark=8)

    bm = BlockManager(5, 4)
    a = computed(bm, Sequence(next(SEQ_IDS), toks(0, 16)))   # 4 full blocks held and registered, 1 free
    b = Sequence(next(SEQ_IDS), toks(0, 16) + [99])          # 5 blocks: 4 hits on a's, the last token's block fresh
    assert bm.can_allocate(b) and not bm.can_allocate(b, watermark=1)
    assert not bm.can_allocate(Sequence(next(SEQ_IDS), toks(500, 17)))   # same size, no sharing: 5 fresh blocks
    alloc(bm, b)
    assert b.block_table == [0, 1, 2, 3, 4] and b.num_cached_tokens == 16 and bm.num_free_blocks == 0
    # every block but the last token's would hit, but that one must be fresh and none is free
    assert not bm.can_allocate(Sequence(next(SEQ_IDS), toks(0, 16) + [98]))
    free_all(bm, a, b)
    # now the 4 hits are cached blocks nobody holds: taking them uses up the free count
    c = Sequence(next(SEQ_IDS), toks(0, 16) + [98])
    assert bm.can_allocate(c) and not bm.can_allocate(c, watermark=1)
    alloc(bm, c)
    assert c.num_cached_tokens == 16 and bm.num_free_blocks == 0
    free_all(bm, c)


def test_prefix_caching_disabled_registers_and_hits_nothing():
    """With enable_prefix_caching=False nothing is registered, nothing hits and no query is counted."""
    bm = BlockManager(10, 16, enable_prefix_caching=False)
    a = computed(bm, Sequence(next(SEQ_IDS), toks(0, 74)))
    b = alloc(bm, Sequence(next(SEQ_IDS), toks(0, 64) + toks(900, 10)))
    assert b.num_cached_tokens == 0 and not set(a.block_table) & set(b.block_table)
    assert bm.device.hash_to_block_ids == {} and all(blk.hash is None for blk in bm.device.blocks)
    assert (bm.counts["prefix_cache_queries"], bm.counts["prefix_cache_hits"]) == (0, 0)
    free_all(bm, a, b)
    assert not bm.device.cached_block_ids and len(bm.device.empty_block_ids) == 10


@pytest.mark.parametrize("block_size", [0, 3, 12, -4])
def test_bad_block_size_raises(block_size):
    """A block_size that is not a positive power of two raises ValueError saying so."""
    with pytest.raises(ValueError, match="power of two"):
        BlockManager(8, block_size)


@pytest.mark.parametrize("rule", ["ref_count", "partition", "hash map"])
def test_check_invariants_names_the_broken_rule(rule):
    """check_invariants raises an AssertionError naming the rule a tampered pool breaks."""
    bm = BlockManager(8, 4)
    seq = computed(bm, Sequence(next(SEQ_IDS), toks(0, 10)))   # blocks [0, 1, 2]; 0 and 1 registered
    block = bm.device.blocks[seq.block_table[0]]
    if rule == "ref_count":
        block.ref_count += 1
        with pytest.raises(AssertionError, match="ref_count"):
            bm.check_invariants()
        block.ref_count -= 1
    elif rule == "partition":                     # a used block also in the free pool
        bm.device.empty_block_ids.append(block.block_id)
        with pytest.raises(AssertionError, match="partition"):
            bm.check_invariants()
        bm.device.empty_block_ids.pop()
    else:                                         # a registered block's tokens no longer hash to its key
        saved, block.token_ids = block.token_ids, (7, 7, 7, 7)
        with pytest.raises(AssertionError, match="hash map"):
            bm.check_invariants()
        block.token_ids = saved
    bm.check_invariants()
    free_all(bm, seq)


def test_a_broken_invariant_says_the_step_the_block_what_it_is_and_what_is_wanted():
    """Two samples share their prompt's first block; at step 2 that block's ref_count is raised by
    one: the check says 'step 2: block B has ref_count 3, held by 2 tables'; a block listed free
    while held says how many lists hold it and the one wanted."""
    from nanopaged import LLM, SamplingParams
    llm = LLM("random:tiny", block_size=4, num_blocks=16)
    llm.add_requests([toks(1, 6)], SamplingParams(temperature=1.0, n=2, max_tokens=4))
    llm.step()
    llm.step()
    first = llm.scheduler.running[0].seqs[0].block_table[0]
    block = llm.block_manager.device.blocks[first]
    block.ref_count += 1
    with pytest.raises(AssertionError) as error:
        llm.block_manager.check_invariants()
    assert str(error.value) == f"step 2: block {first} has ref_count 3, held by 2 tables"
    block.ref_count -= 1
    llm.block_manager.device.empty_block_ids.append(first)
    with pytest.raises(AssertionError) as error:
        llm.block_manager.check_invariants()
    assert str(error.value).startswith(f"step 2: partition: block {first} is in 2 lists "
                                       "(cached: False), want one alone (ref_count 2")
    llm.block_manager.device.empty_block_ids.pop()
    while llm.scheduler.has_unfinished():
        llm.step()
    llm.block_manager.check_invariants()

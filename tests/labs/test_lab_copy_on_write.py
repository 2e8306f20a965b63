"""
Lab copy-on-write: fork and copy-on-write (BlockManager.fork and append_slot's copy branch in
nanopaged.py).

What the student writes: fork, where a child shares its parent's blocks (ref_count up, no K/V
copied), and append_slot's copy branch, where a sequence about to write into a shared, partly
filled block first gets its own copy (a BlockCopy queued for the engine), the others keeping the
original.
What the tests pin, on BlockManager alone and on an engine stepped without a model: the blocks
shared and their ref_counts after a fork, the one copy a shared last block costs its first
writer, none for full blocks or for the last holder, and the copied K/V equal to the original's.

    python tests/labs/labs.py grade copy-on-write
"""
import torch

from conftest import SEQ_IDS, assert_no_block_held, computed, step_without_model
from labs.labs import plural
from nanopaged import LLM, BlockCopy, BlockManager, SamplingParams, Sequence


def forked(bm, parent, num_blocks=None):
    child = Sequence(next(SEQ_IDS), list(parent.token_ids))
    bm.fork(parent, child, num_blocks)
    bm.check_invariants()
    return child


def assert_ref_counts(bm, seqs):
    """Each block's ref_count is the number of the seqs holding it."""
    for block_id in {b for s in seqs for b in s.block_table}:
        holders = [s.seq_id for s in seqs if block_id in s.block_table]
        r = bm.device.blocks[block_id].ref_count
        assert r == len(holders), (f"block {block_id}: ref_count {r}, but it is held by "
                                   f"{plural(len(holders), 'sequence')} (seqs {holders})")


def test_fork_shares_every_block_and_copies_nothing():
    """A child forked from a 6-token parent holds the parent's 2 blocks: ref_count 2, no copy."""
    bm = BlockManager(8, 4)
    parent = computed(bm, [1, 2, 3, 4, 5, 6])
    free_before = bm.num_free_blocks
    child = forked(bm, parent)
    assert child.block_table == parent.block_table, (
        f"fork: seq {child.seq_id} got blocks {child.block_table}; it must share its parent's "
        f"{parent.block_table} (ref_count + 1 each), not copy them")
    assert_ref_counts(bm, [parent, child])
    assert not bm.copies, f"fork queued copies {list(bm.copies)}: sharing copies no K/V"
    assert bm.num_free_blocks == free_before, "fork took free blocks: sharing takes none"
    assert child.num_computed_tokens == 6, "the shared tokens count as computed in the child"
    said = bm.events.records[-1].words()
    want = f"seq {child.seq_id} forks from seq {parent.seq_id}: blocks 0, 1 shared"
    assert said == want, f"the trace's last event says {said!r}, want {want!r}"
    for seq in (parent, child):
        bm.free(seq)
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks


def test_fork_with_num_blocks_shares_only_the_first():
    """fork(parent, child, 1): block 0 shared, the rest fresh and counted as not computed."""
    bm = BlockManager(8, 4)
    parent = computed(bm, [1, 2, 3, 4, 5, 6])
    child = forked(bm, parent, 1)
    assert child.block_table[0] == parent.block_table[0], (
        f"fork(num_blocks=1): seq {child.seq_id}'s block 0 is {child.block_table[0]}; it must "
        f"share the parent's {parent.block_table[0]}")
    assert child.block_table[1] != parent.block_table[1], "block 1 is past num_blocks: fresh"
    assert child.num_computed_tokens == 4, (
        f"seq {child.seq_id}: {plural(child.num_computed_tokens, 'token')} computed; only the "
        "shared block's 4 are")
    assert_ref_counts(bm, [parent, child])
    for seq in (parent, child):
        bm.free(seq)
    bm.check_invariants()


def test_the_first_writer_of_a_shared_block_copies_it_the_last_writes_in_place():
    """Parent and child share a partly filled block: the first to append copies it, the second,
    its only holder now, writes in place."""
    bm = BlockManager(8, 4)
    parent = computed(bm, [1, 2, 3, 4, 5, 6])
    child = forked(bm, parent)
    shared = parent.block_table[-1]
    parent.append_token(7)
    got = bm.append_slot(parent)
    bm.check_invariants()
    dst = parent.block_table[-1]
    assert got == (shared, dst) and dst != shared, (
        f"append_slot(seq {parent.seq_id}) returned {got}; block {shared} is shared (ref_count "
        "2) and partly filled: the writer gets a copy, (src, dst)")
    assert list(bm.copies) == [BlockCopy(bm.device, shared, bm.device, dst)], (
        f"copies queued: {list(bm.copies)}; want one, block {shared} into block {dst}")
    assert child.block_table[-1] == shared, "the child keeps the original block"
    said = bm.events.records[-1].words()
    want = (f"seq {parent.seq_id} copies shared block {shared} to block {dst} before writing "
            "(copy-on-write)")
    assert said == want, f"the trace's last event says {said!r}, want {want!r}"
    assert_ref_counts(bm, [parent, child])
    bm.copies.clear()
    child.append_token(8)
    assert bm.append_slot(child) is None, (f"seq {child.seq_id} holds block {shared} alone now: "
                                           "it writes in place, no copy")
    assert not bm.copies and bm.counts["num_cow_copies"] == 1
    for seq in (parent, child):
        bm.free(seq)
    bm.check_invariants()


def test_a_full_shared_block_is_never_copied():
    """Parent and child share 2 full blocks: appending takes a new block each, copies none."""
    bm = BlockManager(8, 4)
    parent = computed(bm, list(range(1, 9)))
    child = forked(bm, parent)
    for seq in (parent, child):
        seq.append_token(9)
        assert bm.append_slot(seq) is None, (f"seq {seq.seq_id}: its last block is full: the "
                                             "next token goes to a new block, no copy")
        bm.check_invariants()
    assert parent.block_table[:2] == child.block_table[:2], "the full blocks stay shared"
    assert not bm.copies and bm.counts["num_cow_copies"] == 0
    assert_ref_counts(bm, [parent, child])
    for seq in (parent, child):
        bm.free(seq)
    bm.check_invariants()


def test_n_samples_share_the_prompt_and_copy_its_last_block_with_its_kv():
    """An n=3 request in an engine stepped without a model: its samples fork on the first token,
    share the prompt's blocks; the next step copies the shared last block twice, K/V and all."""
    llm = LLM("random:tiny", block_size=4, num_blocks=16, async_copies=False)
    llm.add_requests([[1, 2, 3, 4, 5, 6]], SamplingParams(n=3, max_tokens=3, seed=0))
    step_without_model(llm)
    request = llm.scheduler.running[0]
    tables = [list(s.block_table) for s in request.seqs]
    assert len(tables) == 3 and tables.count(tables[0]) == 3, (
        f"step 1: the 3 samples hold {tables}; each forks from the first and shares its blocks")
    # a distinct value in each block's K/V, to see where copies land
    for block_id in range(16):
        llm.kv_cache[:, :, block_id] = block_id + 1
    step_without_model(llm)
    bm = llm.block_manager
    full, last = tables[0]
    assert [s.block_table[0] for s in request.seqs] == [full] * 3, "the full block stays shared"
    lasts = [s.block_table[1] for s in request.seqs]
    assert sorted(lasts).count(last) == 1 and len(set(lasts)) == 3, (
        f"step 2: the samples' last blocks are {lasts}: two writers copy block {last}, the "
        "last writes it in place")
    assert bm.counts["num_cow_copies"] == 2
    for block_id in lasts:
        assert torch.all(llm.kv_cache[:, :, block_id] == last + 1), (
            f"step 2: block {block_id}, a copy of block {last}, does not hold its K/V")
    while llm.scheduler.has_unfinished():
        step_without_model(llm)
    assert_no_block_held(llm)

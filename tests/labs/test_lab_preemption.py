"""
Lab preemption: the victim, recompute and swap (Scheduler.schedule's victim and Scheduler.preempt,
BlockManager._move in nanopaged.py).

What the student writes: which request gives its blocks back when a running sequence is short of
one (the last running in rank, until the sequence can append), and how: recomputed (its blocks
freed, back in front of the waiting line) or swapped (every distinct block copied to the host
pool, its table repointed, and back again later).
What the tests pin, on an engine stepped without a model (tests/conftest.py step_without_model),
three 4-token prompts in a 3-block pool, so that the first decode step must preempt: the victim,
the victim's state after either mode, the K/V a swap carries out to the host and back, and every
request finishing with all blocks free. On BlockManager alone: blocks two sequences share are
swapped once, and stay shared on the host and back on the device.

    python tests/labs/labs.py grade preemption
"""
import torch

from conftest import SEQ_IDS, assert_no_block_held, computed, step_without_model
from labs.labs import plural
from nanopaged import LLM, BlockManager, RequestStatus, SamplingParams, Sequence

PROMPTS = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]]   # a block each; a decode needs one more


def engine(mode, num_cpu_blocks=0):
    """A 3-block pool with the three prompts admitted and computed (step 1): full."""
    llm = LLM("random:tiny", block_size=4, num_blocks=3, num_cpu_blocks=num_cpu_blocks,
              preemption_mode=mode, enable_prefix_caching=False, watermark_blocks=0,
              async_copies=False)
    llm.add_requests(PROMPTS, SamplingParams(max_tokens=3))
    step_without_model(llm)
    running = [r.request_id for r in llm.scheduler.running]
    assert running == [0, 1, 2] and llm.block_manager.num_free_blocks == 0
    return llm


def preempted(llm):
    """The seq ids of each "preempt" event so far, and its mode."""
    return [(e.seq_ids, e.details["mode"]) for e in llm.events.records if e.kind == "preempt"]


def finish(llm):
    while llm.scheduler.has_unfinished():
        step_without_model(llm)
    assert_no_block_held(llm)


def test_the_victim_is_the_last_running_request_in_rank():
    """Step 2: request 0's decode needs a block: request 2, the last in rank, is preempted first."""
    llm = engine("recompute")
    step_without_model(llm)
    events = preempted(llm)
    assert events, ("step 2: nobody was preempted, yet the pool is full and every decode "
                    "needs a block")
    victim = events[0][0]
    assert victim == (2,), (f"step 2: seq {victim} was preempted first; the victim must be the "
                            "last running request in rank, seq 2")
    assert llm.scheduler.running[0].request_id == 0, "step 2: request 0, first in rank, runs on"
    finish(llm)


def test_a_recomputed_request_frees_its_blocks_and_waits_in_front():
    """Recompute: the victim holds no block, has nothing computed, and waits before newer
    requests."""
    llm = engine("recompute")
    llm.add_requests([[13, 14, 15]], SamplingParams(max_tokens=3))   # arrives after the three
    step_without_model(llm)
    assert preempted(llm)[0] == ((2,), "recompute"), f"step 2: preemptions {preempted(llm)}"
    victim = llm.requests[2]
    seq = victim.seqs[0]
    assert victim.status is RequestStatus.WAITING, f"request 2 is {victim.status}, not WAITING"
    assert seq.block_table == [] and seq.num_computed_tokens == 0, (
        f"seq 2 holds blocks {seq.block_table}, {plural(seq.num_computed_tokens, 'token')} "
        "computed: a recomputed request gives every block back and computes its tokens again")
    # request 1, short of a block next, was the last in rank then: it gave its own back
    line = [r.request_id for r in llm.scheduler.waiting]
    assert line == [1, 2, 3], (f"waiting line {line}, want [1, 2, 3]: preempted requests go "
                               "back in rank order, before newer ones")
    finish(llm)


def test_a_swap_carries_the_kv_to_the_host_and_back():
    """Swap: the victim's table points into the host pool, at copies of its K/V; swapped back in,
    its new device blocks hold the same K/V, and its tokens are not computed again."""
    llm = engine("swap", num_cpu_blocks=4)
    bm = llm.block_manager
    # a distinct value in each device block's K/V, to follow it
    for block_id in range(3):
        llm.kv_cache[:, :, block_id] = block_id + 1
    seq = llm.requests[2].seqs[0]
    values = [block_id + 1 for block_id in seq.block_table]
    computed = seq.num_computed_tokens
    step_without_model(llm)
    assert preempted(llm)[0] == ((2,), "swap"), f"step 2: preemptions {preempted(llm)}"
    assert llm.requests[2].status is RequestStatus.SWAPPED and seq.seq_id in bm.host.seqs, (
        "step 2: request 2 was swapped out: SWAPPED, its table in the host pool")
    host = llm.kv_caches["host"]
    for i, (block_id, value) in enumerate(zip(seq.block_table, values)):
        assert torch.all(host[:, :, block_id] == value), (
            f"step 2: seq 2 block {i}: host block {block_id} does not hold the K/V of its "
            "device block: a swap copies every block out")
    assert seq.num_computed_tokens == computed, "a swapped request keeps its computed tokens"
    for step in range(3, 20):
        step_without_model(llm)
        if seq.seq_id in bm.device.seqs:
            break
    assert seq.seq_id in bm.device.seqs, "request 2 never came back from the host pool"
    for i, value in enumerate(values):
        block_id = seq.block_table[i]
        assert torch.all(llm.kv_cache[:, :, block_id] == value), (
            f"step {step}: seq 2 block {i}: device block {block_id} does not hold the K/V it "
            "had before the swap: a swap-in copies every block back")
    swapped = (bm.counts["num_swapped_out_blocks"], bm.counts["num_swapped_in_blocks"])
    assert swapped[0] == swapped[1] > 0, f"blocks swapped out, in: {swapped}: all must come back"
    finish(llm)
    assert not bm.host.seqs and bm.host.num_free_blocks == 4, "the host pool is free again"


def test_with_no_room_on_the_host_a_swap_recomputes():
    """A 1-block host pool: step 2 swaps request 2 out into it, then request 1, short of a block
    too, finds no room there and is recomputed."""
    llm = engine("swap", num_cpu_blocks=1)
    step_without_model(llm)
    want = [((2,), "swap"), ((1,), "recompute")]
    assert preempted(llm) == want, (f"step 2: preemptions {preempted(llm)}, want {want}: the "
                                    "last in rank first; swapped while the host pool has room")
    finish(llm)


def sharing(bm, tokens, num_shared):
    """Two computed sequences, b holding a's first num_shared blocks as a fork leaves them (each
    held once more), set up by hand: this lab's tests lean on no other lab's code."""
    a = Sequence(next(SEQ_IDS), tokens)
    bm.allocate(a)
    a.num_computed_tokens = len(a)
    b = Sequence(next(SEQ_IDS), tokens)
    shared = a.block_table[:num_shared]
    for block_id in shared:
        bm._hold(bm.device, bm.device.blocks[block_id])
    bm._set_table(b, shared)
    b.num_computed_tokens = len(b)
    bm.check_invariants()
    return a, b


def assert_shared(bm, pool, a, b, num_shared):
    """a and b hold the same first num_shared blocks of pool, each with ref_count 2, and their
    own blocks after."""
    where = (f"in the {pool.name} pool, seq {a.seq_id} holds {a.block_table}, seq {b.seq_id} "
             f"{b.block_table}")
    assert a.block_table[:num_shared] == b.block_table[:num_shared], (
        f"{where}: their first {plural(num_shared, 'block')} were shared and must stay shared "
        "(a swap copies each distinct block once)")
    for block_id in a.block_table[:num_shared]:
        r = pool.blocks[block_id].ref_count
        assert r == 2, f"{where}: shared block {block_id} has ref_count {r}, want 2"
    assert not set(a.block_table[num_shared:]) & set(b.block_table[num_shared:]), (
        f"{where}: only their first {plural(num_shared, 'block')} are shared")


def test_a_swap_moves_a_shared_block_once_and_it_stays_shared():
    """Seqs a and b share 2 of their 3 blocks: swapped out together they take 4 host blocks, the
    2 shared ones held by both (ref_count 2); swapped back in, the same on the device."""
    bm = BlockManager(8, 4, num_cpu_blocks=8)
    a, b = sharing(bm, list(range(1, 11)), 2)
    assert_shared(bm, bm.device, a, b, 2)
    moved = bm.swap_out(a, b)
    bm.check_invariants()
    assert len(moved) == 4 and bm.host.num_free_blocks == 4, (
        f"swap_out(a, b) moved {plural(len(moved), 'block')} {moved}, "
        f"{plural(8 - bm.host.num_free_blocks, 'host block')} taken: want 4, one per distinct "
        "block (the 2 shared, a's last, b's last)")
    assert_shared(bm, bm.host, a, b, 2)
    moved = bm.swap_in(a, b)
    bm.check_invariants()
    assert len(moved) == 4 and bm.num_free_blocks == 4, (
        f"swap_in(a, b) moved {plural(len(moved), 'block')} {moved}, "
        f"{plural(8 - bm.num_free_blocks, 'device block')} taken: want 4, one per distinct block")
    assert_shared(bm, bm.device, a, b, 2)
    for seq in (a, b):
        bm.free(seq)
    bm.check_invariants()
    assert bm.num_free_blocks == 8 and bm.host.num_free_blocks == 8, "every block free again"


def test_the_preempt_event_says_the_mode_and_why_as_the_trace_prints_it():
    """A 1-block host pool: step 2 swaps request 2 out (preemption_mode "swap": no reason to
    give), then recomputes request 1, for which the host has no room: its event gives the reason in
    brackets, as the trace prints it. Two preemptions counted."""
    llm = engine("swap", num_cpu_blocks=1)
    step_without_model(llm)
    words = [e.words() for e in llm.events.records if e.kind == "preempt"]
    want = ["seq 2 preempted by swap: blocks 2 taken back",
            "seq 1 preempted by recompute: blocks 1 taken back (no room for its blocks in the "
            "host pool)"]
    assert words == want, (f"step 2: the preempt events read {words}, want {want}: the "
                           "event gets the mode, and the reason _choose_mode gives (if any) "
                           "as ' (reason)'")
    assert llm.scheduler.num_preemptions == 2, (
        f"num_preemptions is {llm.scheduler.num_preemptions}, want 2: preempt counts each")
    finish(llm)


def test_a_swap_registers_the_copies_of_registered_blocks():
    """A sequence of 2 full, registered blocks and a partly filled one, swapped out: the host
    copies of the full blocks are registered (their tokens, their prefix), the partial one's
    not; swapped back in, its device blocks are registered again, and the host keeps its copies
    cached: a later eviction of those blocks from the device needs no write-down."""
    bm = BlockManager(8, 4, num_cpu_blocks=8)
    a = computed(bm, list(range(1, 11)))
    full = [bm.device.blocks[i].token_ids for i in a.block_table[:2]]
    bm.swap_out(a)
    bm.check_invariants()
    registered = [bm.host.blocks[i].token_ids for i in a.block_table
                  if bm.host.blocks[i].hash is not None]
    assert registered == full, (
        f"swapped out, seq {a.seq_id}'s host blocks {a.block_table} register {registered}, want "
        f"{full}: the copy of a registered block is registered in the tier it goes to "
        "(_register with like=), so the prefix cache finds it there too")
    bm.swap_in(a)
    bm.check_invariants()
    # blocks 0-2 out, tail first, to host blocks 0-2; back in, tail first, to blocks 3-5
    said = [e.words() for e in bm.events.records[-2:]]
    want = [f"seq {a.seq_id} swapped out: blocks 2, 1, 0 to host blocks 0-2",
            f"seq {a.seq_id} swapped in: host blocks 0-2 to blocks 3-5"]
    assert said == want, f"the trace's swap events say {said}, want {want}"
    registered = [bm.device.blocks[i].token_ids for i in a.block_table
                  if bm.device.blocks[i].hash is not None]
    assert registered == full, (f"swapped back in, seq {a.seq_id}'s device blocks register "
                                f"{registered}, want {full}")
    cached = sorted(bm.host.blocks[i].token_ids for i in bm.host.cached_block_ids)
    assert cached == full, (f"after the swap-in the host caches {cached}, want {full}: the "
                            "host copies of registered blocks stay in the prefix cache")
    bm.free(a)
    bm.check_invariants()

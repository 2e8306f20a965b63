"""Eviction policies (lru, fifo, lfu, leaf; opt in the replay) and pinning: each policy's victims
on a hand-worked example, opt never beaten in the replay of seeded workloads, unlimited room
equal to the repeats a trace holds as prefixes, the same greedy tokens under every policy, a
pinned system prompt that survives a flood."""
import itertools
import random

import pytest

import bench
import nanopaged
from conftest import SEQ_IDS, assert_no_block_held, checked
from nanopaged import LLM, EVICTION_POLICIES, SamplingParams, Sequence, replay

ONLINE = list(EVICTION_POLICIES)


def run(bm, requests):
    """Requests (lists of ids) through bm as replay() runs them, block_size 1: each allocated, its
    blocks computed and cached, freed. Returns ([its hit blocks, per request], [the ids evicted,
    per request, in order, with the policy's words])."""
    hits, evicted = [], []
    for ids in requests:
        held = {b.block_id: b.token_ids[0] for b in bm.device.blocks if b.hash is not None}
        seq = Sequence(next(SEQ_IDS), ids + [0])
        bm.allocate(seq)
        seq.num_computed_tokens = len(ids)   # the last token's block is not cached
        bm.cache_full_blocks(seq)
        bm.free(seq)
        bm.check_invariants()
        hits.append(seq.num_cached_tokens)
        evicted.append([(held[b], e.details["why"]) for e in bm.take_events() if e.kind == "evict"
                        for b in e.block_ids])
    assert bm.num_free_blocks == bm.num_blocks   # nothing held: all free or cached
    return hits, evicted


def test_lfu_keeps_the_block_hit_most_where_lru_drops_it():
    """4 blocks of 1 token. [1] twice (1: one hit), then [2], [3]: cached 1, 2, 3, one empty.
    [4] needs two blocks (its own, its last token's): one is evicted. LRU takes 1, freed
    longest ago; LFU takes 2, the oldest of those with 0 hits. Then [1] hits under LFU alone (its
    last token's block the one empty); under LRU it misses and evicts 2 for its own block."""
    requests = [[1], [1], [2], [3], [4], [1]]
    lru = run(nanopaged.BlockManager(4, 1), requests)
    lfu = run(nanopaged.LFUEviction(4, 1), requests)
    assert lru == ([0, 1, 0, 0, 0, 0],
                   [[], [], [], [], [(1, "lru: freed longest ago")], [(2, "lru: freed longest ago")]])
    assert lfu == ([0, 1, 0, 0, 0, 1],
                   [[], [], [], [], [(2, "lfu: 0 hits, the oldest of the blocks with 0")], []])


def test_lfu_counts_hits_across_holds_and_frees():
    """A block hit 3 times, held and freed each time, counts 3: in five blocks, after [5], [6]
    and [7] fill the cache, [8] and [9] evict 5 and 6 (0 hits), not 1. In three blocks, where it
    is the only one cached, [5, 6] (3 blocks) evicts it, saying 3 hits."""
    bm = nanopaged.LFUEviction(5, 1)
    run(bm, [[1], [1], [1], [1]])
    [block] = [b for b in bm.device.blocks if b.token_ids == (1,)]
    assert block.hits == 3
    _, evicted = run(bm, [[5], [6], [7], [8], [9]])
    assert [ids for ids, _ in itertools.chain(*evicted)] == [5, 6]
    bm = nanopaged.LFUEviction(3, 1)
    run(bm, [[1], [1], [1], [1]])
    assert run(bm, [[5, 6]])[1] == [[(1, "lfu: 3 hits, the oldest of the blocks with 3")]]


def test_fifo_keeps_the_place_of_the_first_free_whatever_hits_it_after():
    """[1], [2], then [1] hits (LRU moves 1 behind 2; FIFO does not), [3]: cached 1, 2, 3. [4]
    evicts one: LRU 2, FIFO 1. A request frees its tail first: [5, 6]'s 6 goes before its 5."""
    requests = [[1], [2], [1], [3], [4]]
    assert run(nanopaged.BlockManager(4, 1), requests)[1][-1] == [(2, "lru: freed longest ago")]
    fifo = nanopaged.FIFOEviction(4, 1)
    assert run(fifo, requests)[1][-1] == [(1, "fifo: the first cached of the blocks cached now")]
    # cached now: 2, 3, 4 in that order (1 evicted), one block empty; [5, 6] takes 3 blocks, 2 and
    # 3 evicted; freed, 6 then 5 are cached (the tail first); then [7, 8] evicts 4 and 6, not 5
    _, evicted = run(fifo, [[5, 6], [7, 8]])
    assert [i for i, _ in evicted[0]] == [2, 3] and [i for i, _ in evicted[1]] == [4, 6]


def free_head_first(bm, seq):
    """Release seq's blocks head first (not as free does): a prefix cached before its tail."""
    for block_id in seq.block_table:
        bm._release(bm.device, bm.device.blocks[block_id])
    bm.device.seqs.pop(seq.seq_id)
    seq.block_table = []


@pytest.mark.parametrize("policy", ["lru", "leaf"])
def test_leaf_evicts_no_prefix_while_a_leaf_is_cached(policy):
    """[1, 2] freed head first: 1 cached before 2, which continues it; then [3] (cached last).
    A new [4] of 2 blocks in a 4-block pool evicts one: LRU takes 1 and orphans 2; leaf takes 2,
    the oldest leaf, and nothing is orphaned."""
    bm = EVICTION_POLICIES[policy](4, 1)
    seq = Sequence(next(SEQ_IDS), [1, 2, 0])
    bm.allocate(seq)
    seq.num_computed_tokens = 2
    bm.cache_full_blocks(seq)
    free_head_first(bm, seq)
    run(bm, [[3]])
    _, evicted = run(bm, [[4]])
    if policy == "lru":
        assert evicted == [[(1, "lru: freed longest ago")]] and len(bm.orphans) == 1
    else:
        assert evicted == [[(2, "leaf: freed longest ago of the blocks nothing continues")]]
        assert not bm.orphans


def test_opt_evicts_the_block_used_farthest_ahead():
    """3 blocks: [1], [2] cached, then [3] evicts one: 1 is used next by request 4, 2 by request 3:
    opt drops 1, the farther (LRU too, by chance); then [2] hits, and [1] misses. Swapped uses:
    [1], [2], [3], [1], [2]: opt drops 2 and hits [1], where LRU drops 1 and then misses both."""
    opt = replay([[1], [2], [3], [2], [1]], "opt", 3, 1)
    assert opt[0] == 1
    assert replay([[1], [2], [3], [1], [2]], "opt", 3, 1)[0] == 1
    assert replay([[1], [2], [3], [1], [2]], "lru", 3, 1)[0] == 0
    bm = nanopaged.OptimalEviction(3, 1, [[1], [2], [3], [1], [2]])
    evicted = []
    for i, ids in enumerate([[1], [2], [3]]):
        bm.now = i
        evicted += run(bm, [ids])[1][0]
    assert evicted == [(2, "opt: used next by request 4, the farthest ahead")]


def random_trace(seed):
    """Prompts that share prefixes: each extends an earlier one (cut at random) or starts anew."""
    rng = random.Random(seed)
    new_ids = itertools.count()
    requests = []
    for _ in range(rng.randint(20, 60)):
        if requests and rng.random() < 0.7:
            base = rng.choice(requests)
            ids = base[:rng.randint(1, len(base))]
        else:
            ids = []
        requests.append(ids + [next(new_ids) for _ in range(rng.randint(0 if ids else 1, 4))])
    return requests


def repeats(requests):
    """Counted from the trace alone: each request's longest prefix that an earlier one held."""
    seen = set()
    total = 0
    for ids in requests:
        prefixes = [tuple(ids[:k]) for k in range(1, len(ids) + 1)]
        total += sum(1 for _ in itertools.takewhile(seen.__contains__, prefixes))
        seen.update(prefixes)
    return total


@pytest.mark.parametrize("seed", range(6))
def test_opt_finds_at_least_as_many_hits_as_every_policy(seed):
    requests = random_trace(seed) if seed else bench.workload()
    longest = max(map(len, requests))
    distinct = len(set(itertools.chain(*requests)))
    for num_blocks in sorted({longest + 1, longest + 3, distinct // 4 + longest, distinct + 1}):
        opt = replay(requests, "opt", num_blocks, 4)
        for policy in ONLINE:
            hits = replay(requests, policy, num_blocks, 4)[0]
            assert hits <= opt[0], f"{policy} hits {hits} > opt's {opt[0]} at {num_blocks} blocks"
        assert opt[0] <= repeats(requests)


@pytest.mark.parametrize("seed", range(4))
def test_unlimited_room_finds_every_repeat_reachable_as_a_prefix(seed):
    requests = random_trace(seed) if seed else bench.workload()
    distinct = len(set(itertools.chain(*requests)))
    # LRU with room for every block never evicts: bench's unlimited row
    assert replay(requests, "lru", distinct + 1, 2) == (repeats(requests), sum(map(len, requests)),
                                                         0, 0)
    for policy in [*ONLINE, "opt"]:
        assert replay(requests, policy, distinct + 1, 2)[0] == repeats(requests)


def test_replay_counts_orphans_as_the_engine_cannot_find_them():
    """FIFO on the built-in workload orphans blocks (a prefix out first); LRU, LFU and leaf never
    do here (a request frees its tail first, and a prefix is hit whenever its continuation is).
    An orphan is never found again: its prefix, computed anew, is a new prefix."""
    requests = bench.workload()
    orphans = {p: replay(requests, p, 106, 16)[2] for p in ONLINE}
    assert orphans["fifo"] > 1 and orphans["lru"] == orphans["lfu"] == orphans["leaf"] == 0


def test_replay_refuses_a_request_larger_than_the_pool():
    with pytest.raises(ValueError, match="a request of 4 blocks needs 5"):
        replay([[1], [1, 2, 3, 4]], "lru", 4, 16)


def flood(llm, n, seed):
    """n prompts of 12 random tokens each (seeded), greedy, 2 tokens out, one at a time."""
    rng = random.Random(seed)
    for _ in range(n):
        llm.generate([rng.choices(range(1, 200), k=12)], SamplingParams(temperature=0, max_tokens=2))


@pytest.mark.parametrize("policy", ONLINE)
def test_a_policy_changes_what_is_cached_never_what_is_generated(policy):
    rng = random.Random(1)
    system = [rng.randrange(1, 256) for _ in range(16)]
    prompts = [system[:rng.randint(4, 16)] + [rng.randrange(1, 256) for _ in range(rng.randint(1, 9))]
               for _ in range(24)]
    params = SamplingParams(temperature=0, max_tokens=5)
    want = [o.outputs[0].token_ids for o in LLM("random:tiny", block_size=4, num_blocks=200)
            .generate(prompts, params)]
    llm = checked(LLM("random:tiny", block_size=4, num_blocks=16, eviction_policy=policy))
    got = []
    for i in range(0, 24, 3):   # in small groups, so that the cache matters between them
        got += [o.outputs[0].token_ids for o in llm.generate(prompts[i:i + 3], params)]
    assert got == want
    assert llm.block_manager.counts["num_evictions"] > 0
    assert_no_block_held(llm)


def test_the_eviction_event_says_the_policy_and_why(capsys):
    nanopaged.main(["--demo", "evict", "--trace", "--model", "random:tiny",
                    "--eviction-policy", "lfu"])
    out = " ".join(capsys.readouterr().out.split())   # lines wrapped at 80 columns, joined
    assert "is evicted from the prefix cache (lfu: 0 hits, the oldest of the blocks with 0)" in out
    with pytest.raises(SystemExit) as e:
        nanopaged.main(["--eviction-policy", "mru"])
    assert e.value.code == 2
    with pytest.raises(ValueError, match="eviction_policy must be 'lru', 'fifo', 'lfu' or 'leaf'"):
        LLM("random:tiny", eviction_policy="opt")


def test_a_pinned_system_prompt_is_hit_after_a_flood_that_evicts_everything_else():
    system = list(range(200, 213))   # 3 full blocks of 4, and a token
    llm = checked(LLM("random:tiny", block_size=4, num_blocks=24))
    llm.pin(system)
    bm = llm.block_manager
    assert llm.num_pinned_blocks() == 3 and bm.num_free_blocks == 21
    pinned = list(llm.pins[tuple(system)].block_table)
    flood(llm, 12, 1)
    assert bm.counts["num_evictions"] > 12   # the flood evicted its own blocks over and over
    cached = [b.block_id for b in bm.device.blocks if b.hash is not None]
    out = llm.generate([system + [7, 8]], SamplingParams(temperature=0, max_tokens=2))[0]
    assert out.num_cached_tokens == 12 and set(pinned) <= set(cached)
    # unpinned, the next flood evicts it
    llm.unpin(system)
    assert bm.num_free_blocks == bm.num_blocks
    flood(llm, 12, 2)
    out = llm.generate([system + [7, 8]], SamplingParams(temperature=0, max_tokens=2))[0]
    assert out.num_cached_tokens == 0
    assert_no_block_held(llm)


def test_pinning_more_than_the_pool_can_spare_changes_nothing():
    llm = LLM("random:tiny", block_size=4, num_blocks=12)
    llm.pin(list(range(1, 21)))   # 5 blocks
    before = (llm.num_pinned_blocks(), llm.block_manager.num_free_blocks,
              dict(llm.block_manager.counts))
    with pytest.raises(ValueError, match="more than the device pool can spare"):
        llm.pin(list(range(100, 125)))   # 6 more: 11 of 12, too few left for a request
    with pytest.raises(ValueError, match="pinned already"):
        llm.pin(list(range(1, 21)))
    with pytest.raises(ValueError, match="not pinned"):
        llm.unpin([1, 2, 3])
    # a request may no longer need more than what the pins leave
    with pytest.raises(ValueError, match=r"the pool has 7 \(pinned: 5\)"):
        llm.generate([list(range(150, 180))], SamplingParams(max_tokens=1))
    assert before == (llm.num_pinned_blocks(), llm.block_manager.num_free_blocks,
                      dict(llm.block_manager.counts))
    llm.unpin(list(range(1, 21)))
    assert_no_block_held(llm)


def test_the_view_marks_pinned_blocks():
    llm = LLM("random:tiny", block_size=4, num_blocks=24)
    llm.pin(list(range(200, 209)))
    view = nanopaged.View(llm, live=False)
    text = "\n".join(line.plain for line in view.pools(100, None))
    blocks = llm.pins[tuple(range(200, 209))].block_table
    assert f"underlined: pinned (blocks {', '.join(map(str, blocks))})" in text
    lines = view.pools(100, None)
    styles = [span.style for span in lines[0].spans if "underline" in str(span.style)]
    assert len(styles) == 2


def test_pins_come_back_after_an_undone_step():
    """A step that raises is undone: the pools rebuilt, the pins held again."""
    llm = checked(LLM("random:tiny", block_size=4, num_blocks=24))
    system = list(range(200, 209))
    llm.pin(system)
    [request_id] = llm.add_requests([list(range(100, 120))], SamplingParams(max_tokens=3))
    forward = llm.model.forward

    def broken(*args):   # after the step has allocated: undone
        llm.model.forward = forward
        raise RuntimeError("injected")

    llm.model.forward = broken
    with pytest.raises(RuntimeError):
        llm.step()
    assert llm.num_pinned_blocks() == 2 and llm.block_manager.num_free_blocks == 22
    llm.block_manager.check_invariants()
    while llm.scheduler.has_unfinished():
        llm.step()
    llm.output(request_id)
    llm.unpin(system)
    assert_no_block_held(llm)

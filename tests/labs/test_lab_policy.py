"""
Lab policy: eviction policies (LFUEviction.rank and LeafEviction.victim in nanopaged.py), then one
of the student's own (MyEviction).

What the student writes: LFU's rank, by which the block found least often goes first, ties by LRU;
the leaf policy's victim, LRU among the cached blocks that nothing continues, so that no prefix goes
before its continuation; then a policy of their own, to beat LRU on bench.py's workload.
What the tests pin, on the block manager alone (no model): the blocks each request of a small trace
evicts, and the hits, against the ones worked out by hand in each test; that the leaf policy
orphans nothing; the own policy's hit rate on bench.py's workload against lru's.

    python tests/labs/labs.py grade policy
    python bench.py --only policies         the policies' hit rates on the built-in workload
"""
from argparse import Namespace
from unittest import mock

import pytest

import bench
import nanopaged
from conftest import SEQ_IDS
from nanopaged import BlockManager, LFUEviction, LeafEviction, Sequence

BLOCK_SIZE = 4


def tokens(ids):
    """A replayed request's prompt, as nanopaged.replay makes it: each block id block_size times,
    then one token more (the last, always computed: its block goes back empty when freed)."""
    return [x for x in ids for _ in range(BLOCK_SIZE)] + [0]


def cached_ids(bm):
    """The cached device blocks, oldest first, each named by its id in the trace (its token)."""
    return [bm.device.blocks[b].token_ids[0] for b in bm.device.cached_block_ids]


def cached_prefix(bm, ids):
    """The device blocks that hold the prefix of a request of the trace (ids: its blocks' ids),
    found the simple way: for each id in turn, a registered block of its tokens after the block
    found before; the first id missed ends the prefix."""
    found = []
    for x in ids:
        parent = bm.device.blocks[found[-1]].prefix_id if found else None
        same = [b.block_id for b in bm.device.blocks
                if b.hash is not None and b.token_ids == (x,) * BLOCK_SIZE
                and b.parent_prefix_id == parent]
        if not same:
            break
        found.append(same[0])
    return found


def admit(bm, ids):
    """Admit a request of the trace (ids: its blocks' ids), as replay does: its prefix found, the
    rest of its blocks taken (evicting), all computed and its full blocks registered. Returns (its
    sequence, how many blocks it found, the blocks it evicted: named by their ids in the trace, in
    the order evicted)."""
    # an evicted block is emptied: its name is read before
    names = {b.block_id: b.token_ids[0] for b in bm.device.blocks if b.hash is not None}
    seq = Sequence(next(SEQ_IDS), tokens(ids))
    # The prefix hit set up by hand, held and counted as allocate does: this lab's tests lean on
    # no other lab's code (in the prefix-cache lab's handout allocate finds nothing)
    found = cached_prefix(bm, ids)
    for block_id in found:
        bm._hold(bm.device, bm.device.blocks[block_id])
        bm.device.blocks[block_id].hits += 1
    bm._set_table(seq, found)
    seq.num_computed_tokens = len(seq)
    bm.cache_full_blocks(seq)
    bm.check_invariants()
    evicted = [names[e.block_ids[0]] for e in bm.take_events() if e.kind == "evict"]
    return seq, len(found), evicted


def replay_each(bm, trace):
    """Each request of trace admitted and freed, one at a time, as replay does: [(how many blocks
    it found, the blocks it evicted)], a request each."""
    found = []
    for ids in trace:
        seq, hits, evicted = admit(bm, ids)
        bm.free(seq)
        bm.check_invariants()
        found.append((hits, evicted))
    return found


def assert_nothing_held(bm):
    """Every block free: empty or cached; no sequence holds one."""
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks, (f"{bm.num_blocks - bm.num_free_blocks} blocks "
                                                 "still held: leaked")
    assert not bm.device.seqs


# The LFU trace, in block ids: X = 1, Y = 2, Z = 3, W = 4, the fillers F1-F4 = 11-14, a 3-block
# prompt P Q R = 21-23. X is found twice, Y once, then come fillers, never found again, and X.
# By hand, in 5 blocks. A request of k blocks takes k + 1 (its last token's, empty again once
# freed); the first 7 requests fill 4 blocks, cached, and leave 1 empty. Cached, oldest first
# (hits), and the blocks each request evicts:
#   request        cached after it (LFU)          LFU evicts    LRU evicts
#    0-2  [1]      1(2)                                          (1 found at 1 and 2)
#    3-4  [2]      1(2) 2(1)                                     (2 found at 4)
#    5-6  [3] [4]  1(2) 2(1) 3(0) 4(0)
#    7    [11]     1(2) 2(1) 4(0) 11(0)          3              1
#    8    [12]     1(2) 2(1) 11(0) 12(0)         4              2
#    9    [13]     1(2) 2(1) 12(0) 13(0)         11             3
#   10    [14]     1(2) 2(1) 13(0) 14(0)         12             4
#   11    [21-23]  1(2) 23(0) 22(0) 21(0)        13, 14, 2      11, 12, 13
#   12    [1]      1 found (3 hits)              -              14 (1 is gone since 7)
# A rank that never grows (0 for all, or the tick a block was cached at) leaves LRU's order: the
# last column. LFU finds 4 of the 15 prompt blocks, LRU 3.
LFU_TRACE = [[1], [1], [1], [2], [2], [3], [4], [11], [12], [13], [14], [21, 22, 23], [1]]
LFU_EVICTS = [[], [], [], [], [], [], [], [3], [4], [11], [12], [13, 14, 2], []]


def test_lfu_evicts_the_block_found_least_often_ties_by_lru():
    """On LFU_TRACE, in 5 blocks, LFU evicts the blocks never found, oldest first, then Y (found
    once) before X (found twice, freed longer ago): the order worked out by hand, not LRU's."""
    bm = LFUEviction(5, BLOCK_SIZE)
    evicted = [e for _, e in replay_each(bm, LFU_TRACE)]
    for i, (got, want) in enumerate(zip(evicted, LFU_EVICTS)):
        assert got == want, (f"request {i} {LFU_TRACE[i]} evicted {got}, want {want} (LFU: the "
                             f"fewest hits go first, ties by LRU); all: {evicted}")
    assert_nothing_held(bm)


def test_lfu_finds_again_the_block_found_most_often():
    """On LFU_TRACE, in 5 blocks, the last request finds X, kept for its 2 hits where LRU evicted
    it for the fillers: 4 of the 15 prompt blocks found, LRU's 3 and one."""
    bm = LFUEviction(5, BLOCK_SIZE)
    hits = [h for h, _ in replay_each(bm, LFU_TRACE)]
    want = [0, 1, 1, 0, 1, 0, 0, 0, 0, 0, 0, 0, 1]
    assert hits == want, (f"blocks found by each request: {hits}, want {want}; request 12 must find "
                          "block 1, found twice before (LRU's order loses it at request 7: does a "
                          "block's rank grow with its hits?)")
    assert_nothing_held(bm)


def release_head_first(bm, seq):
    """Let seq's blocks go head first, by hand (free lets them go tail first): the prefix is then
    cached before its continuation, the oldest, and LRU's victim."""
    for block_id in seq.block_table:
        bm._release(bm.device, bm.device.blocks[block_id])
    bm.device.seqs.pop(seq.seq_id)
    seq.block_table = []
    bm.check_invariants()


def test_leaf_evicts_the_oldest_leaf_and_orphans_nothing():
    """Prompt [1, 2, 3] released head first in 4 blocks: cached 1, 2, 3, oldest first. Where LRU
    evicts 1 and leaves 2 and 3 cached, never to be found again, the leaf policy evicts the oldest
    block nothing continues: 3, then 2; prompt [1, 2, 3] again finds block 1."""
    # By hand. 1 is continued by 2, 2 by 3: 3 alone is a leaf. Each 1-block request takes 2 blocks,
    # the empty one and a victim:
    #   request    leaf evicts   cached after    LRU evicts   LRU's orphans after
    #   [4]        3             1 2 4           1            2, 3
    #   [5]        2             1 4 5           2            3
    #   [1, 2, 3]  4, 5          (all 4 held)    3, 4, 5      -
    # At [5] the leaves are 2 (3 is gone) and 4; 1 is continued by 2. [1, 2, 3] finds block 1 (the
    # leaf policy kept it) and takes 3 blocks more: the empty one, 4, 5. Under LRU it finds none.
    bm = LeafEviction(4, BLOCK_SIZE)
    seq, _, _ = admit(bm, [1, 2, 3])
    release_head_first(bm, seq)
    assert cached_ids(bm) == [1, 2, 3]
    for ids, want in [([4], [3]), ([5], [2])]:
        before = cached_ids(bm)
        seq, _, evicted = admit(bm, ids)
        assert evicted == want, (f"request {ids} evicted {evicted} of cached {before} (oldest "
                                 f"first), want {want}: the oldest cached block that no "
                                 "registered block continues (a leaf)")
        assert not bm.orphans, (f"after request {ids}, blocks {sorted(bm.orphans)} are orphans: "
                                "cached, but their prefix is gone")
        bm.free(seq)
        bm.check_invariants()
    assert cached_ids(bm) == [1, 4, 5]
    seq, hits, evicted = admit(bm, [1, 2, 3])
    assert (hits, evicted) == (1, [4, 5]), (f"prompt [1, 2, 3] found {hits} blocks and evicted "
                                            f"{evicted}, want 1 and [4, 5]")
    assert not bm.orphans
    bm.free(seq)
    assert_nothing_held(bm)


def test_with_no_leaf_cached_the_leaf_policy_falls_back_to_lru():
    """Prompts [1] and [1, 2] computed at once (as in one batch: neither finds the other's block 1)
    hold twin copies of block 1. [1] freed, its copy is the only cached block, and no leaf:
    [1, 2]'s block 2, held, continues prefix 1. A new request evicts it all the same, as LRU."""
    bm = LeafEviction(5, BLOCK_SIZE)
    alone = Sequence(next(SEQ_IDS), tokens([1]))
    longer = Sequence(next(SEQ_IDS), tokens([1, 2]))
    # both allocated before either is registered: 2 + 3 blocks, all 5
    bm.allocate(alone)
    bm.allocate(longer)
    for seq in (alone, longer):
        seq.num_computed_tokens = len(seq)
        bm.cache_full_blocks(seq)
    bm.check_invariants()
    twin = alone.block_table[0]
    bm.free(alone)
    assert list(bm.device.cached_block_ids) == [twin]
    seq, _, evicted = admit(bm, [5])
    assert evicted == [1] and twin in seq.block_table, (
        f"request [5] evicted {evicted} and took blocks {seq.block_table}, want [1], block {twin}: "
        "with no leaf cached, the victim is LRU's")
    bm.free(seq)
    bm.free(longer)
    assert_nothing_held(bm)


def replayed(policy, requests, num_blocks, block_size):
    """nanopaged.replay's figures for a policy class, as bench.py measures them, and the block
    manager it replayed through (made inside replay: the factory keeps it, to be checked after)."""
    made = []

    def make(num_blocks, block_size):
        made.append(policy(num_blocks, block_size))
        return made[-1]

    with mock.patch.dict(nanopaged.EVICTION_POLICIES, {"tested": make}):
        figures = nanopaged.replay(requests, "tested", num_blocks, block_size)
    return figures, made[0]


def test_your_own_policy_beats_lru(capsys):
    """MyEviction, the student's own policy in nanopaged.py (a BlockManager below the banner),
    replayed through bench.py's built-in workload at bench.py's size: more hits than lru."""
    policy = getattr(nanopaged, "MyEviction", None)
    if policy is None:
        pytest.skip("the open part: write class MyEviction in nanopaged.py, section 8, below "
                    "LeafEviction: a BlockManager that overrides victim(pool), or a "
                    "RankedEviction with a rank(block) of yours; this test replays bench.py's "
                    "workload through it and passes when it finds more than lru")
    assert isinstance(policy, type) and issubclass(policy, BlockManager), (
        f"MyEviction is {policy!r}: not a class of block manager (a BlockManager subclass)")
    # bench.py's requests and size: --only policies with no --replay, --block-size, --num-blocks
    requests, block_size, num_blocks, *_ = bench.replayed(
        Namespace(replay=None, block_size=None, num_blocks=None))
    rates = {}
    for name in ("lru", "opt"):
        hits, blocks, _, _ = nanopaged.replay(requests, name, num_blocks, block_size)
        rates[name] = hits / blocks
    (hits, blocks, orphans, evictions), bm = replayed(policy, requests, num_blocks, block_size)
    rates["yours"] = hits / blocks
    # shown whether it passes or not: the figure to improve
    with capsys.disabled():
        print(f"\nMyEviction on bench.py's workload ({len(requests)} requests, {num_blocks} device "
              f"blocks): hit rate {rates['yours']:.3f} ({orphans:.2f} orphaned blocks, "
              f"{evictions} evictions); lru {rates['lru']:.3f}, opt {rates['opt']:.3f}")
    assert rates["yours"] > rates["lru"], (f"MyEviction hits {rates['yours']:.3f} of the prompt "
                                           f"blocks, lru {rates['lru']:.3f}, opt "
                                           f"{rates['opt']:.3f}: not above lru's")
    assert_nothing_held(bm)

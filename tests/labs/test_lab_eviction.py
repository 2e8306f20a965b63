"""
Lab eviction: free and LRU eviction (KVCacheManager.free and victim in nanopaged.py).

What the student writes: free's order, which releases a sequence's blocks tail first (a registered
block nobody holds stays cached, its K/V reusable, newest last), and victim's choice, the cached
block freed longest ago, taken only when no empty block is left.
What the tests pin, on BlockManager alone (no model): the cached blocks' order after each free and
which blocks each allocation evicts, against a plain list kept by the test (the simple LRU).

    python tests/labs/labs.py grade eviction
"""
import random

from conftest import SEQ_IDS, computed
from nanopaged import BlockManager, Sequence


def test_free_releases_the_tail_first():
    """Freed, a 3-block sequence's blocks are cached tail first: the tail will be evicted first."""
    bm = BlockManager(8, 4)
    seq = computed(bm, list(range(1, 13)))   # 3 full blocks, registered
    table = list(seq.block_table)
    bm.free(seq)
    bm.check_invariants()
    cached = list(bm.device.cached_block_ids)
    assert cached == table[::-1], (f"after free(seq {seq.seq_id}) with blocks {table}, the cached "
                                   f"order (oldest first) is {cached}, want {table[::-1]} (free "
                                   "must release tail first)")


def test_empty_blocks_go_before_cached_ones_then_the_oldest_cached():
    """With cached blocks [1, 0, 3, 2] (oldest first) and 2 empty, 5 new blocks evict 1, 0, 3."""
    bm = BlockManager(6, 4)
    a = computed(bm, list(range(100, 108)))   # blocks [0, 1]
    b = computed(bm, list(range(200, 208)))   # blocks [2, 3]
    bm.free(a)
    bm.free(b)
    bm.check_invariants()
    cached = list(bm.device.cached_block_ids)
    assert cached == [1, 0, 3, 2], (f"after free(a), free(b) the cached order (oldest first) is "
                                    f"{cached}, want [1, 0, 3, 2] (free must release tail first)")
    new = computed(bm, list(range(300, 320)))   # 5 blocks, nothing in common
    assert new.block_table[:2] == [4, 5], (f"seq {new.seq_id} got {new.block_table[:2]} first; "
                                           "the empty blocks 4, 5 go before any cached one")
    assert new.block_table[2:] == [1, 0, 3], (
        f"seq {new.seq_id} evicted {new.block_table[2:]} from cached blocks [1, 0, 3, 2] (oldest "
        "first); want [1, 0, 3] (victim must take the block cached longest ago)")
    assert bm.counts["num_evictions"] == 3
    assert list(bm.device.cached_block_ids) == [2], "block 2, cached last, must still be cached"
    bm.free(new)
    bm.check_invariants()


def test_evictions_follow_a_plain_lru_list():
    """Random prompts, some repeated, in a 12-block pool: after every free the cached order, and
    after every allocation the blocks evicted, are those of a list kept the simple way."""
    rng = random.Random(0)
    bm = BlockManager(12, 4)
    lru = []   # the cached blocks, least recently cached first: the simple model
    prompts = [list(range(1000 * p, 1000 * p + rng.randrange(4, 14))) for p in range(8)]
    held = []
    for step in range(80):
        if held and (bm.num_free_blocks < 4 or rng.random() < 0.4):
            seq = held.pop(rng.randrange(len(held)))
            # the blocks free caches: the registered ones seq held alone, tail first
            for block_id in reversed(seq.block_table):
                block = bm.device.blocks[block_id]
                if block.ref_count == 1 and block.hash is not None:
                    lru.append(block_id)
            bm.free(seq)
            bm.check_invariants()
            cached = list(bm.device.cached_block_ids)
            assert cached == lru, (f"step {step}: after free(seq {seq.seq_id}) the cached order "
                                   f"(oldest first) is {cached}, want {lru} (free must release "
                                   "tail first, each block cached as the newest)")
            continue
        seq = Sequence(next(SEQ_IDS), rng.choice(prompts))
        bm.allocate(seq)
        bm.check_invariants()
        # hits leave the list (held again); the rest that left it were evicted, oldest first
        hits = seq.block_table[:seq.num_cached_tokens // 4]
        lru = [b for b in lru if b not in hits]
        evicted = [b for b in lru if b not in bm.device.cached_block_ids]
        assert evicted == lru[:len(evicted)], (
            f"step {step}: allocating seq {seq.seq_id} evicted blocks {evicted} from cached "
            f"blocks {lru} (oldest first); want {lru[:len(evicted)]} (victim must take the "
            "block cached longest ago)")
        lru = lru[len(evicted):]
        seq.num_computed_tokens = len(seq)
        bm.cache_full_blocks(seq)
        held.append(seq)
    for seq in held:
        bm.free(seq)
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks
    assert bm.counts["num_evictions"] > 0, "the workload must evict: the pool is too big"


def test_an_evicted_block_goes_down_to_the_host_or_is_remembered_lost():
    """A 2-block device pool over a 1-block host pool, both blocks of a prompt cached: a new
    prompt evicts them both, tail first; the tail is written down to the host (a copy queued, the
    host block registered with its tokens); the host then full, the head is lost, and remembered
    as evicted (bm.evicted: why a later prompt misses it). Both are section 8's write_down_or_lose,
    which _evict calls for its victim."""
    bm = BlockManager(2, 4, num_cpu_blocks=1)
    head, tail = (1, 2, 3, 4), (5, 6, 7, 8)
    a = computed(bm, [*head, *tail])
    hashes = list(a.block_hashes)
    bm.free(a)
    computed(bm, list(range(20, 28)))
    on_host = [b.token_ids for b in bm.host.blocks if b.hash is not None]
    assert on_host == [tail], (f"the host holds {on_host}, want the tail {tail}: an evicted block "
                               "is written down to the tier below that has room "
                               "(write_down_or_lose)")
    assert [(c.src_tier.name, c.dst_tier.name) for c in bm.copies] == [("device", "host")], (
        f"copies queued: {list(bm.copies)}: the write-down copies the tail's K/V to the host")
    assert (hashes[0], head) in bm.evicted, (
        f"the head {head}, lost (the host is full), is not in bm.evicted: an eviction that loses "
        "a block remembers it (write_down_or_lose), so that a prompt can say why it missed")
    assert bm.counts["num_evictions"] == 1 and bm.counts["num_offloaded_blocks"] == 1


def test_a_request_coming_back_counts_each_block_it_alone_held_as_found_again():
    """free(seq, coming_back=True), a preempted request to be recomputed: each block whose last
    holder it is counts one hit more (Block.hits, by which the write-down rule keeps blocks); a
    block another sequence still holds does not (its last holder counts it)."""
    bm = BlockManager(8, 4)
    a = computed(bm, list(range(1, 13)))   # 3 full blocks, registered
    b = Sequence(next(SEQ_IDS), list(range(1, 9)) + [50])
    # b holds a's first 2 blocks, as a prefix hit leaves them (set up by hand: this lab's tests
    # lean on no other lab's code)
    for block_id in a.block_table[:2]:
        bm._hold(bm.device, bm.device.blocks[block_id])
    bm._set_table(b, a.block_table[:2])
    bm.check_invariants()
    table = list(a.block_table)
    hits = [bm.device.blocks[i].hits for i in table]
    bm.free(a, coming_back=True)
    bm.check_invariants()
    after = [bm.device.blocks[i].hits for i in table]
    want = [hits[0], hits[1], hits[2] + 1]
    assert after == want, (f"after free(seq {a.seq_id}, coming_back=True) its blocks' hits are "
                           f"{after}, want {want}: the block it alone held counts one more, the "
                           f"2 seq {b.seq_id} still holds do not")
    bm.free(b)
    bm.check_invariants()

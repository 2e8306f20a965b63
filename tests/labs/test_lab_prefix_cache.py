"""
Lab prefix-cache: the hash-chain lookup (KVCacheManager._cache_hits in nanopaged.py).

What the student writes: the walk that finds the blocks holding a prompt's prefix, one look-up per
block along the chain hash h[i] = H(h[i-1], tokens of block i), checked against the block's tokens
and its parent's prefix, stopping at the first miss, never at the block of the last token.
What the tests pin, on BlockManager alone (no model): which blocks a prompt shares and how many
of its tokens count as cached, against a brute-force search over every prefix computed so far;
collisions never hand out a wrong block; a block somebody holds is the one shared; blocks written
down to the host tier are found there and loaded, unless a swapped-out request holds them.

    python tests/labs/labs.py grade prefix-cache
"""
import random

from conftest import SEQ_IDS, computed
from labs.labs import plural
from nanopaged import BlockManager, CostModel, Sequence


def allocated(bm, tokens):
    seq = Sequence(next(SEQ_IDS), tokens)
    bm.allocate(seq)
    bm.check_invariants()
    return seq


def assert_shares(seq, other, num_blocks):
    """seq's first num_blocks blocks are other's, and no more of them."""
    got = seq.num_cached_tokens // 4
    assert got == num_blocks, (f"seq {seq.seq_id}: {plural(got, 'block')} found in the prefix "
                               f"cache, want {num_blocks} (seq {other.seq_id}'s first "
                               f"{plural(num_blocks, 'block')})")
    for i in range(num_blocks):
        assert seq.block_table[i] == other.block_table[i], (
            f"seq {seq.seq_id} block {i}: physical block {seq.block_table[i]}, but seq "
            f"{other.seq_id} computed this prefix in block {other.block_table[i]}")


def free_all(bm, *seqs):
    for seq in seqs:
        bm.free(seq)
        bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks, "blocks still held after every free"


def test_a_shared_prefix_is_found_block_by_block():
    """A prompt that starts with another's 8 tokens shares its 2 full blocks: ref_count 2."""
    bm = BlockManager(16, 4)
    a = computed(bm, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11])
    b = allocated(bm, [1, 2, 3, 4, 5, 6, 7, 8, 50, 51, 52])
    assert_shares(b, a, 2)
    for i in range(2):
        block = bm.device.blocks[b.block_table[i]]
        assert block.ref_count == 2, (f"block {block.block_id}: ref_count {block.ref_count}, "
                                      "but seqs a and b hold it: a hit is held once more")
    assert b.block_table[2] not in a.block_table, "block 2 differs: it is b's own"
    free_all(bm, a, b)


def test_the_block_of_the_last_token_never_hits():
    """A prompt computed whole, asked again: its last block is computed (its logits are needed)."""
    bm = BlockManager(16, 4)
    a = computed(bm, list(range(1, 13)))   # 3 full blocks, all registered
    b = allocated(bm, list(range(1, 13)))
    assert_shares(b, a, 2)
    assert b.num_computed_tokens == 8, (f"seq {b.seq_id}: num_computed_tokens "
                                        f"{b.num_computed_tokens}, want 8: the last token's block "
                                        "must be computed")
    free_all(bm, a, b)


def test_the_chain_stops_at_the_first_miss():
    """A block equal to a cached one, after a block that differs, is not a hit: a chain."""
    bm = BlockManager(16, 4)
    a = computed(bm, list(range(1, 17)) + [99])
    first_differs = allocated(bm, [0, 0, 0, 0] + list(range(5, 17)) + [99])
    assert_shares(first_differs, a, 0)
    second_differs = allocated(bm, [1, 2, 3, 4, 0, 0, 0, 0] + list(range(9, 17)) + [99])
    assert_shares(second_differs, a, 1)
    free_all(bm, a, first_differs, second_differs)


def test_colliding_hashes_hand_out_no_wrong_block(monkeypatch):
    """Every block hashes alike: tokens and the parent's prefix decide; no wrong block is found."""
    monkeypatch.setattr(BlockManager, "compute_hash", staticmethod(lambda parent, tokens: 42))
    bm = BlockManager(16, 4)
    x, y, z = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]
    a = computed(bm, x + y + [99])
    b = allocated(bm, z + y + [99])   # y after z is not y after x
    assert_shares(b, a, 0)
    c = allocated(bm, x + y + [99])
    assert_shares(c, a, 2)
    free_all(bm, a, b, c)


def test_after_a_miss_no_block_is_found_though_its_parent_prefix_matches(monkeypatch):
    """Every block hashes alike: x z y after x y finds x alone. y after x z is not y after x,
    though the last hit (x) is y's parent: the walk stops at the first miss, z."""
    monkeypatch.setattr(BlockManager, "compute_hash", staticmethod(lambda parent, tokens: 42))
    bm = BlockManager(16, 4)
    x, y, z = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]
    a = computed(bm, x + y + [99])
    b = Sequence(next(SEQ_IDS), x + z + y + [99])
    bm.allocate(b)
    got = b.num_cached_tokens // 4
    assert got == 1, (f"seq {b.seq_id}: {plural(got, 'block')} found, want 1 (x): the chain "
                      "stops at the first miss: block 1 missed, so block 2 cannot be this "
                      "prefix's")
    bm.check_invariants()
    assert_shares(b, a, 1)
    free_all(bm, a, b)


def test_a_held_block_is_shared_before_a_cached_copy():
    """Two blocks hold one prefix, one held, one cached: the held one is shared (no free block)."""
    bm = BlockManager(16, 4)
    # a and b allocated before either is computed: each computes the prefix in its own block
    a = allocated(bm, [1, 2, 3, 4, 5])
    b = allocated(bm, [1, 2, 3, 4, 6])
    for seq in (a, b):
        seq.num_computed_tokens = len(seq)
        bm.cache_full_blocks(seq)
    bm.check_invariants()
    bm.free(a)   # a's block 0 cached, b's held
    bm.check_invariants()
    c = allocated(bm, [1, 2, 3, 4, 7])
    assert_shares(c, b, 1)
    free_all(bm, b, c)


def test_hits_match_a_brute_force_search_over_computed_prefixes():
    """Random prompts over 2 tokens: each finds exactly the longest computed prefix of full
    blocks (not the last token's), and each block found holds those very tokens."""
    rng = random.Random(0)
    bm = BlockManager(400, 4)
    computed_prefixes = set()   # every full block's prefix computed so far, as a token tuple
    held = []
    for step in range(60):
        tokens = [rng.randrange(2) for _ in range(rng.randrange(1, 18))]
        # the simple way: the longest run of full blocks whose prefixes were computed
        want = 0
        while ((want + 1) * 4 <= len(tokens) - 1
               and tuple(tokens[:(want + 1) * 4]) in computed_prefixes):
            want += 1
        seq = allocated(bm, tokens)
        got = seq.num_cached_tokens // 4
        assert got == want, (f"step {step}: seq {seq.seq_id} {tokens}: {plural(got, 'block')} "
                             f"found, want {want} (the longest prefix of full blocks computed "
                             "before, the last token's block excluded)")
        for i in range(got):
            block = bm.device.blocks[seq.block_table[i]]
            assert block.token_ids == tuple(tokens[4 * i:4 * i + 4]), (
                f"step {step}: seq {seq.seq_id} block {i} ({block.block_id}) holds tokens "
                f"{block.token_ids}, the seq's are {tokens[4 * i:4 * i + 4]}")
        seq.num_computed_tokens = len(seq)
        bm.cache_full_blocks(seq)
        bm.check_invariants()
        for i in range(len(tokens) // 4):
            computed_prefixes.add(tuple(tokens[:(i + 1) * 4]))
        held.append(seq)
        if rng.random() < 0.5:
            bm.free(held.pop(rng.randrange(len(held))))
            bm.check_invariants()
    free_all(bm, *held)


def written_down_to_the_host(tokens):
    """A 3-block device pool over a 4-block host pool where tokens' full blocks were computed,
    then evicted by a prompt that took every device block: written down to the host, cached
    there (section 8's write_down_or_lose; no cost rule, so every tier is worth loading from)."""
    bm = BlockManager(3, 4, num_cpu_blocks=4)
    free_all(bm, computed(bm, tokens))
    free_all(bm, computed(bm, list(range(200, 209))))
    host = {b.token_ids: b for b in bm.host.blocks if b.hash is not None}
    for i in range(len(tokens) // 4):
        assert tuple(tokens[4 * i:4 * i + 4]) in host, f"setup: block {i} is not on the host"
    return bm


def test_a_prefix_written_down_to_the_host_is_found_there_and_loaded():
    """x y evicted to the host tier: x y + [99] asked again finds both blocks there, and each is
    loaded up into a device block (the lookup walks every tier worth loading from)."""
    x, y = [1, 2, 3, 4], [5, 6, 7, 8]
    bm = written_down_to_the_host(x + y + [99])
    b = allocated(bm, x + y + [99])
    got = b.num_cached_tokens // 4
    assert got == 2, (f"seq {b.seq_id}: {plural(got, 'block')} found, want 2: x and y are "
                      "cached in the host tier; the lookup searches every tier worth loading "
                      "from (worth_loading), not the device alone")
    loaded = (bm.counts["num_loaded_blocks"], bm.counts["host_prefix_cache_hits"])
    assert loaded == (2, 8), (f"{plural(loaded[0], 'block')} loaded, "
                              f"{plural(loaded[1], 'token')} found on the host: want 2, 8: "
                              "both hits come from the host tier")
    for i, tokens in enumerate((x, y)):
        block = bm.device.blocks[b.block_table[i]]
        assert block.token_ids == tuple(tokens), (
            f"seq {b.seq_id} block {i}: device block {block.block_id} holds {block.token_ids}, "
            f"want {tuple(tokens)}, loaded from the host")
    free_all(bm, b)


def test_a_host_block_a_swapped_out_request_holds_is_not_handed_out():
    """x on the host, held by a swapped-out request: a prompt starting with x finds nothing
    (below the device, only a block nobody holds counts), and the request keeps its block."""
    x, y = [1, 2, 3, 4], [5, 6, 7, 8]
    bm = written_down_to_the_host(x + y + [99])
    held = next(b for b in bm.host.blocks if b.token_ids == tuple(x))
    # swapped out, as swap_out would leave it: its table in the host pool, holding x's block
    swapped = Sequence(next(SEQ_IDS), x)
    swapped.num_computed_tokens = 4
    swapped.block_table = [held.block_id]
    bm._hold(bm.host, held)
    bm.host.seqs[swapped.seq_id] = swapped
    bm.check_invariants()
    b = allocated(bm, x + y + [99])
    got = b.num_cached_tokens // 4
    assert got == 0, (f"seq {b.seq_id}: {plural(got, 'block')} found, want 0: host block "
                      f"{held.block_id} (x) is seq {swapped.seq_id}'s, swapped out; below the "
                      "device only a block nobody holds counts")
    assert (held.ref_count, held.token_ids) == (1, tuple(x)), (
        f"host block {held.block_id}: ref_count {held.ref_count}, tokens {held.token_ids}: seq "
        f"{swapped.seq_id}, swapped out, must keep it as it was")
    bm.free(b)
    bm.free(swapped)
    bm.check_invariants()


def test_a_tier_not_worth_loading_from_is_not_searched():
    """x y on the host, where the cost rule says a block's copy up (1 s) costs more than
    recomputing its 4 tokens (4 us): x y + [99] finds nothing there (the lookup searches only the
    tiers worth loading from, worth_loading). Once recomputing a token costs 1 s, both are found."""
    x, y = [1, 2, 3, 4], [5, 6, 7, 8]
    bm = written_down_to_the_host(x + y + [99])
    bm.cost = CostModel(block_size=4, seconds_per_block={"device": 0.0, "host": 1.0, "disk": 1.0},
                        seconds_per_token=1e-6)
    b = allocated(bm, x + y + [99])
    got = b.num_cached_tokens // 4
    assert got == 0, (f"seq {b.seq_id}: {plural(got, 'block')} found on the host, want 0: by "
                      "the cost rule loading a block from the host (1 s) costs more than "
                      "recomputing it (4 us); the lookup searches only the tiers worth loading "
                      "from (worth_loading)")
    free_all(bm, b)
    bm.cost.seconds_per_token = 1.0
    c = allocated(bm, x + y + [99])
    got = c.num_cached_tokens // 4
    assert got == 2, (f"seq {c.seq_id}: {plural(got, 'block')} found, want 2: recomputing a "
                      "block (4 s) now costs more than loading it from the host (1 s)")
    free_all(bm, c)

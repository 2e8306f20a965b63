"""
Lab prefix-cache: the hash-chain lookup (BlockManager._cache_hits in nanopaged.py).

What the student writes: the walk that finds the blocks holding a prompt's prefix, one look-up per
block along the chain hash h[i] = H(h[i-1], tokens of block i), checked against the block's tokens
and its parent's prefix, stopping at the first miss, never at the block of the last token.
What the tests pin, on BlockManager alone (no model): which blocks a prompt shares and how many
of its tokens count as cached, against a brute-force search over every prefix computed so far;
collisions never hand out a wrong block; a block somebody holds is the one shared.

    python tests/labs.py grade prefix-cache
"""
import random

from conftest import SEQ_IDS
from nanopaged import BlockManager, Sequence


def computed(bm, tokens):
    """A prompt as the engine computes it: allocated, every token computed, full blocks
    registered in the prefix cache."""
    seq = Sequence(next(SEQ_IDS), tokens)
    bm.allocate(seq)
    seq.num_computed_tokens = len(seq)
    bm.cache_full_blocks(seq)
    bm.check_invariants()
    return seq


def allocated(bm, tokens):
    seq = Sequence(next(SEQ_IDS), tokens)
    bm.allocate(seq)
    bm.check_invariants()
    return seq


def assert_shares(seq, other, num_blocks):
    """seq's first num_blocks blocks are other's, and no more of them."""
    got = seq.num_cached_tokens // 4
    assert got == num_blocks, (f"seq {seq.seq_id}: {got} blocks found in the prefix cache, "
                               f"want {num_blocks} (seq {other.seq_id}'s first {num_blocks})")
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
    assert b.num_computed_tokens == 8, (f"seq {b.seq_id}: {b.num_computed_tokens} tokens count "
                                        "as computed; the last token's block must be computed")
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
        assert got == want, (f"step {step}: seq {seq.seq_id} {tokens}: {got} blocks found, want "
                             f"{want} (the longest prefix of full blocks computed before, the last "
                             "token's block excluded)")
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

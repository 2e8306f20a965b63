"""The memory hierarchy: a cached block evicted from the device is written down to the host,
from the host to disk, from disk dropped; a prompt finds its prefix in any tier and loads it
back up; swap-out shares the host with the cache; the cost rule turns a tier off. First the
BlockManager driven by hand (block_size 4, no model), then a multi-turn chat on random:tiny
whose outputs must not depend on the tiers, then bad input and Ctrl-C in the middle of a copy.

    python -m pytest -q tests/test_tiers.py
"""
import contextlib
import gc
import os
import signal
import subprocess
import sys
import tempfile

import pytest
import torch

import nanopaged
from conftest import SEQ_IDS, assert_no_block_held, checked
from nanopaged import LLM, BlockManager, SamplingParams, Sequence
from test_block_manager import alloc, computed, toks   # allocate, compute, register; token ids

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BS = 4   # block_size of every test here: a block is 4 tokens


def cached(bm, token_ids):
    """A prompt computed and finished: its full blocks stay in the prefix cache, held by none."""
    seq = computed(bm, Sequence(next(SEQ_IDS), token_ids))
    bm.free(seq)
    bm.check_invariants()
    return seq


def events(bm):
    """The events recorded since the last call, as (kind, blocks, to, what, tier): what is the
    tier the blocks went to, else the detail the words say (tokens found, ...); tiers by name."""
    records, bm.events.records = bm.events.records, []
    what = lambda e: e.to_tier.name if e.to_tier else "".join(map(str, e.details.values()))
    return [(e.kind, e.block_ids, e.to_ids, what(e), e.tier.name if e.tier else "device")
            for e in records]


def taken(bm):
    """The copies queued since the last call, in the order decided; the queue is emptied."""
    copies = [(src.name, a, dst.name, b) for src, a, dst, b in bm.copies]   # tiers by name
    bm.copies.clear()
    return copies


def forget(bm):
    """Drop the copies and events so far: the assertions after it see only what comes next."""
    taken(bm)
    events(bm)


def registered(bm):
    """tier -> {block id: its tokens} of every block registered in the prefix cache."""
    return {pool.name: {b.block_id: b.token_ids for b in pool.blocks if b.hash is not None}
            for pool in bm.tiers}


def where_is(bm, token_ids):
    """[(tier, block id)] of the registered blocks holding these 4 tokens (at any position)."""
    return [(tier, b) for tier, blocks in registered(bm).items()
            for b, t in blocks.items() if t == tuple(token_ids)]


def tier_hits(bm):
    """(host, disk): the prefix-cache hits, in tokens, loaded up from each tier."""
    return tuple(bm.counts[f"{tier}_prefix_cache_hits"] for tier in ("host", "disk"))


# ----------------------------------------------------------------------------------------------
# The BlockManager by hand: write-downs, drops, loads, swap-out, the cost rule, collisions


def prefix_entry(block):   # what the prefix cache knows of a block; a copy takes it along
    return block.hash, block.token_ids, block.prefix_id, block.parent_prefix_id, block.hits


def test_device_eviction_writes_the_block_down_to_host():
    """Evicting a cached device block queues its copy to a host block registered as the same
    prefix (hash, tokens), and leaves the device block unregistered."""
    bm = BlockManager(1, BS, num_cpu_blocks=1, num_disk_blocks=1)
    cached(bm, toks(0, 4))                            # device block 0: tokens 0-3, cached
    entry = prefix_entry(bm.device.blocks[0])
    assert entry[0] == BlockManager.compute_hash(None, (0, 1, 2, 3))
    forget(bm)
    b = alloc(bm, Sequence(next(SEQ_IDS), toks(100, 4)))             # no free block: block 0 is evicted
    assert b.block_table == [0]
    assert taken(bm) == [("device", 0, "host", 0)]
    assert events(bm) == [("write down", (0,), (0,), "host", "device")]
    host = bm.host.blocks[0]
    assert prefix_entry(host) == entry and host.token_ids == (0, 1, 2, 3) and host.ref_count == 0
    assert list(bm.host.cached_block_ids) == [0]
    assert bm.host.hash_to_block_ids == {entry[0]: {0: None}}
    assert bm.device.blocks[0].hash is None and bm.device.blocks[0].token_ids == ()
    assert entry[0] not in bm.device.hash_to_block_ids
    assert (bm.counts["num_offloaded_blocks"], bm.counts["num_evictions"]) == (1, 0)
    bm.free(b)                                        # b computed nothing: its block is free
    bm.check_invariants()
    assert list(bm.device.empty_block_ids) == [0] and not bm.device.cached_block_ids
    assert where_is(bm, toks(0, 4)) == [("host", 0)]


def test_a_full_host_takes_only_a_block_found_more_often_than_its_next_out():
    """A block evicted into a host full of cached blocks found as often goes on to the disk (one
    copy; the host keeps what it holds); a block a prompt has found takes the place of the host's
    least recent block, which moves down to disk first: two copies, in that order."""
    bm = BlockManager(2, BS, num_cpu_blocks=2, num_disk_blocks=2)
    for start in (0, 10, 20, 30):                     # P0, P1 written down to host blocks 0, 1
        cached(bm, toks(start, 4))
    assert registered(bm) == {"device": {0: (20, 21, 22, 23), 1: (30, 31, 32, 33)},
                              "host": {0: (0, 1, 2, 3), 1: (10, 11, 12, 13)}, "disk": {}}
    forget(bm)
    cached(bm, toks(20, 4) + [99])                    # finds P2 (hits 1); its new block evicts P3
    assert taken(bm) == [("device", 1, "disk", 0)]    # found by nobody, as the host's: to disk
    assert events(bm)[:1] == [("write down", (1,), (0,), "disk", "device")]
    assert where_is(bm, toks(30, 4)) == [("disk", 0)] and bm.counts["num_write_downs_skipped"] == 0
    cached(bm, toks(40, 8))                           # evicts P2: found once, more than P0
    assert taken(bm) == [("host", 0, "disk", 1), ("device", 0, "host", 0)]
    assert events(bm) == [("write down", (0,), (1,), "disk", "host"),
                          ("write down", (0,), (0,), "host", "device")]
    assert registered(bm) == {"device": {1: (40, 41, 42, 43), 0: (44, 45, 46, 47)},
                              "host": {0: (20, 21, 22, 23), 1: (10, 11, 12, 13)},
                              "disk": {0: (30, 31, 32, 33), 1: (0, 1, 2, 3)}}
    assert bm.host.blocks[0].hits == 1                # its copy counts on
    assert list(bm.host.cached_block_ids) == [1, 0]   # P1 is now the least recent
    assert (bm.counts["num_offloaded_blocks"], bm.counts["num_evictions"]) == (5, 0)


def test_tiers_full_of_blocks_found_as_often_drop_the_evicted_block():
    """With every tier full of cached blocks found as often, an evicted block is dropped (an
    eviction, no copy, counted as a write-down skipped): no tier gives up a block for it. A block
    found more often takes the host's least recent place, and that one is dropped in turn."""
    bm = BlockManager(2, BS, num_cpu_blocks=1, num_disk_blocks=1)
    for start in (0, 10, 20, 30):                     # P0 on host, P1 on disk, P2, P3 on device
        cached(bm, toks(start, 4))
    assert (bm.counts["num_offloaded_blocks"], bm.counts["num_evictions"]) == (2, 0)
    forget(bm)
    cached(bm, toks(40, 4))                           # evicts P2, found by nobody
    assert taken(bm) == [] and events(bm) == [("evict", (0,), (), "lru: freed longest ago", "device")]
    assert (bm.counts["num_evictions"], bm.counts["num_write_downs_skipped"]) == (1, 1)
    cached(bm, toks(30, 4) + [99])                    # finds P3; its new block evicts P4
    forget(bm)
    cached(bm, toks(50, 8))                           # evicts P3, found once: to the host
    assert taken(bm) == [("device", 1, "host", 0)]    # P0 dropped for it: the disk's P1 stays
    assert events(bm)[:2] == [("evict", (0,), (), "lru: freed longest ago", "host"),
                              ("write down", (1,), (0,), "host", "device")]
    assert registered(bm) == {"device": {0: (50, 51, 52, 53), 1: (54, 55, 56, 57)},
                              "host": {0: (30, 31, 32, 33)}, "disk": {0: (10, 11, 12, 13)}}
    assert where_is(bm, toks(0, 4)) == [] and bm.counts["num_write_downs_skipped"] == 3


def test_prompt_loads_its_prefix_from_host_and_disk():
    """A prompt whose prefix sits one block on the host and one on disk loads both up, in
    chain order, counts them as hits of their tiers, and the prefix then lives on the device
    alone (a load moves it)."""
    bm = BlockManager(3, BS, num_cpu_blocks=1, num_disk_blocks=1)
    cached(bm, toks(0, 8))                            # A0 = 0-3, A1 = 4-7 (freed tail first)
    cached(bm, toks(100, 12))                         # A1 to the host; it full, A0 to disk
    assert where_is(bm, toks(0, 4)) == [("disk", 0)] and where_is(bm, toks(4, 4)) == [("host", 0)]
    assert bm.counts["prefix_cache_hits"] == 0
    loaded = bm.counts["num_loaded_blocks"]
    forget(bm)
    c = alloc(bm, Sequence(next(SEQ_IDS), toks(0, 8) + [99]))
    assert c.block_table == [0, 1, 2] and c.num_cached_tokens == c.num_computed_tokens == 8
    copies = taken(bm)
    loads = [cp for cp in copies if cp[2] == "device"]
    assert loads == [("disk", 0, "device", 0), ("host", 0, "device", 1)]
    # each device block taken for c evicts a cached block of B's: the first is dropped (host
    # and disk hold c's hits then, found once), the later ones go down to the blocks the loads
    # emptied
    assert copies == [("disk", 0, "device", 0), ("device", 1, "disk", 0),
                      ("host", 0, "device", 1), ("device", 2, "host", 0)]
    kinds = events(bm)
    assert [e for e in kinds if e[0] in ("load", "prefix hit", "evict")] == [
        ("evict", (0,), (), "lru: freed longest ago", "device"), ("load", (0,), (0,), "device", "disk"),
        ("load", (0,), (1,), "device", "host"), ("prefix hit", (0, 1), (), "8", "device")]
    assert tier_hits(bm) == (4, 4) and bm.counts["prefix_cache_hits"] == 8
    assert bm.counts["num_loaded_blocks"] - loaded == 2
    assert where_is(bm, toks(0, 4)) == [("device", 0)]   # moved up: no copy left below
    assert where_is(bm, toks(4, 4)) == [("device", 1)]
    assert [bm.device.blocks[b].ref_count for b in c.block_table] == [1, 1, 1]
    bm.free(c)
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks


def test_swap_out_pushes_cached_host_blocks_to_disk_but_never_swapped_ones():
    """swap_out into a host full of cached blocks writes them down to disk first, where a later
    prompt still finds them; a host full of a swapped request's blocks refuses the next one."""
    bm = BlockManager(3, BS, num_cpu_blocks=3, num_disk_blocks=3)
    cached(bm, toks(0, 12))                           # A: 3 blocks
    b = computed(bm, Sequence(next(SEQ_IDS), toks(100, 12)))         # pushes all of A to the host
    assert sorted(registered(bm)["host"].values()) == [(0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11)]
    assert bm.host.num_free_blocks == 3 and bm.can_swap_out(b)
    forget(bm)
    assert bm.swap_out(b) == [(0, 0), (1, 1), (2, 2)]
    bm.check_invariants()
    assert taken(bm) == [("host", 0, "disk", 0), ("device", 0, "host", 0),
                         ("host", 1, "disk", 1), ("device", 1, "host", 1),
                         ("host", 2, "disk", 2), ("device", 2, "host", 2)]
    # the host holds b, registered: a prompt finds its prefix there too
    assert sorted(registered(bm)["host"].values()) == [(100, 101, 102, 103), (104, 105, 106, 107),
                                                       (108, 109, 110, 111)]
    assert sorted(registered(bm)["disk"].values()) == [(0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11)]
    assert bm.counts["num_swapped_out_blocks"] == 3 and bm.counts["num_evictions"] == 0
    c = alloc(bm, Sequence(next(SEQ_IDS), toks(0, 8) + [99]))        # A's first two blocks, from disk
    assert c.num_cached_tokens == 8 and tier_hits(bm) == (0, 8)
    assert [cp[:2] for cp in taken(bm) if cp[2] == "device"] == [("disk", 2), ("disk", 1)]
    assert b.block_table == [2, 1, 0] and [bm.host.blocks[i].ref_count for i in range(3)] == [1] * 3
    assert bm.host.num_free_blocks == 0 and not bm.can_swap_out(c)
    bm.free(c)
    bm.free(b)
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks and bm.host.num_free_blocks == 3


class Worth:
    """A stand-in for the engine's CostModel: which tiers below the device are worth loading."""

    def __init__(self, host, disk):
        self.worth = {"host": host, "disk": disk}

    def worth_loading(self, tier):
        return self.worth[tier.name]

    def load_figures(self, tier):   # what a load event says of the rule
        return f"{tier.name} worth loading"


def test_tiers_not_worth_loading_are_neither_written_down_to_nor_read():
    """When the cost rule says no tier below is worth loading from, an eviction drops the block
    (nothing queued) and a prompt does not hit the prefix the host still holds."""
    rule = Worth(True, True)
    bm = BlockManager(2, BS, num_cpu_blocks=2, num_disk_blocks=2, cost=rule)
    cached(bm, toks(0, 4))
    cached(bm, toks(100, 8))                          # A (0-3) written down to the host
    assert where_is(bm, toks(0, 4)) == [("host", 0)]
    rule.worth = {"host": False, "disk": False}
    forget(bm)
    offloaded, evictions = bm.counts["num_offloaded_blocks"], bm.counts["num_evictions"]
    c = alloc(bm, Sequence(next(SEQ_IDS), toks(0, 4) + [99]))
    assert c.num_cached_tokens == 0 and tier_hits(bm) == (0, 0)
    assert bm.counts["num_loaded_blocks"] == 0
    assert taken(bm) == []                            # no load, no write-down
    assert [e[0] for e in events(bm)] == ["evict", "evict"]
    assert bm.counts["num_offloaded_blocks"] == offloaded
    assert bm.counts["num_evictions"] - evictions == 2
    assert where_is(bm, toks(0, 4)) == [("host", 0)]   # still there, only not used
    bm.free(c)
    bm.check_invariants()
    rule.worth["host"] = True                         # worth it again: the same prompt hits
    d = alloc(bm, Sequence(next(SEQ_IDS), toks(0, 4) + [99]))
    assert d.num_cached_tokens == 4 and taken(bm) == [("host", 0, "device", d.block_table[0])]
    bm.free(d)
    bm.check_invariants()


def test_a_tier_not_worth_loading_is_skipped_on_the_way_down():
    """With the host not worth loading from and the disk worth it, an evicted device block goes
    straight to disk, and a prompt loads it from there."""
    bm = BlockManager(2, BS, num_cpu_blocks=2, num_disk_blocks=2, cost=Worth(False, True))
    cached(bm, toks(0, 4))
    taken(bm)
    cached(bm, toks(100, 8))
    assert taken(bm) == [("device", 0, "disk", 0)]
    assert registered(bm)["host"] == {} and where_is(bm, toks(0, 4)) == [("disk", 0)]
    c = alloc(bm, Sequence(next(SEQ_IDS), toks(0, 4) + [99]))
    assert c.num_cached_tokens == 4 and tier_hits(bm) == (0, 4)
    bm.free(c)
    bm.check_invariants()


def test_colliding_hashes_never_hand_out_another_prompts_blocks_from_any_tier(monkeypatch):
    """With every hash equal, a hit from any tier is still checked against tokens and parent:
    each prompt gets exactly the blocks of its own prefix, and every load carries its tokens."""
    monkeypatch.setattr(BlockManager, "compute_hash", staticmethod(lambda parent, tokens: 42))
    bm = BlockManager(3, BS, num_cpu_blocks=2, num_disk_blocks=16)   # the disk drops nothing
    X, Y, Z, W, V = (toks(10 * k, 4) for k in range(1, 6))
    cached(bm, X + Y)
    cached(bm, Z + W + V)
    cached(bm, toks(200, 12))                         # pushes everything below the device
    below = {t for tier in ("host", "disk") for t in registered(bm)[tier].values()}
    assert below == {tuple(t) for t in (X, Y, Z, W, V)} and registered(bm)["device"]
    # (prompt, tokens it may take from the cache): Y after Z is not Y after X, nor is W after X
    cases = [(Z + Y + [1], 4), (X + W + [1], 4), (Y + X + [1], 0), (V + [1], 0),
             (X + Y + [1], 8), (Z + W + [1], 8)]
    for prompt, want in cases:
        taken(bm)
        seq = alloc(bm, Sequence(next(SEQ_IDS), prompt))
        assert seq.num_cached_tokens == want, prompt
        for i, block_id in enumerate(seq.block_table[:want // BS]):
            block = bm.device.blocks[block_id]
            assert block.token_ids == tuple(prompt[BS * i:BS * (i + 1)]), (prompt, i)
        for src_tier, _, dst_tier, dst in taken(bm):
            if dst_tier == "device" and src_tier != "device":   # a load: into one of seq's hits
                assert dst in seq.block_table[:want // BS], (prompt, dst)
        bm.free(seq)
        bm.check_invariants()
    assert bm.counts["num_loaded_blocks"] > 0 and all(tier_hits(bm))


# ----------------------------------------------------------------------------------------------
# The engine: a multi-turn chat whose histories outgrow the device pool

CHAT = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
NUM_CHATS, NUM_TURNS = 4, 3


def ids(seed, n):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def chat(llm):
    """4 chats, 3 turns each, taken in turn: a turn's prompt is the chat so far (the last prompt
    and its greedy reply) and a new 4-token user message. Returns (replies, tokens a perfect
    cache would find: every full block of each history written before)."""
    prompts = [ids(c, 12) for c in range(NUM_CHATS)]
    replies, hittable = [], 0
    for turn in range(NUM_TURNS):
        for c in range(NUM_CHATS):
            reply = llm.generate([prompts[c]], CHAT)[0].outputs[0].token_ids
            replies.append(reply)
            history = prompts[c] + reply     # its last token's K/V are never written
            prompts[c] = history + ids(100 + 10 * c + turn, 4)
            if turn + 1 < NUM_TURNS:
                hittable += (len(history) - 1) // BS * BS
    return replies, hittable


def test_chat_histories_come_back_from_host_and_disk_with_the_same_outputs(tmp_path):
    """A 16-block device pool cannot keep the four chats' histories (32 blocks). A host that
    holds them all makes every later turn compute only its new tokens; so does a small host with
    a disk below it, from disk; the replies are the same in every configuration."""
    configs = {"device": {}, "host": dict(num_cpu_blocks=64), "small host": dict(num_cpu_blocks=8),
               "small host + disk": dict(num_cpu_blocks=8, num_disk_blocks=64,
                                         disk_path=str(tmp_path / "kv.bin"))}
    replies, stats = {}, {}
    for name, kwargs in configs.items():
        llm = checked(LLM("random:tiny", block_size=BS, num_blocks=16, **kwargs))
        replies[name], hittable = chat(llm)
        cost = llm.block_manager.cost   # as measured: a block's copy costs less than its tokens
        bm = llm.block_manager
        assert all(cost.worth_loading(t) for t in (bm.host, bm.disk) if t.name in name), cost
        stats[name] = llm.stats()
        assert_no_block_held(llm)
    assert all(r == replies["device"] for r in replies.values())
    num_prompt_tokens = sum(12 + t * (CHAT.max_tokens + 4) for t in range(NUM_TURNS)) * NUM_CHATS
    computed = {name: s["num_prefill_tokens_computed"] for name, s in stats.items()}
    for name, s in stats.items():   # every prompt token is computed or found in the cache
        assert computed[name] + s["prefix_cache_hits"] == num_prompt_tokens, name
    # the device alone loses most histories; a host of 64 blocks keeps every one
    assert stats["device"]["num_offloaded_blocks"] == stats["device"]["num_loaded_blocks"] == 0
    assert stats["host"]["prefix_cache_hits"] == hittable
    assert stats["host"]["host_prefix_cache_hits"] > 0 and stats["host"]["num_evictions"] == 0
    assert computed["device"] > computed["small host"] > computed["host"]
    # a host of 8 blocks alone loses histories too; with a disk below it loses none
    assert stats["small host + disk"]["disk_prefix_cache_hits"] > 0
    assert computed["small host + disk"] == computed["host"] == num_prompt_tokens - hittable
    assert stats["small host + disk"]["num_evictions"] == 0
    bytes_per_block = 2 * 2 * BS * 2 * 16 * 4   # K and V, 2 layers, 2 kv heads of 16, float32
    assert llm.kv_caches["disk"].nbytes == 64 * bytes_per_block
    assert os.listdir(tmp_path) == []   # its hits came from a file whose name was gone all along


# ----------------------------------------------------------------------------------------------
# Bad input: refused before the model loads; on the command line, one line and exit status 2

BAD_TIER_ARGUMENTS = {
    "num_disk_blocks=-1": (dict(num_disk_blocks=-1), "num_disk_blocks"),
    "num_disk_blocks=2.5": (dict(num_disk_blocks=2.5), "num_disk_blocks"),
    "num_disk_blocks='8'": (dict(num_disk_blocks="8"), "num_disk_blocks"),
    "num_disk_blocks=True": (dict(num_disk_blocks=True), "num_disk_blocks"),
    "disk_path in no folder": (dict(num_disk_blocks=8, disk_path="/no/such/folder"), "disk_path"),
    "disk_path a folder": (dict(num_disk_blocks=8, disk_path="/"), "disk_path"),
    "disk_path not a str": (dict(num_disk_blocks=8, disk_path=3), "disk_path"),
    "disk_path an existing file": (dict(num_disk_blocks=8, disk_path=__file__), "disk_path"),
}


@pytest.mark.parametrize("case", list(BAD_TIER_ARGUMENTS))
def test_bad_tier_argument_is_a_value_error_before_the_model_loads(monkeypatch, case):
    """A bad disk tier size or path is a ValueError naming it, raised before any model loads."""
    def no_loading(*args):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(nanopaged, "load_model", no_loading)
    kwargs, word = BAD_TIER_ARGUMENTS[case]
    with pytest.raises(ValueError, match=word):
        LLM("random:tiny", block_size=BS, num_blocks=16, **kwargs)


@pytest.mark.parametrize("argv", [["--num-disk-blocks", "-1"],
                                  ["--num-disk-blocks", "8", "--disk-path", "/no/such/folder"]],
                         ids=" ".join)
def test_a_bad_tier_on_the_command_line_is_one_line_and_exit_status_2(argv):
    """python nanopaged.py with a bad disk tier prints one line, `error:` and why, and exits 2."""
    run = subprocess.run([sys.executable, "nanopaged.py", "--model", "random:tiny", *argv],
                         cwd=ROOT, capture_output=True, text=True)
    lines = run.stderr.strip().splitlines()
    assert (run.returncode, len(lines)) == (2, 1), run.stderr
    assert "error:" in lines[0] and "disk" in lines[0] and "Traceback" not in run.stderr
    assert not run.stdout


# ----------------------------------------------------------------------------------------------
# Ctrl-C in the middle of a step's copies between the tiers


class Tripwire(dict):
    """llm.kv_caches that raises KeyboardInterrupt (as a Ctrl-C would) at its `left`-th look-up
    once armed: a copy looks up two caches, before it is made."""
    left = None

    def __getitem__(self, tier):
        if self.left is not None:
            self.left -= 1
            if self.left == 0:
                self.left = None
                raise KeyboardInterrupt
        return super().__getitem__(tier)


@pytest.mark.parametrize("async_copies", [False, True])
def test_ctrl_c_between_copies_of_loads_and_write_downs_leaves_the_engine_whole(async_copies):
    """A Ctrl-C after some of a step's queued loads and write-downs are made, before the rest,
    leaves every invariant holding, and the same prompts then give an uninterrupted run's
    replies (no block whose copy was not made is found in the cache). With async_copies the
    copy that raises is the copy engine's, in the background: the step raises it, the copies
    after it are never made, and none of their blocks is trusted."""
    def engine():
        return checked(LLM("random:tiny", block_size=BS, num_blocks=16, num_cpu_blocks=8,
                           num_disk_blocks=64, async_copies=async_copies))

    want, _ = chat(engine())
    llm = engine()
    llm.copier.kv_caches = Tripwire(llm.copier.kv_caches)
    seen = []

    def arm():   # armed once: the first step that loads and writes down
        copies = llm.block_manager.copies
        kinds = {(src.name == "device", dst.name == "device") for src, _, dst, _ in copies}
        if not seen and {(False, True), (True, False)} <= kinds:
            seen.append(list(llm.block_manager.copies))
            llm.copier.kv_caches.left = len(seen[0]) + 1   # in the middle: half the copies made

    if async_copies:   # the step's copies start in the background
        start = llm.copy_engine.start

        def start_tripped(llm, batch):
            arm()
            return start(llm, batch)

        llm.copy_engine.start = start_tripped
    else:   # the step's copies are made at once
        make_copies = llm._make_copies

        def make_copies_tripped(batch):
            arm()
            return make_copies(batch)

        llm._make_copies = make_copies_tripped
    with pytest.raises((KeyboardInterrupt, RuntimeError) if async_copies else KeyboardInterrupt):
        chat(llm)
    assert seen and len(seen[0]) >= 2   # one copy made, the next not
    llm.block_manager.check_invariants()
    assert_no_block_held(llm)   # the interrupted call's request is gone with its blocks
    s = llm.stats()   # the undone step's hits are undone in every count
    assert s["host_prefix_cache_hits"] + s["disk_prefix_cache_hits"] <= s["prefix_cache_hits"]
    assert s["num_loaded_blocks"] * BS == s["host_prefix_cache_hits"] + s["disk_prefix_cache_hits"]
    assert chat(llm)[0] == want
    assert llm.stats()["num_loaded_blocks"] > 0
    assert_no_block_held(llm)


def disk_mappings(folder):
    """This process's mappings of the disk files in folder: (permissions, inode, file name)."""
    with open("/proc/self/maps") as maps:
        return [(line.split()[1], line.split()[4], line.split(None, 5)[5].strip()) for line in maps
                if f" {os.path.realpath(folder)}/" in line and ("kv.bin" in line or ".kv" in line)]


@pytest.mark.parametrize("given", ["Path", "relative str", "temporary"])
def test_the_disk_file_is_nameless_once_mapped_and_goes_with_its_engine(tmp_path, monkeypatch,
                                                                       given):
    """disk_path (a Path or a str, relative to the directory of the moment) or the default
    temporary file: a new file, mapped shared and unlinked at once. The folder holds no name of it
    while the engine lives, its K/V are read and written there all the same, two engines with
    one disk_path get two files, and the mapping (so the file) goes with the engine (and its copy
    worker, which ends after it)."""
    if not os.path.exists("/proc/self/maps"):
        pytest.skip("the mappings are read from /proc/self/maps (Linux)")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))   # where the temporary file goes
    path = {"Path": tmp_path / "kv.bin", "relative str": "kv.bin", "temporary": None}[given]
    make = lambda: LLM("random:tiny", block_size=BS, num_blocks=16, num_disk_blocks=8,
                       disk_path=path)
    kv_files = lambda: [f for f in os.listdir(tmp_path) if f == "kv.bin" or f.endswith(".kv")]
    first, second = make(), make()   # the name is free again once the first file is mapped
    assert kv_files() == []
    (perms, inode, name), (perms2, inode2, name2) = disk_mappings(tmp_path)   # two files, shared
    assert perms == perms2 == "rw-s" and inode != inode2   # shared: writes go to the file
    assert name.endswith(" (deleted)") and name2.endswith(" (deleted)")
    assert name.startswith(str(tmp_path)) and name2.startswith(str(tmp_path))
    first.kv_caches["disk"].fill_(1.0)
    second.kv_caches["disk"].fill_(2.0)   # its own file: the first one's K/V stay
    assert bool((first.kv_caches["disk"] == 1.0).all()) and first.kv_caches["disk"].nbytes > 0
    del first, second
    gc.collect()   # (their copy engines' workers hold no pool: a queued copy only, while queued)
    assert disk_mappings(tmp_path) == [] and kv_files() == []


def test_a_dangling_symlink_is_not_a_new_disk_file(tmp_path):
    """disk_path naming a symlink to nowhere is refused before the model loads; its target is
    never created."""
    link = tmp_path / "kv.bin"
    link.symlink_to(tmp_path / "target.bin")
    with pytest.raises(ValueError, match="disk_path"):
        LLM("random:tiny", block_size=BS, num_blocks=16, num_disk_blocks=8, disk_path=link)
    assert not (tmp_path / "target.bin").exists() and link.is_symlink()


def used_bytes(folder):
    """The bytes in use on the file system of folder (on a tmpfs of its own: only the test's)."""
    stats = os.statvfs(folder)
    return (stats.f_blocks - stats.f_bfree) * stats.f_frsize


def test_the_disk_file_has_its_space_reserved_whole_until_the_engine_goes(tmp_path):
    """The disk pool's bytes are allocated on the disk when the engine is made (not a sparse file
    that a full disk turns into a SIGBUS at a later write-down), held while it lives though the
    file has no name, and freed when it goes."""
    with tmpfs(tmp_path / "disk", "size=4M") as folder:
        before = used_bytes(folder)
        llm = LLM("random:tiny", block_size=BS, num_blocks=16, num_disk_blocks=256,
                  disk_path=folder / "kv.bin")
        num_bytes = llm.kv_caches["disk"].nbytes
        assert num_bytes == 256 * 2048 and os.listdir(folder) == []
        assert used_bytes(folder) - before >= num_bytes   # reserved, nothing written yet
        del llm
        gc.collect()
        assert used_bytes(folder) == before


ENGINE_WITH_A_DISK = """
import sys, time
from nanopaged import LLM
path = None if sys.argv[1] == "None" else sys.argv[1]
llm = LLM("random:tiny", block_size=4, num_blocks=16, num_disk_blocks=256, disk_path=path)
llm.kv_caches["disk"].fill_(1.0)   # every page written: the file's, not the process's memory
print(llm.kv_caches["disk"].nbytes, flush=True)
time.sleep(60)
"""


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
@pytest.mark.parametrize("given", [True, False], ids=["disk_path", "temporary"])
def test_a_killed_process_leaves_no_disk_file(tmp_path, signum, given):
    """Killed by SIGKILL (no handler can run) or SIGTERM, a process with a disk tier (a given
    disk_path or the default temporary file) dies of that signal, and leaves neither a file in
    the folder nor the space its pool held: the file had no name, the OS frees it with the
    process's mappings."""
    with tmpfs(tmp_path / "disk", "size=4M") as folder:
        path = str(folder / "kv.bin") if given else "None"
        env = dict(os.environ, TMPDIR=str(folder))   # where the temporary file goes
        proc = subprocess.Popen([sys.executable, "-c", ENGINE_WITH_A_DISK, path], cwd=ROOT,
                                env=env, stdout=subprocess.PIPE, text=True)

        def kv_files():   # (torch may make its own cache folder in TMPDIR too)
            return [f for f in os.listdir(folder) if f == "kv.bin" or f.endswith(".kv")]

        try:
            num_bytes = int(proc.stdout.readline())   # the engine is made, its pool written
            assert num_bytes == 256 * 2048 and kv_files() == []
            alive = used_bytes(folder)
            assert alive >= num_bytes   # the nameless file, on this file system
            proc.send_signal(signum)
            assert proc.wait(timeout=60) == -signum
        finally:   # (a failed assertion above: the child must not sleep on)
            proc.kill()
            proc.wait()
        assert kv_files() == [] and used_bytes(folder) <= alive - num_bytes


TWO_ENGINES_ON_A_SMALL_DISK = """
import os, sys
from nanopaged import LLM, SamplingParams
folder = sys.argv[1]
# random:tiny at block_size 4: 2 KiB a block; each disk pool holds 600 KiB of the disk's 1 MiB
first = LLM("random:tiny", block_size=4, num_blocks=8, num_disk_blocks=300,
            disk_path=folder + "/first.kv")
try:
    LLM("random:tiny", block_size=4, num_blocks=8, num_disk_blocks=300,
        disk_path=folder + "/second.kv")
except ValueError as e:
    print("refused:", e)
print(os.listdir(folder))   # neither the refused engine's file nor the first one's name
first.kv_caches["disk"].fill_(1.0)   # every byte of the first one's file written
print(int(first.kv_caches["disk"].sum()) == first.kv_caches["disk"].numel())
"""


@contextlib.contextmanager
def tmpfs(folder, options):
    """A small file system mounted at folder for the block (root only: else the test skips)."""
    folder.mkdir()
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)],
                           capture_output=True)
    if mount.returncode != 0:
        pytest.skip("mounting a small tmpfs needs root")
    try:
        yield folder
    finally:
        # lazy: a failed test's engine (or child) still mapping a file there cannot keep it mounted
        subprocess.run(["umount", "--lazy", str(folder)])


def test_two_engines_on_a_nearly_full_disk_the_second_is_refused_none_dies(tmp_path):
    """On a 1 MiB file system, an engine whose 600 KiB disk pool fits is made and writes all of
    it; a second one of 600 KiB is a ValueError, not a SIGBUS at its first write-down."""
    with tmpfs(tmp_path / "disk", "size=1M") as folder:
        run = subprocess.run([sys.executable, "-c", TWO_ENGINES_ON_A_SMALL_DISK, str(folder)],
                             cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stderr
        refused, names, written = run.stdout.splitlines()
        assert refused.startswith("refused: num_disk_blocks") and "MiB free" in refused
        assert names == "[]"
        assert written == "True"
        assert os.listdir(folder) == []


NO_FILE_HERE = """
import sys
from nanopaged import LLM
try:
    LLM("random:tiny", num_blocks=8, num_disk_blocks=8, disk_path=sys.argv[1] + "/kv.bin")
except ValueError as e:
    print(e)
"""


@pytest.mark.parametrize("place", ["/proc", "read-only"])
def test_a_disk_path_where_no_file_can_be_made_is_one_clean_error(tmp_path, place):
    """disk_path in a folder where no file can be made, even by root (/proc, a file system mounted
    read-only), is a ValueError naming it, and nothing is left to clean up ('Exception ignored')."""
    with (tmpfs(tmp_path / "ro", "size=1M,ro") if place == "read-only" else
          contextlib.nullcontext(place)) as folder:
        run = subprocess.run([sys.executable, "-c", NO_FILE_HERE, str(folder)], cwd=ROOT,
                             capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.startswith("disk_path"), run.stdout + run.stderr
    assert "Exception" not in run.stderr and "Traceback" not in run.stderr, run.stderr


def test_a_disk_pool_too_large_for_any_file_is_a_value_error(tmp_path):
    """num_disk_blocks past what a file may hold (2**63 bytes) is a ValueError, no file left."""
    with pytest.raises(ValueError, match="num_disk_blocks"):
        LLM("random:tiny", block_size=4, num_blocks=8, num_disk_blocks=2 ** 53,
            disk_path=tmp_path / "kv.bin")
    assert os.listdir(tmp_path) == []


def test_a_swapped_requests_host_blocks_are_found_for_drops_not_for_prompts():
    """A swapped request's host blocks are registered: its device copies, evicted, are dropped
    (no second copy to the host). A prompt with the same prefix does not take them from it
    (they are its own until it returns), and after the swap-in its table is whole again."""
    bm = BlockManager(3, BS, num_cpu_blocks=3)
    a = computed(bm, Sequence(next(SEQ_IDS), toks(0, 9)))            # two full blocks and one token
    bm.swap_out(a)
    forget(bm)
    cached(bm, toks(100, 12))                         # evicts a's device copies
    assert taken(bm) == [] and [e[0] for e in events(bm)] == ["drop", "drop"]
    b = alloc(bm, Sequence(next(SEQ_IDS), toks(0, 4) + [99]))        # a's first block, held on the host
    assert b.num_cached_tokens == 0 and not [c for c in taken(bm) if c[0] == "host"]
    bm.free(b)
    bm.swap_in(a)
    bm.check_invariants()
    assert [bm.device.blocks[i].token_ids for i in a.block_table[:2]] == [(0, 1, 2, 3),
                                                                         (4, 5, 6, 7)]
    bm.free(a)
    bm.check_invariants()


def test_a_dropped_block_hands_its_hits_to_its_copy_below():
    """A device block evicted while its copy below stays (written ahead) is dropped, and the
    prompts that found it count on in the copy: a block found less often cannot evict it."""
    bm = BlockManager(2, BS, num_cpu_blocks=1)
    cached(bm, toks(0, 4))                            # A on the device
    bm.write_ahead()                     # A's copy on the host, found by nobody yet
    for i in range(5):
        cached(bm, toks(0, 4) + [100 + i])            # five prompts find A on the device
    forget(bm)
    cached(bm, toks(10, 8))                           # A evicted: dropped, its copy stays
    assert ("drop", (0,), (0,), "host", "device") in events(bm)
    assert bm.host.blocks[0].hits == 5
    for i in range(2):
        cached(bm, toks(20, 4) + [90 + i])            # C: computed, then found once
    cached(bm, toks(30, 8))                           # C evicted: the host keeps A
    assert where_is(bm, toks(0, 4)) == [("host", 0)] and where_is(bm, toks(20, 4)) == []


def test_a_request_preempted_to_recompute_counts_each_block_found_once_more():
    """Freed to be recomputed (coming_back), each block of the request counts one more hit, once
    though three samples share it: a full tier below keeps it over blocks nobody looks for."""
    bm = BlockManager(8, BS)
    leader = computed(bm, Sequence(next(SEQ_IDS), toks(0, 9)))       # blocks 0, 1 full and registered
    samples = [leader] + [Sequence(next(SEQ_IDS), leader.token_ids) for _ in range(2)]
    for s in samples[1:]:
        bm.fork(leader, s)
    full = leader.block_table[:2]
    for s in samples:
        bm.free(s, coming_back=True)
    assert [bm.device.blocks[b].hits for b in full] == [1, 1]
    bm.check_invariants()

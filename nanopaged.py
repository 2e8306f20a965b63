"""
nanopaged.py: a paged KV cache inference engine you can read in one sitting.

What it teaches: how an LLM server manages the memory that holds every request's keys and values.
The KV cache is cut into fixed-size blocks, like pages of virtual memory; each sequence has a block
table mapping its logical blocks to physical ones. That one indirection buys:
  - no reservation: a sequence takes a block only when it fills the last one (little waste);
  - sharing: requests with the same prefix point at the same blocks (prefix caching, through a
    hash chain), samples of one prompt share its blocks (fork), counted by ref_count;
  - copy-on-write: a shared block is copied only when somebody must write into it;
  - preemption: when blocks run out, the last-ranked request gives its blocks back, swapped to
    the host pool or freed to be recomputed later;
  - a memory hierarchy: device, host memory, disk, one block shape; a prompt that finds its
    prefix in a lower tier loads it back up (and, below the banner, a cached block evicted from
    one tier is written down to the next).

Read it from the top down to the banner that ends the reading path: a plain engine that runs by
itself, in the order one request travels, every mechanism of its memory system in its plain form
(it calls nothing defined below the banner).
  1. Sampling, Sequence, Request    what a request is
  2. Block, Pool, KVCacheManager    the tiers: allocate with prefix-cache hits in any tier, copy-
                                    on-write, fork, free, eviction, swap
  3. ScheduledBatch, Scheduler      which tokens run this step; preemption when blocks run out
  4. sample, EngineArgs, Engine     the engine: block copies, tensors for the model, sampling, step
After it, for a second reading, each refinement as a subclass that overrides one plain choice or
a hook the plain code defines (doing the plain thing, or nothing): 5. LLM (the engine with every
refinement, its model loaded by name), SamplingParams and BeamSearchParams, and the API guards,
6. invariant checks, 7. events and metrics, 8. BlockManager (the event log, the write-down rule,
why a prompt missed the cache, recomputed samples' leader, the cost rule), 9. the tiers' machinery
(INT8 tiers, the disk file, the block copier, the copy engine), 10. failure recovery, 11. beam
search rounds, 12. priorities and aging (PriorityScheduler), 13. the live view, 14. the command
line and its demos.

    python nanopaged.py --live           watch the default demo: the pool, every block table
    python nanopaged.py --demo fork --trace    a plain-text snapshot per step, for handouts
    python nanopaged.py --help           the demos and the knobs (block size, pools, preemption)
"""
import argparse
import array
import bisect
import concurrent.futures
import contextlib
import dataclasses
import functools
import heapq
import io
import itertools
import math
import os
import shutil
import signal
import tempfile
import textwrap
import threading
import time
import timeit
import weakref
from collections import Counter, OrderedDict, defaultdict, deque, namedtuple
from dataclasses import dataclass, field
from enum import Enum

import torch
from rich.console import Console, Group
from rich.live import Live
from rich.text import Text

from model import Batch

# ----------------------------------------------------------------------------------------------
# 1. What a request is

@dataclass(frozen=True)
class Sampling:
    """How a request samples. (SamplingParams, section 5: the same, each field checked.)"""
    temperature: float = 1.0   # 0: greedy (argmax)
    # keep the smallest set of tokens whose probability reaches top_p
    top_p: float = 1.0
    top_k: int = 0             # keep the k most likely tokens; 0: all
    max_tokens: int = 16
    # samples of one prompt; they share the prompt's blocks
    n: int = 1
    ignore_eos: bool = False
    # None: derived from the engine's seed and the request id
    seed: int | None = None


class Sequence:
    """One stream of tokens: a prompt and what was generated after it, and the block table saying
    where each token's K/V live. len(seq) counts every token, the last one sampled too, whose K/V
    the next step writes. n>1 sampling and beam search fork several from one request."""

    # seq_id: unique in its engine (Scheduler.seq_ids): traces name sequences by it
    def __init__(self, seq_id, token_ids, request_id=None, index=0):
        self.seq_id = seq_id
        self.request_id = self.seq_id if request_id is None else request_id
        # which sample of its request (CompletionOutput.index)
        self.index = index
        self.token_ids = list(token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        # tokens whose K/V are in the cache (vLLM's name); a recomputed sample counts those its
        # leader writes for the blocks they share too (waits_for, section 8)
        self.num_computed_tokens = 0
        # of those, the tokens found in the prefix cache at the last allocate
        self.num_cached_tokens = 0
        # physical block ids: token i lives in block_table[i // block_size]
        self.block_table = []
        # the hash chain over its full blocks (BlockManager)
        self.block_hashes = []
        # the leader computing the blocks they share (section 8)
        self.waits_for = None
        # write-through (section 9): its blocks looked at, the last one's id
        self.written_through = (0, None)
        # the tokens before it count as prefill (a metric's)
        self.prefill_until = 0
        # "stop" (eos), "length" (max_tokens), "pruned" (a beam not chosen)
        self.finish_reason = None
        self.finish_time = None
        # beam search: (vocab,) float32 next-token log-probs, CPU
        self.logprobs = None
        # beam search: the beam's total log-probability
        self.cum_logprob = 0.0

    def __len__(self):
        return len(self.token_ids)

    @property
    def num_output_tokens(self):
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self):
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_written_tokens(self):
        """Tokens whose K/V are in the cache now: not those its leader owes it (waits_for)."""
        writer = self if self.waits_for is None else self.waits_for
        return min(self.num_computed_tokens, writer.num_computed_tokens)

    def append_token(self, token_id):
        self.token_ids.append(token_id)


class RequestStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


class Request:
    """One prompt and its params: the unit the scheduler admits, preempts and swaps, always whole.
    It starts as one sequence; n>1 samples fork from it as they draw their first tokens."""

    def __init__(self, request_id, token_ids, params, seed, priority, seq_id):
        self.request_id = request_id
        self.params = params
        # lower first, if scheduling_policy="priority" (section 12)
        self.priority = priority
        self.prompt_token_ids = list(token_ids)
        self.status = RequestStatus.WAITING
        # live sequences, in the order they forked
        self.seqs = [Sequence(seq_id, token_ids, request_id)]
        # sequences that ended: samples to return, beams that were dropped
        self.finished = []
        # beam search: BeamHypothesis records, the candidates for the output
        self.hypotheses = []
        # each prompt token's K/V: the tier it was found in, or why it was computed (section 8)
        self.sources = ()
        # sample i draws from stream i alone: its draws never depend on the schedule
        # preemptions, who else runs
        sampling = not self.is_beam_search and params.temperature > 0
        self.generators = [
            torch.Generator().manual_seed((seed * 1_000_003 + i) % 2**63)
            for i in range(params.n if sampling else 0)
        ]
        self.arrival_time = time.perf_counter()
        self.first_token_time = None

    @property
    def is_beam_search(self):
        # (BeamSearchParams, section 11)
        return not isinstance(self.params, Sampling)

    @property
    def past_first_token(self):
        """Has it sampled its first token (where n>1 samples fork)?"""
        return len(self.finished) > 0 or self.seqs[0].num_output_tokens > 0

    @property
    def max_num_running_seqs(self):
        """What the request counts against max_num_seqs: n (or beam_width) from its admission on,
        so that its forks always fit; once its samples have forked, the ones still live."""
        if self.is_beam_search or not self.past_first_token:
            return self.params.n
        return len(self.seqs)

# ----------------------------------------------------------------------------------------------
# 2. The block pools: three tiers of one block shape

@dataclass
class Block:
    block_id: int
    ref_count: int = 0   # live block tables that hold this block
    # when it last became cached: the LRU order (an undone step rebuilds it)
    cached_at: int = 0
    # set while the block is registered in the prefix cache (full, computed, immutable):
    # chain hash of its prefix: the block and all before it
    hash: int | None = None
    token_ids: tuple = ()     # this block's tokens
    # exact identity under hash collisions, and how often it was found: section 8
    prefix_id: int | None = None
    parent_prefix_id: int | None = None
    hits: int = 0


# a K/V copy for the engine to make before the model runs: one block of a tier (a Pool) into
# one block of a tier (the same one, for copy-on-write)
BlockCopy = namedtuple("BlockCopy", "src_tier src dst_tier dst")


class Pool:
    """One tier of blocks of one shape: the device pool, the host pool or the disk pool. Each
    block is used (ref_count > 0) or free (ref_count 0); a free block is cached (registered in
    the prefix cache: its K/V reusable until evicted) or empty. Each moves in O(1)."""

    def __init__(self, name, num_blocks):
        self.name = name
        self.blocks = [Block(i) for i in range(num_blocks)]
        # free, nothing worth keeping inside
        self.empty_block_ids = deque(range(num_blocks))
        # free, registered; in LRU order
        self.cached_block_ids = OrderedDict()
        # its part of the prefix cache: chain hash -> ids of blocks under it, ordered
        self.hash_to_block_ids = {}
        # seq_id -> Sequence whose block table holds this pool's block ids
        self.seqs = {}

    @property
    def num_free_blocks(self):
        """Blocks allocatable now: empty ones and cached ones nobody holds (evictable)."""
        return len(self.empty_block_ids) + len(self.cached_block_ids)


def distinct_blocks(seqs):
    """The blocks seqs' tables hold, each once (a block they share too)."""
    return {b for s in seqs for b in s.block_table}


class KVCacheManager:
    """Hands out the blocks of three tiers, fastest first: the device pool, which attention reads;
    the host pool (swapped-out requests, cached blocks evicted from the device); the disk pool
    (cached blocks evicted from the host). Whoever writes K/V calls cache_full_blocks(seq) after;
    every K/V copy decided here is queued in `copies`, for the engine to make."""

    def __init__(self, num_blocks, block_size, num_cpu_blocks=0, enable_prefix_caching=True,
                 num_disk_blocks=0):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.tiers = [Pool("device", num_blocks), Pool("host", num_cpu_blocks),
                      Pool("disk", num_disk_blocks)]
        self.device, self.host, self.disk = self.tiers
        # K/V copies to make before the model runs, in decision order (a later one may
        # overwrite what an earlier one reads): BlockCopy records
        self.copies = deque()
        # exact prefixes: a number for each, never reused (_name_prefix)
        self.prefix_ids = itertools.count()
        self.clock = itertools.count(1)   # ticks for Block.cached_at
        # metrics, counted as they happen, under the names stats() reports (vLLM's where vLLM
        # has one); a name not counted yet reads 0:
        #   prefix_cache_queries     tokens looked up
        #   prefix_cache_hits        tokens found, in any tier
        #   host_prefix_cache_hits   of those, the tokens loaded up from the host tier
        #   disk_prefix_cache_hits   and from the disk tier (the device's are not counted by tier)
        #   num_evictions            cached blocks dropped: their K/V lost to the cache
        #   num_offloaded_blocks     cached blocks written down a tier
        #   num_loaded_blocks        cached blocks read back up to the device
        #   num_write_downs_skipped  evictions dropped: the tiers below full (section 8)
        #   num_cow_copies           shared blocks copied before a write
        #   num_swapped_out_blocks   blocks copied to the host with their request
        #   num_swapped_in_blocks    and back
        self.counts = Counter()

    # -- the hash chain: h[i] = H(h[i-1], tokens of block i), so that one dictionary look-up per
    #    tier finds a block that ends a given prefix
    @staticmethod
    def compute_hash(parent_hash, token_ids):
        # the first block hashes its tokens alone, not (None, *tokens): before Python 3.12
        # hash(None) changes from run to run; tuples of ints hash the same every run
        if parent_hash is None:
            return hash(tuple(token_ids))
        return hash((parent_hash, *token_ids))

    def _tokens(self, seq, i):   # the tokens of seq's block i
        return tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size])

    def _block_hash(self, seq, i):
        """seq's chain hash up to block i, computed once."""
        for j in range(len(seq.block_hashes), i + 1):
            parent_hash = seq.block_hashes[-1] if j > 0 else None
            seq.block_hashes.append(self.compute_hash(parent_hash, self._tokens(seq, j)))
        return seq.block_hashes[i]

    def _lookup(self, tiers, h, tokens, parent):
        """[(tier, block)] registered under hash h with these tokens, after the prefix whose
        prefix_id is parent (None: the first block). Hashes may collide: a block's own tokens
        and its parent's prefix id (section 8) tell its prefix exactly."""
        found = []
        for tier in tiers:
            for block_id in tier.hash_to_block_ids.get(h, ()):
                block = tier.blocks[block_id]
                if block.token_ids == tokens and block.parent_prefix_id == parent:
                    found.append((tier, block))
        return found

    # lab prefix-cache: below, the walk along the hash chain
    def _cache_hits(self, seq):
        """[(tier, block)] holding seq's prefix, found by one walk along its hash chain, each
        where it is (below the device: if loading it beats recomputing, section 8)."""
        hits = []
        tiers = [t for t in self.tiers if self.worth_loading(t)]
        # the last token is always computed (its logits are needed): its block cannot hit.
        # With prefix caching off nothing is registered: the first look-up misses.
        for i in range((len(seq) - 1) // self.block_size):
            # the prefix matched so far
            parent = hits[-1][1].prefix_id if hits else None
            same = self._lookup(tiers, self._block_hash(seq, i), self._tokens(seq, i),
                                parent)
            # below the device, a swapped request's blocks are its own until it comes back
            same = [(t, b) for t, b in same
                    if t is self.device or b.ref_count == 0]
            if not same:
                # a chain: after the first miss no later block can be this prefix's
                break
            # a block somebody holds costs no free block: it goes first
            held = [(t, b) for t, b in same if b.ref_count > 0]
            hits.append((held or same)[0])
        return hits

    def worth_loading(self, tier):
        """Is a block found in tier worth loading, rather than recomputing? Here every tier is;
        BlockManager (section 8) weighs the copy against the recompute."""
        return True

    # -- taking and returning single blocks, in any tier
    @property
    def num_free_blocks(self):
        return self.device.num_free_blocks

    def _get_new_block(self, pool, seq):
        """An empty block of pool (for seq); with none, a cached one, evicted."""
        if not pool.empty_block_ids:
            self._evict(pool, seq)
        return pool.blocks[pool.empty_block_ids.popleft()]

    def _evict(self, pool, seq):
        """Take pool's victim out of the prefix cache, emptied: its K/V are lost (here;
        BlockManager writes them down a tier, section 8)."""
        block_id, why = self.victim(pool)
        del pool.cached_block_ids[block_id]
        self.write_down_or_lose(pool, pool.blocks[block_id], seq, why)
        self._unregister(pool, pool.blocks[block_id])
        pool.empty_block_ids.append(block_id)

    # lab eviction: below, which cached block is evicted
    def victim(self, pool):
        """(the cached block of pool to evict, why): the one freed longest ago, LRU (the eviction
        policy; section 8 has others)."""
        return next(iter(pool.cached_block_ids)), "lru: freed longest ago"

    def write_down_or_lose(self, pool, block, seq, why):
        """An evicted block's K/V (for seq; why: the policy's words): lost to the prefix cache."""
        self.counts["num_evictions"] += 1
        self.record("evict", [], [block.block_id], pool, why=why)

    def _allocate_block(self, seq):   # a new device block for seq
        block = self._get_new_block(self.device, seq)
        block.ref_count = 1
        return block.block_id

    def _hold(self, pool, block):
        """A cached block comes back to life (a held one, or one just taken, is in no list)."""
        pool.cached_block_ids.pop(block.block_id, None)
        block.ref_count += 1

    def _release(self, pool, block):
        """One holder fewer; with none left the block is cached if registered, else empty."""
        block.ref_count -= 1
        if block.ref_count > 0:
            return
        if block.hash is not None:
            self._cache(pool, block)
        else:
            pool.empty_block_ids.append(block.block_id)

    def _cache(self, pool, block):   # the most recently cached: evicted last
        block.cached_at = next(self.clock)
        pool.cached_block_ids[block.block_id] = None

    def _load(self, pool, block, seq):
        """Move a lower tier's block that seq holds up into a new device block (returned): its K/V
        are copied up, its place in the prefix cache goes with them."""
        # evicting first, if it must
        block_id = self._allocate_block(seq)
        self.copies.append(BlockCopy(pool, block.block_id,
                                     self.device, block_id))
        self.record("load", [seq], [block.block_id], pool,
                    [block_id], self.device,
                    why=self.load_figures(pool))
        self._register(self.device, self.device.blocks[block_id], like=block)
        self._unregister(pool, block)
        self._release(pool, block)   # empty: it no longer holds a prefix
        self.counts["num_loaded_blocks"] += 1
        self.counts[f"{pool.name}_prefix_cache_hits"] += self.block_size
        return block_id

    def load_figures(self, tier):
        """For the trace: why a load from tier beats a recompute (BlockManager's cost rule)."""
        return ""

    # -- whole sequences
    def _num_blocks_for(self, num_tokens):
        return (num_tokens + self.block_size - 1) // self.block_size

    def _set_table(self, seq, shared):
        """seq's block table: the blocks it shares (a prefix hit's, a fork's: held already), then
        new device blocks for the rest of its tokens; the shared blocks' tokens count as computed.
        seq now lives in the device pool."""
        seq.num_computed_tokens = min(len(seq), len(shared) * self.block_size)
        seq.block_table = list(shared)
        while len(seq.block_table) < self._num_blocks_for(len(seq)):
            seq.block_table.append(self._allocate_block(seq))
        self.device.seqs[seq.seq_id] = seq

    def can_allocate(self, seq, watermark=0, siblings=()):
        """Would allocating seq leave `watermark` blocks free? A hit on a held device block takes
        no free block; any other hit takes one. siblings: a recomputed request's others."""
        held = [b for _, b in self._cache_hits(seq)
                if b.ref_count > 0]
        need = (self._num_blocks_for(len(seq)) - len(held)
                + self.blocks_for_siblings(seq, siblings))
        return self.num_free_blocks - need >= watermark

    def allocate(self, seq):
        assert not seq.block_table, f"seq {seq.seq_id} already holds blocks"
        hits = self._cache_hits(seq)
        # held first: no block taken below (for a load) can evict one of them
        for pool, block in hits:
            self._hold(pool, block)
            # how often found: the write-down rule's (section 8)
            block.hits += 1
        shared = []
        for pool, block in hits:
            if pool is self.device:
                shared.append(block.block_id)
            else:   # found below: loaded up into a device block
                shared.append(self._load(pool, block, seq))
        self._set_table(seq, shared)
        # a hit ends before the last token
        seq.num_cached_tokens = seq.num_computed_tokens
        if hits:
            self.record("prefix hit", [seq], shared,
                        num_tokens=seq.num_cached_tokens)
        if self.enable_prefix_caching:
            self.counts["prefix_cache_queries"] += len(seq)
            self.counts["prefix_cache_hits"] += seq.num_cached_tokens

    def _needs_new_block(self, seq):
        """The next step writes the K/V of seq's last token; its block may not exist yet."""
        return (len(seq) - 1) // self.block_size == len(seq.block_table)

    def _needs_copy(self, seq):
        # ... or exist but be shared, and a block with ref_count > 1 is never written (both
        # callers ask only once _needs_new_block said no: the last block exists)
        return self.device.blocks[seq.block_table[-1]].ref_count > 1

    def can_append(self, seq):
        return self.num_free_blocks > 0 or not (self._needs_new_block(seq)
                                                or self._needs_copy(seq))

    def append_slot(self, seq):
        """Make sure the slot of seq's last token exists and may be written. Returns (src, dst)
        when a shared block had to be copied first (copy-on-write), else None."""
        # lab copy-on-write: below, a writer of a shared block copies it first
        if self._needs_new_block(seq):
            seq.block_table.append(self._allocate_block(seq))
        elif self._needs_copy(seq):
            # shared and partly filled: this writer gets its own copy
            src = self.device.blocks[seq.block_table[-1]]
            dst = self._allocate_block(seq)
            self.copies.append(BlockCopy(self.device, src.block_id,
                                         self.device, dst))
            self._release(self.device, src)
            seq.block_table[-1] = dst
            self.counts["num_cow_copies"] += 1
            self.record("copy", [seq], [src.block_id],
                        to_ids=[dst])
            return src.block_id, dst
        return None

    # lab copy-on-write: below, a fork shares its parent's blocks
    def fork(self, parent, child, num_blocks=None):
        """child shares parent's first num_blocks blocks (all by default): no K/V copied, their
        ref_counts go up, fresh blocks hold the rest (a recomputed sample's, section 8)."""
        shared = parent.block_table[:num_blocks]
        for block_id in shared:
            self._hold(self.device, self.device.blocks[block_id])
        # its hash chain: computed as asked for, _block_hash
        self._set_table(child, shared)
        self.record("fork", [child], shared,
                    parent=parent.seq_id)

    def blocks_for_siblings(self, leader, siblings):
        """What allocating a recomputed request's other sequences takes: each its own blocks
        (BlockManager: they share the leader's, section 8)."""
        return sum(self._num_blocks_for(len(seq)) for seq in siblings)

    def allocate_sibling(self, leader, seq):
        """A recomputed request's other sequence, admitted with leader: allocated on its own."""
        self.allocate(seq)

    # lab eviction: below, the order free releases blocks in
    def free(self, seq, coming_back=False):
        """Drop seq's hold on its blocks, in whichever pool its table points into, tail first: the
        tail is then evicted before the prefix, which other requests are likelier to share.
        coming_back (preempted, to be recomputed): each counts as found once more."""
        pool = self.host if seq.seq_id in self.host.seqs else self.device
        for block_id in reversed(seq.block_table):
            block = pool.blocks[block_id]
            if coming_back and block.ref_count == 1:
                # by its last holder: once
                block.hits += 1
            self._release(pool, block)
        pool.seqs.pop(seq.seq_id, None)
        seq.block_table = []

    # -- the prefix cache: a full, computed block is registered, so later prompts find it
    def cache_full_blocks(self, seq):
        """Register seq's full, computed blocks in the prefix cache (after a step): only then,
        their K/V in place for good, may another request reuse them."""
        if not self.enable_prefix_caching:
            return
        end = seq.num_computed_tokens // self.block_size
        # registered blocks are a prefix of the table (computed in order; hits and forks hand
        # out registered prefixes): walk back to where registration stops
        start = end
        while (start > 0
               and self.device.blocks[seq.block_table[start - 1]].hash is None):
            start -= 1
        for i in range(start, end):
            block = self.device.blocks[seq.block_table[i]]
            block.hash = self._block_hash(seq, i)
            block.token_ids = self._tokens(seq, i)
            parent = self.device.blocks[seq.block_table[i - 1]].prefix_id if i > 0 else None
            self._name_prefix(block, parent)
            self._register(self.device, block)

    def _name_prefix(self, block, parent):
        """A block being registered (its hash and tokens set), after the prefix whose prefix_id is
        parent (None: the first block): the prefix id of a copy registered in any tier already, else
        a new one (section 8: exact prefixes)."""
        block.parent_prefix_id = parent
        twins = self._lookup(self.tiers, block.hash, block.token_ids, block.parent_prefix_id)
        block.prefix_id = twins[0][1].prefix_id if twins else next(self.prefix_ids)
        block.hits = 0

    def _register(self, pool, block, like=None):
        """Enter block in pool's part of the prefix cache, under its hash; like: the block whose
        K/V it holds a copy of, whose entry it takes (hash, tokens, prefix ids, hits)."""
        if like is not None:
            block.hash = like.hash
            block.token_ids = like.token_ids
            block.prefix_id = like.prefix_id
            block.parent_prefix_id = like.parent_prefix_id
            block.hits = like.hits
        pool.hash_to_block_ids.setdefault(block.hash, {})[block.block_id] = None

    def _unregister(self, pool, block):
        bucket = pool.hash_to_block_ids[block.hash]
        del bucket[block.block_id]
        if not bucket:
            del pool.hash_to_block_ids[block.hash]
        block.hash = None
        block.token_ids = ()
        block.prefix_id = None
        block.parent_prefix_id = None

    # -- swapping: a request's sequences move between the device and the host together, each
    #    distinct block once, so that the blocks they share stay shared
    def can_swap_out(self, *seqs):
        """Each distinct block once (cached host blocks go down to disk)."""
        return len(distinct_blocks(seqs)) <= self.host.num_free_blocks

    def can_swap_in(self, *seqs, watermark=0):
        """Room for the distinct blocks and what the next step writes: a new block for each whose
        last is full; a copy per writer of a shared last block but one (as in append_slot)."""
        writers = [s for s in seqs if len(s) > s.num_computed_tokens]
        new = [s for s in writers if self._needs_new_block(s)]
        last = [s.block_table[-1] for s in writers if s not in new]
        copies = sum(min(last.count(b), self.host.blocks[b].ref_count - 1)
                     for b in set(last))
        return self.num_free_blocks - len(distinct_blocks(seqs)) - len(new) - copies >= watermark

    def swap_out(self, *seqs):
        """Move seqs to the host pool. Returns [(device_block, host_block)], queued in copies."""
        return self._move(seqs, self.device, self.host, "swap out", "num_swapped_out_blocks")

    def swap_in(self, *seqs):
        """Move seqs back to the device pool. Returns [(host_block, device_block)]."""
        return self._move(seqs, self.host, self.device, "swap in", "num_swapped_in_blocks")

    # lab preemption: below, a swap moves a request's blocks between tiers
    def _move(self, seqs, src, dst, kind, counter):
        """Repoint seqs' tables from src to dst, a dst block per distinct block (tail first), and
        count the blocks moved under the metric named counter."""
        mapping = {}   # block id in src -> block id in dst
        for seq in seqs:
            for block_id in reversed(seq.block_table):
                if block_id in mapping:
                    # all taken before any is let go: none taken twice
                    continue
                new = self._get_new_block(dst, seq).block_id
                mapping[block_id] = new
                self.copies.append(BlockCopy(src, block_id, dst, new))
                if src.blocks[block_id].hash is not None:
                    # its copy is found there too
                    self._register(dst, dst.blocks[new], like=src.blocks[block_id])
        self.record(kind, seqs,
                    mapping.keys(), src,
                    mapping.values(), dst)
        for seq in seqs:
            for i in reversed(range(len(seq.block_table))):
                block_id = seq.block_table[i]
                self._hold(dst, dst.blocks[mapping[block_id]])
                self._release(src, src.blocks[block_id])
                seq.block_table[i] = mapping[block_id]
            dst.seqs[seq.seq_id] = src.seqs.pop(seq.seq_id)
        self.counts[counter] += len(mapping)
        return list(mapping.items())

    # -- what the metrics read; what happened
    def num_used_blocks(self):
        return self.num_blocks - self.num_free_blocks

    def record(self, kind, *args, **details):
        """Something happened (the arguments: EventLog.record's). Here nobody listens;
        BlockManager logs it (section 7) for the trace and the view."""

    def take_events(self):
        """What happened since the last call (BlockManager's log; here nothing)."""
        return []

    def explain_prompt(self, request):
        """Before a request's first allocate: where its prompt tokens will come from (here
        nothing; BlockManager, section 8, tells the tier or why each is computed)."""

    def cheaper_mode(self, request):
        """(mode, why) for preemption_mode="auto": swap, the request's blocks to the host and
        back (BlockManager weighs it against a recompute: the cost rule, section 8)."""
        return "swap", ""

# ----------------------------------------------------------------------------------------------
# 3. The scheduler: which tokens run this step

# one sequence's share of a step: it computes num_new_tokens tokens, 1 (a decode) or a chunk
ScheduledSeq = namedtuple("ScheduledSeq", "request seq num_new_tokens")


@dataclass
class ScheduledBatch:
    budget: int   # max_num_batched_tokens
    # ScheduledSeq of each sequence that runs
    entries: list = field(default_factory=list)
    # each token's slot (LLM._prepare fills it)
    slot_mapping: list = field(default_factory=list)
    # the model's seconds on it (LLM._step): compute alone, no wait for copies (the cost rule's)
    model_seconds: float = 0.0

    def __post_init__(self):
        # the entries' tokens, kept as entries come and go: a sum at every add (and is_full)
        # would make scheduling quadratic in the batch's sequences
        self.num_tokens = sum(e.num_new_tokens for e in self.entries)

    @property
    def is_full(self):
        return self.num_tokens == self.budget

    def add(self, request, seq):
        """seq joins the batch; a prompt longer than what is left of the budget is computed in
        chunks (chunked prefill)."""
        chunk = min(len(seq) - seq.num_computed_tokens, self.budget - self.num_tokens)
        self.entries.append(ScheduledSeq(request, seq, chunk))
        self.num_tokens += chunk

    def remove(self, request):
        self.entries = [e for e in self.entries if e.request is not request]
        self.num_tokens = sum(e.num_new_tokens for e in self.entries)


class Scheduler:
    """Continuous batching of requests under a token budget per step (schedule() tells the
    order). Every line (waiting, running, swapped) is kept in rank() order: first come, first
    served here; a PriorityScheduler (section 12) ranks by priority first, and the same code
    serves it. A sequence short of a block preempts the last running request in rank."""

    def __init__(self, block_manager, args, eos_token_ids):
        self.block_manager = block_manager
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_num_seqs = args.max_num_seqs
        self.max_num_batched_tokens = args.max_num_batched_tokens
        self.preemption_mode = args.preemption_mode
        # admitting a prompt leaves this many blocks free, so that the next decodes need not
        # preempt: 1% of the pool unless given (as vLLM)
        self.watermark_blocks = args.watermark_blocks
        if self.watermark_blocks is None:
            self.watermark_blocks = int(0.01 * block_manager.num_blocks)
        # in rank order: preempted requests rank before newer ones
        self.waiting = deque()
        self.running = []        # in rank order
        self.swapped = []        # requests on the host pool, in rank order
        # requests preempted (all their sequences at once), either way
        self.num_preemptions = 0
        # each sequence's id: counted per engine, so every trace numbers its own from 0
        self.seq_ids = itertools.count()

    def has_unfinished(self):
        return bool(self.waiting or self.running or self.swapped)

    def rank(self, request):
        """The order of every line: first come, first served."""
        return request.request_id

    def enqueue(self, line, request):
        """Into waiting, running or swapped, in rank order."""
        bisect.insort(line, request, key=self.rank)

    def _start_running(self, request, batch):
        """The request runs: its sequences with tokens to compute join batch."""
        request.status = RequestStatus.RUNNING
        self.enqueue(self.running, request)
        for seq in request.seqs:
            if self._ready(seq) and not batch.is_full:
                # can_allocate, can_swap_in made room
                self.block_manager.append_slot(seq)
                batch.add(request, seq)

    @staticmethod
    def _ready(seq):
        """Has seq tokens to compute, with the K/V it reads in place? Not a beam waiting for its
        round, nor a recomputed sample whose leader has not computed their shared blocks yet."""
        behind_leader = seq.num_written_tokens < seq.num_computed_tokens
        return not behind_leader and len(seq) > seq.num_computed_tokens

    def schedule(self) -> ScheduledBatch:
        bm = self.block_manager
        batch = ScheduledBatch(self.max_num_batched_tokens)
        num_preemptions = self.num_preemptions
        # 1. running requests, first in rank first, so that decodes keep a steady pace: each
        #    sequence's next token or chunk (a budget run out leaves samples a token apart)
        for request in list(self.running):
            for seq in filter(self._ready, request.seqs):
                if request.status is not RequestStatus.RUNNING or batch.is_full:
                    # preempted (by itself, or for a request ranked before), or no budget
                    break
                # short of a block: preempt the last running request in rank until seq has one;
                # once the last is seq's own request, it gave its blocks back and waits like
                # the others
                # lab preemption: below, the victim
                while request.status is RequestStatus.RUNNING and not bm.can_append(seq):
                    self.preempt(self.running[-1], batch)
                if request.status is RequestStatus.RUNNING:
                    # its copy-on-write, if any, is queued in bm.copies
                    bm.append_slot(seq)
                    batch.add(request, seq)
        # a step that preempted lets nobody in: running requests need the blocks it freed next
        if self.num_preemptions > num_preemptions:
            return batch
        # 2. the next in line, while it fits: a swapped request before any waiting one (nobody
        #    overtakes a preempted request), then the waiting requests, in rank order
        while request := self._next_in_line(batch):
            leader, *others = request.seqs
            # its sequences (all it may fork) beside the running ones' must fit in max_num_seqs
            num_seqs = sum(r.max_num_running_seqs
                           for r in [*self.running, request])
            if num_seqs > self.max_num_seqs:
                break
            # the blocks it must leave free; with nothing running no decode can starve: a
            # request may fill the pool
            watermark = self.watermark_blocks if self.running else 0
            # a swapped request's swap-in may start though the step has no budget left:
            # a prefetch
            if request.status is RequestStatus.SWAPPED:
                if not bm.can_swap_in(*request.seqs, watermark=watermark):
                    break
                self.swapped.remove(request)
                bm.swap_in(*request.seqs)
                self._start_running(request, batch)
                continue
            if not bm.can_allocate(leader, watermark, others):
                # it fits, but would leave too few blocks free
                if bm.can_allocate(leader, 0, others):
                    bm.record("watermark", [leader], num_blocks=watermark)
                break
            self.waiting.popleft()
            self._admit(request, batch)
        return batch

    def _next_in_line(self, batch):
        """The first swapped request, else the first waiting one."""
        if self.swapped:
            return self.swapped[0]
        if self.waiting and not batch.is_full:
            return self.waiting[0]
        return None

    def _admit(self, request, batch):
        """Allocate a waiting request's blocks, all its sequences at once: its tokens are prefill.
        A recomputed n>1 request's other samples come with the first, the leader."""
        leader, *others = request.seqs
        self.block_manager.explain_prompt(request)
        self.block_manager.allocate(leader)
        for seq in others:
            self.block_manager.allocate_sibling(leader, seq)
        for seq in request.seqs:
            seq.prefill_until = len(seq)
        self._start_running(request, batch)

    def _choose_mode(self, request):
        """(mode, why: for the trace): preemption_mode's, or for "auto" the cost rule's."""
        bm = self.block_manager
        if self.preemption_mode == "recompute":
            return "recompute", ""
        if not bm.can_swap_out(*request.seqs):
            return "recompute", "no room for its blocks in the host pool"
        if self.preemption_mode == "swap":
            return "swap", ""
        # auto: the cost rule's (section 8)
        return bm.cheaper_mode(request)

    # lab preemption: below, swap or recompute
    def preempt(self, request, batch, mode=None):
        """Take a running request's blocks back, all at once: swapped to the host pool, to resume
        where it was, or freed (the prefix cache may keep much), to be recomputed, in front."""
        why = ""
        if mode is None:
            mode, why = self._choose_mode(request)
        self.block_manager.record("preempt", request.seqs,
                                  sorted(distinct_blocks(request.seqs)),
                                  mode=mode,
                                  why=f" ({why})" if why else "")
        self.running.remove(request)
        batch.remove(request)
        if mode == "swap":
            self.block_manager.swap_out(*request.seqs)
            request.status = RequestStatus.SWAPPED
            self.enqueue(self.swapped, request)
        else:
            self.recompute(request)
        self.num_preemptions += 1
        return mode

    def recompute(self, request):
        for seq in request.seqs:
            # it will look for its blocks again
            self.block_manager.free(seq, coming_back=True)
            seq.num_computed_tokens = 0
            seq.waits_for = None
            seq.logprobs = None   # a beam computes its log-probs again
        request.status = RequestStatus.WAITING
        # in rank order: before newer requests
        self.enqueue(self.waiting, request)

    def postprocess(self, batch, sampled):
        """After the model ran: advance each sequence, register its newly full blocks, append the
        tokens sampled (seq -> token ids), finish the sequences that are done."""
        now = time.perf_counter()
        for request, seq, num_new in batch.entries:
            seq.num_computed_tokens += num_new
            seq.waits_for = None   # it ran, so what it shares was in place
            self.block_manager.cache_full_blocks(seq)
            if seq not in sampled:
                # in the middle of its prompt, or a beam (the engine picks beams)
                continue
            tokens = sampled[seq]
            request.first_token_time = request.first_token_time or now
            # n tokens: an n>1 request's first, from one prompt's logits: its samples fork here
            samples = [seq]
            for index in range(1, len(tokens)):
                samples.append(self.fork_seq(request, seq, index))
            for s, token in zip(samples, tokens):
                s.append_token(token)
                if token in self.eos_token_ids and not request.params.ignore_eos:
                    self.finish(request, s, "stop")
                elif s.num_output_tokens >= request.params.max_tokens:
                    self.finish(request, s, "length")

    def fork_seq(self, request, parent, index=0):
        """A new sequence of request with parent's tokens (its prompt as long): sample `index`
        (or a beam), sharing parent's blocks."""
        child = Sequence(next(self.seq_ids), parent.token_ids, parent.request_id, index)
        child.num_prompt_tokens = parent.num_prompt_tokens
        self.block_manager.fork(parent, child)
        request.seqs.append(child)
        return child

    def finish(self, request, seq, reason):
        seq.finish_reason = reason
        seq.finish_time = time.perf_counter()
        self.block_manager.record("finish", [seq], seq.block_table,
                                  reason=reason)
        self.block_manager.free(seq)
        request.seqs.remove(seq)
        request.finished.append(seq)
        if not request.seqs:
            self.running.remove(request)
            request.status = RequestStatus.FINISHED

# ----------------------------------------------------------------------------------------------
# 4. The engine

# what generate() returns. outputs: n CompletionOutputs by sample index, finish_reason "stop"
# (eos) or "length", token_ids after the prompt; ttft, tpot: seconds to the first token, and
# per later one; num_cached_tokens: the prompt's tokens found in the prefix cache, by tier in
# cached_by_tier; computed_by_reason: the others, by why they were computed (section 8)
RequestOutput = namedtuple("RequestOutput", "request_id prompt_token_ids outputs ttft tpot "
                           "num_cached_tokens cached_by_tier computed_by_reason")
CompletionOutput = namedtuple("CompletionOutput", "index token_ids text finish_reason")

# what one step did, for whoever watches (LLM.on_step): its number, the ScheduledBatch it ran
# (the model's seconds on it too), the events it caused, the metrics after it (stats())
StepReport = namedtuple("StepReport", "step batch events stats")


def sample(logits, request, i, best):
    """One token for sample i of request. logits: (vocab,) float32 on the CPU; best: its argmax,
    the greedy pick (the engine takes every row's in one call, not one call a row)."""
    params = request.params
    if params.temperature == 0:
        return best
    logits = logits / params.temperature
    if params.top_k:
        kth = torch.topk(logits,
                         min(params.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1:
        sorted_logits, order = logits.sort(descending=True)
        probs = sorted_logits.softmax(-1)
        # the tokens after top_p is reached are dropped; the rest back in vocabulary order
        drop = probs.cumsum(-1) - probs >= params.top_p
        logits = logits.scatter(0, order,
                                sorted_logits.masked_fill(drop, float("-inf")))
    return int(torch.multinomial(logits.softmax(-1), 1,
                                 generator=request.generators[i]))


def as_tensor(values, dtype, device):
    """torch.tensor(values, dtype=dtype, device=device) for a list of ints, through an array:
    torch.tensor reads a list an element at a time (~60 ns each, thousands a step), frombuffer
    takes the array's memory whole."""
    # one value more, cut off after: frombuffer takes no empty buffer
    buffer = array.array("q", [*values, 0])
    return torch.frombuffer(buffer, dtype=torch.long)[:-1].to(device, dtype)


@dataclass(frozen=True)
class EngineArgs:
    """Every knob of the engine, vLLM's names (LLM checks each: section 5)."""
    # None/"smollm2": the default model; a local directory; "random:<preset>" (model.PRESETS)
    model: str | None = None
    device: str | None = None   # None: cuda if available, else cpu
    # None: float32 on a CPU, bfloat16 on CUDA
    dtype: str | None = None
    block_size: int = 16        # tokens a block holds
    # the device pool; None: from a memory budget (Engine._num_device_blocks)
    num_blocks: int | None = None
    # the host pool: swapped requests, cached blocks evicted
    num_cpu_blocks: int = 0
    # the disk pool: cached blocks evicted from the host (section 9)
    num_disk_blocks: int = 0
    # the disk pool's file; None: a temporary one
    disk_path: str | None = None
    enable_prefix_caching: bool = True
    # which cached device block goes: "lru", "fifo", "lfu" or "leaf" (section 8)
    eviction_policy: str = "lru"
    max_num_seqs: int = 256     # sequences running at once, at most
    max_num_batched_tokens: int = 2048   # tokens a step computes, at most
    # a request's tokens, at most; None: the model's
    max_model_len: int | None = None
    # "recompute", "swap" or "auto" (the cost rule, section 8)
    preemption_mode: str = "auto"
    seed: int = 0
    # "auto" (the model's dtype) or "int8" (section 9)
    kv_cache_dtype: str = "auto"
    # the host's and disk's: "auto" (as the device's)
    offload_kv_cache_dtype: str = "auto"
    # copies between tiers in the background (section 9)
    async_copies: bool = True
    # emulated links: {"host": GB/s, "disk": GB/s}
    tier_gbps: dict | None = None
    # "fcfs" or "priority" (section 12)
    scheduling_policy: str = "fcfs"
    # a priority level better every K steps waited
    priority_aging_steps: int = 0
    # blocks admitting a prompt leaves free for running decodes; None: 1% of the pool
    watermark_blocks: int | None = None


class Engine:
    """The engine: owns the model, the KV cache pools, the block manager and the scheduler.
    generate() adds requests and runs step() (one batch through the model) until they finish.
    Engine(model, args): a Llama (model.py) on its device, its knobs (EngineArgs). LLM, section 5,
    is the engine with every refinement, and loads its model: LLM("random:tiny", block_size=4)."""

    def __init__(self, model, args, tokenizer=None, eos_token_ids=()):
        self.model = model
        self.tokenizer = tokenizer
        self.device = model.embed_tokens.weight.device
        self.dtype = model.embed_tokens.weight.dtype
        self.max_model_len = args.max_model_len or model.config.max_position_embeddings
        # the pools' K/V by tier: the device's, which attention reads, the host's
        self.kv_caches = self._allocate_kv_caches(args)
        self.kv_cache = self.kv_caches["device"]
        # callables that get every step's StepReport
        self.on_step = []
        self.block_manager = self._make_block_manager(args)
        self.scheduler = self._make_scheduler(args, eos_token_ids)
        self.seed = args.seed
        self.request_ids = itertools.count()
        # request_id -> Request, until its output is returned
        self.requests = {}
        self.num_steps = 0
        self.num_prefill_tokens_computed = 0
        self.num_generated_tokens = 0

    # -- the parts
    def _block_shape(self, args):
        """(shape, dtype) of a block: K and V of block_size tokens in every layer, one block id for
        all layers."""
        cfg = self.model.config
        return (2, cfg.num_layers, args.block_size, cfg.num_kv_heads, cfg.head_dim), self.dtype

    def _num_device_blocks(self, args, block_bytes):
        """The device pool: num_blocks, or by default on CUDA 80% of what the weights leave free
        (vLLM's gpu_memory_utilization), on a CPU 1 GiB."""
        if args.num_blocks is not None:
            return args.num_blocks
        cuda = self.device.type == "cuda"
        budget = 0.8 * torch.cuda.mem_get_info(self.device)[0] if cuda else 2**30
        return max(1, int(budget // block_bytes))

    def _allocate_kv_caches(self, args):
        """{tier: K/V of its blocks}, each (2, num_layers, num_blocks, block_size, kv_heads,
        head_dim): the device pool, and the host pool (swapped requests)."""
        block, dtype = self._block_shape(args)
        num_blocks = self._num_device_blocks(args, math.prod(block) * dtype.itemsize)
        device = torch.zeros(block[:2] + (num_blocks,) + block[2:], dtype=dtype, device=self.device)
        return {"device": device, **self._lower_pools(args, block, dtype)}

    def _lower_pools(self, args, block, dtype):
        """The pools below the device: here the host's, of the device's blocks."""
        host = torch.zeros(block[:2] + (args.num_cpu_blocks,) + block[2:], dtype=dtype)
        return {"host": host}

    def _make_block_manager(self, args):
        return KVCacheManager(self.kv_cache.shape[2], args.block_size, args.num_cpu_blocks,
                              args.enable_prefix_caching)

    def _make_scheduler(self, args, eos_token_ids):
        return Scheduler(self.block_manager, args, eos_token_ids)

    # -- requests in
    def add_requests(self, prompts, params=None, kind=Sampling, priority=None):
        """Queue prompts (see generate): their request ids. params None: kind's defaults."""
        if not isinstance(params, (list, tuple)):
            params = [params or kind()] * len(prompts)
        token_ids = [self.tokenizer.encode(p, add_special_tokens=False) if isinstance(p, str)
                     else list(p)
                     for p in prompts]
        return self._queue(zip(token_ids, params, priority or [0] * len(prompts)))

    def _queue(self, requests):
        """requests: (token_ids, params, priority) each, queued as waiting Requests: their ids."""
        request_ids = []
        for token_ids, p, priority in requests:
            request_id = next(self.request_ids)
            seed = p.seed
            if seed is None:
                seed = (self.seed * 1_000_003 + request_id) % 2**63
            request = Request(request_id, token_ids, p, seed, priority,
                              next(self.scheduler.seq_ids))
            self.requests[request_id] = request
            self.scheduler.enqueue(self.scheduler.waiting, request)
            request_ids.append(request_id)
        return request_ids

    def generate(self, prompts, params=None, priority=None):
        """prompts: a list of strings or of token-id lists; params: one for all (None:
        Sampling's defaults), or one per prompt; priority: None, or an int per prompt (lower goes
        first, with a PriorityScheduler, section 12). Returns a RequestOutput per prompt."""
        return self._run_to_end(self.add_requests(prompts, params, Sampling, priority))

    def _run_to_end(self, request_ids):
        """Step until the requests finish: their outputs, taken out."""
        requests = [self.requests[r] for r in request_ids]
        while any(r.status is not RequestStatus.FINISHED for r in requests):
            self.step()
        return [self.output(request_id) for request_id in request_ids]

    def output(self, request_id):
        """A finished request's RequestOutput, taken out."""
        out = self._output(self.requests[request_id])
        # only once its output is made: an error there loses nothing
        del self.requests[request_id]
        return out

    def _output(self, request):
        seqs = sorted(request.finished, key=lambda s: s.index)
        outs = [CompletionOutput(s.index, s.output_token_ids,
                                 self._detokenize(s.output_token_ids), s.finish_reason)
                for s in seqs]
        ttft = request.first_token_time - request.arrival_time
        tpot = sum((s.finish_time - request.first_token_time)
                   / max(1, s.num_output_tokens - 1)
                   for s in seqs) / len(seqs)
        return RequestOutput(request.request_id, request.prompt_token_ids, outs, ttft, tpot,
                             *self._prompt_record(request))

    def _prompt_record(self, request):
        """(num_cached_tokens, cached_by_tier, computed_by_reason): the prompt tokens found at
        the first sample's last allocate (LLM's say where, and why the others were computed)."""
        return request.finished[0].num_cached_tokens, {}, {}

    def _detokenize(self, token_ids):
        """Their text ("" without a tokenizer: random weights)."""
        return self.tokenizer.decode(token_ids, skip_special_tokens=True) if self.tokenizer else ""

    # -- one step
    def step(self):
        """One engine step (the story is in _step); whoever watches (on_step) gets its report."""
        report = self._step_report()
        for callback in self.on_step:
            callback(report)
        return report

    def _step_report(self):
        batch = self._step()
        self.num_steps += 1
        return StepReport(self.num_steps, batch, self.block_manager.take_events(), self.stats())

    def _step(self):
        batch = self.scheduler.schedule()
        assert batch.entries, "the scheduler found nothing to run: a request outgrew its bound"
        # 1. the block copies scheduling queued (copy-on-write, swaps, tiers), before any K/V
        #    write; a request whose blocks are still on their way (LLM's copies in the
        #    background, section 9) sits the step out
        batch = self._make_copies(batch)
        # 2. the batch as tensors (model.Batch), and the sequences whose logits are sampled
        model_batch, to_sample = self._prepare(batch)
        # 3. the model writes every new token's K/V into its slot and returns logits to sample,
        #    (len(to_sample), vocab) float32, and whether each token's hidden state is finite
        t0 = time.perf_counter()
        logits, finite = self.model(model_batch, self.kv_cache)
        logits = logits.cpu()
        batch.model_seconds = time.perf_counter() - t0
        self._check_finite(batch, to_sample, logits, finite)
        # 4. sampling, each sample from its own random stream (an n>1 request's first token: n
        #    draws, it forks on them in postprocess)
        sampled = self._sample(to_sample, logits)
        # 5. metrics (the prefill tokens computed are counted in _prepare), then the scheduler
        #    advances the sequences
        self.num_generated_tokens += sum(len(t) for t in sampled.values())
        self.scheduler.postprocess(batch, sampled)
        return batch

    def _make_copies(self, batch):
        """Make the queued copies in order, each a block's K and V in all layers, blocking (a host
        block written from the device may be read for the disk next); made, one leaves the queue.
        Returns the batch, whose requests may all run."""
        copies = self.block_manager.copies
        while copies:
            self._copy_block(*copies[0])
            copies.popleft()
        return batch

    def _copy_block(self, src_tier, src, dst_tier, dst):
        self.kv_caches[dst_tier.name][:, :, dst].copy_(self.kv_caches[src_tier.name][:, :, src])

    def _check_finite(self, batch, to_sample, logits, finite):
        """NaN or inf from the model: not checked here (LLM raises, section 10)."""

    def _prepare(self, batch):
        """ScheduledBatch -> (model.Batch, to_sample: [(request, seq)]). Shapes: see model.Batch.
        It counts the step's prefill tokens too (the metric num_prefill_tokens_computed)."""
        block_size = self.block_manager.block_size
        input_ids, positions, logits_indices, to_sample = [], [], [], []
        query_start_loc, context_lens = [0], []
        for request, seq, num_new in batch.entries:
            # this step computes positions start .. end - 1
            start = seq.num_computed_tokens
            end = start + num_new
            # prefill: the positions before prefill_until
            self.num_prefill_tokens_computed += max(0, min(end, seq.prefill_until) - start)
            input_ids += seq.token_ids[start:end]
            positions += range(start, end)
            # each token's slot, kept in the batch too: the trace shows where decodes write
            # lab block-table: below, the slot mapping
            batch.slot_mapping += [seq.block_table[p // block_size] * block_size + p % block_size
                                   for p in range(start, end)]
            query_start_loc.append(query_start_loc[-1] + num_new)
            context_lens.append(end)
            if end == len(seq):
                # the chunk reaches the last token: its logits sample
                logits_indices.append(query_start_loc[-1] - 1)
                to_sample.append((request, seq))
        tables = [e.seq.block_table for e in batch.entries]
        max_blocks = max(map(len, tables))
        # the block tables row after row, each padded to the longest (the padding is masked)
        block_tables = [b for t in tables
                        for b in t + [0] * (max_blocks - len(t))]
        int64 = functools.partial(as_tensor, dtype=torch.long, device=self.device)
        int32 = functools.partial(as_tensor, dtype=torch.int32, device=self.device)
        model_batch = Batch(input_ids=int64(input_ids),
                            positions=int64(positions),
                            slot_mapping=int64(batch.slot_mapping),
                            block_tables=int32(block_tables).view(len(tables), max_blocks),
                            context_lens=int32(context_lens),
                            query_start_loc=int32(query_start_loc),
                            logits_indices=int64(logits_indices),
                            max_query_len=max(e.num_new_tokens for e in batch.entries),
                            max_context_len=max(context_lens))
        return model_batch, to_sample

    def stats(self):
        """The metrics (LLM's, section 7, are vLLM's): here the block manager's counts."""
        return dict(self.block_manager.counts)

    def _sample(self, to_sample, logits):
        """{seq: its tokens}, one (n for an n>1 request's first token) a sequence that samples.
        The greedy picks, every row's argmax, come from one call."""
        sampled = {}
        greedy = logits.argmax(-1).tolist()
        for (request, seq), row, best in zip(to_sample, logits, greedy):
            sampled[seq] = []
            for i in [seq.index] if request.past_first_token else range(request.params.n):
                sampled[seq].append(sample(row, request, i, best))
        return sampled

# ==============================================================================================
# reading path ends here. Above, a plain engine that runs by itself; below, sections 5-14, for a
# second reading: every refinement, a subclass or an override of a hook the plain code defines
# ==============================================================================================

# ----------------------------------------------------------------------------------------------
# 5. LLM, the engine with every refinement; the knobs and the API guards: bad input stops at the
#    API, before anything changes or any work starts

from kernel import dequantize, quantize   # noqa: E402 (INT8 tiers, section 9)
# transformers is imported only when a model is loaded
from model import load_model   # noqa: E402


@dataclass(frozen=True)
class SamplingParams(Sampling):
    """Sampling, each field checked as it is made (a ValueError naming it)."""

    def __post_init__(self):
        check_fields(self)


@dataclass(frozen=True)
class BeamSearchParams:
    """LLM.beam_search: the beam_width likeliest continuations (section 11)."""
    beam_width: int
    max_tokens: int = 16
    # score = cum_logprob / length ** length_penalty
    length_penalty: float = 1.0
    ignore_eos: bool = False
    # the most sequences the request holds at once (what the pool is sized by): beam_width
    n: int = field(init=False, repr=False)
    seed = None   # (a beam draws nothing)

    def __post_init__(self):
        # frozen: set once, as it is made
        object.__setattr__(self, "n", self.beam_width)
        check_fields(self)   # each a ValueError naming it


class LLM(Engine):
    """The engine with every refinement: its knobs checked, its model loaded by name, the tiers
    below the device (INT8, the disk file, copies in the background, the cost rule), priorities,
    beam search, why each prompt token missed the cache, the undo of a step that raises, the
    events and metrics, the live view. Its knobs are EngineArgs': LLM("random:tiny",
    block_size=4, num_blocks=24)."""

    def __init__(self, model=None, **kwargs):
        # every knob is checked (a ValueError) before the model loads, which takes seconds
        args = EngineArgs(model, **kwargs)
        check_fields(args)
        check_engine_args(args)
        self.events = EventLog()   # what happened, as records (section 7)
        default = "cuda" if torch.cuda.is_available() else "cpu"
        device = torch.device(args.device or default)
        # dtype: a name (FLOATS), torch's dtype, or None: the device's usual one
        dtype = (FLOATS.get(args.dtype, args.dtype)
                 or (torch.bfloat16 if device.type == "cuda" else torch.float32))
        model, tokenizer, eos_token_ids = load_model(args.model, device, dtype, args.seed)
        super().__init__(model, args, tokenizer, eos_token_ids)
        # the copies between tiers in the background (async_copies, section 9)
        self.copy_engine = CopyEngine(self) if args.async_copies else None
        # prompt's token ids -> the sequence that pins its blocks (pin)
        self.pins = {}

    def _block_shape(self, args):
        """An INT8 cache (kv_cache_dtype="int8") holds each row's scale too: section 9."""
        block, dtype = super()._block_shape(args)
        if args.kv_cache_dtype != "int8":
            return block, dtype
        return block[:-1] + (kv_row(block[-1], torch.int8),), torch.int8

    def _num_device_blocks(self, args, block_bytes):
        """Engine's, then the pools checked against this machine's memory, max_model_len against
        the model's (section 5)."""
        num_blocks = super()._num_device_blocks(args, block_bytes)
        check_loaded_model(self, args, num_blocks)
        return num_blocks

    def _lower_pools(self, args, block, dtype):
        """Host memory (pinned on CUDA) and a file mapped into memory, in offload_kv_cache_dtype
        (section 9)."""
        low_dtype, low_block = offload_block(args, block, self.model.config.head_dim, dtype)
        host_shape, disk_shape = (low_block[:2] + (n,) + low_block[2:]
                                  for n in (args.num_cpu_blocks, args.num_disk_blocks))
        pinned = self.device.type == "cuda"
        return {"host": torch.zeros(host_shape, dtype=low_dtype, pin_memory=pinned),
                "disk": open_disk_pool(args.disk_path, disk_shape, low_dtype)}

    def _make_block_manager(self, args):
        """A BlockManager logging to self.events, with the cost rule: the block copier between
        the tiers (its links as slow as tier_gbps says), each tier's block copy timed now, the
        model's time a token after every step."""
        self.copier = BlockCopier(self.kv_caches, args.tier_gbps or {})
        cost = CostModel.measure(self.kv_caches, self.copier, args.block_size)
        self.on_step.append(cost.observe)
        policy = EVICTION_POLICIES[args.eviction_policy]
        return policy(self.kv_cache.shape[2], args.block_size, args.num_cpu_blocks,
                      args.enable_prefix_caching, self.events,
                      args.num_disk_blocks, cost)

    def _make_scheduler(self, args, eos_token_ids):
        """scheduling_policy="priority": the lines ordered by each request's priority (section
        12)."""
        policy = PriorityScheduler if args.scheduling_policy == "priority" else Scheduler
        return policy(self.block_manager, args, eos_token_ids)

    # -- requests in, checked; the view; a call that raises drops its requests
    def add_requests(self, prompts, params=None, kind=SamplingParams, priority=None):
        """Validate all, then queue all: a bad prompt leaves the engine as it was. Returns ids.
        priority: None, or an int per prompt (scheduling_policy="priority": lower goes first)."""
        # every prompt tokenized and checked (ValueError) before any is queued (section 5)
        checked = checked_requests(self, prompts, params, kind, priority)
        with Interrupts():   # Ctrl-C waits until all are queued (section 10)
            return self._queue(checked)

    def generate(self, prompts, params=None, live=False, priority=None):
        """prompts: a string, a list of strings or of token-id lists; params: one for all, or one
        per prompt; live: watch it in the terminal (View); priority: see add_requests. Returns a
        RequestOutput per prompt."""
        return self._run(prompts, params, SamplingParams, live, priority)

    def beam_search(self, prompts, params, live=False, priority=None):
        """The beam_width likeliest continuations of each prompt: a BeamSearchOutput per prompt."""
        return self._run(prompts, params, BeamSearchParams, live, priority)

    def _run(self, prompts, params, kind, live, priority):
        """Queue, step, return the outputs; a call that raises (Ctrl-C too) drops its requests."""
        check_args(live=live)   # a bool, or a ValueError
        # filled in place: the drop below sees what was queued when it runs
        request_ids = []
        # if anything below raises, this call's requests are dropped with their blocks (section 10)
        with recovery(lambda: self.abort(request_ids)):
            with Interrupts():   # queued and known here, or not queued at all
                request_ids += self.add_requests(prompts, params, kind, priority)
            # live: the view (section 13)
            with View(self) if live else contextlib.nullcontext():
                return self._run_to_end(request_ids)

    def output(self, request_id):
        """A finished request's RequestOutput (BeamSearchOutput for beam search), taken out."""
        request = self.requests.get(request_id) if is_int(request_id) else None
        require(request is not None and request.status is RequestStatus.FINISHED,
                f"request {request_id} is unknown, unfinished or already returned")
        return super().output(request_id)

    def _output(self, request):
        """Beam search: the best hypotheses, by vLLM's score (section 11)."""
        if request.is_beam_search:
            return beam_output(self, request)
        return super()._output(request)

    def _prompt_record(self, request):
        """Where each prompt token was found, why the others were computed (section 8)."""
        return breakdown(request.sources)

    # -- a step: undone if it raises; copies in the background; NaN stops it; beams
    def _step_report(self):
        require(self.scheduler.has_unfinished(), "step(): nothing to run; add_requests() first")
        self.events.step = self.num_steps + 1
        # if it raises, what it changed is put back first (section 10)
        with recovery(Undo(self).restore):
            return super()._step_report()

    def _step(self):
        batch = super()._step()
        # beam search (section 11): a round once every live beam of a request has log-probs
        for request in list(self.scheduler.running):
            if request.is_beam_search and all(b.logprobs is not None for b in request.seqs):
                self.num_generated_tokens += beam_round(self.scheduler, request)
        return batch

    def _make_copies(self, batch):
        """By default (async_copies) the copy engine makes them in the background, and a request
        whose blocks are still on their way sits the step out (section 9)."""
        if self.copy_engine is None:
            return super()._make_copies(batch)
        return self.copy_engine.start(self, batch)

    def _copy_block(self, *copy):
        """Through the block copier: converted between the tiers' dtypes, over emulated links."""
        self.copier.copy(*copy)

    def _check_finite(self, batch, to_sample, logits, finite):
        """NaN or inf (the model broken) in the logits, or in any token's hidden state (finite: (T,)
        bool), raise before any token is sampled or any block registered, naming the step and the
        requests; the step is undone, as after any error. Every chunk is checked, one that samples
        nothing too: K/V written from a NaN are never found by a later prompt. (An INT8 cache would
        turn them into zeros, and the last chunk's logits could come out finite.)"""
        broken = (~logits.isfinite()).any(-1).tolist()   # (rows,)
        ids = {request.request_id
               for (request, _), bad in zip(to_sample, broken) if bad}
        if not finite.all():
            # each sequence's tokens in the step, in order
            sizes = [e.num_new_tokens for e in batch.entries]
            for entry, rows in zip(batch.entries, finite.split(sizes)):
                if not rows.all():
                    ids.add(entry.request.request_id)
        if ids:
            raise FloatingPointError(f"step {self.events.step}: requests {_ids(sorted(ids))}: "
                                     "NaN/inf in their logits or hidden states: the model's "
                                     "weights or inputs are broken")

    def _sample(self, to_sample, logits):
        """A beam keeps its log-probs for the round (section 11); the others sample."""
        beams = [r.is_beam_search for r, _ in to_sample]
        if not any(beams):
            return super()._sample(to_sample, logits)
        for (request, seq), row in zip(to_sample, logits):
            if request.is_beam_search:
                seq.logprobs = row.log_softmax(-1)
        rows = [i for i, beam in enumerate(beams) if not beam]
        return super()._sample([to_sample[i] for i in rows], logits[rows])

    def stats(self):
        return engine_stats(self)   # (section 7)

    # -- undo (section 10)
    def pin(self, prompt):
        """Keep prompt's full blocks cached on the device through any eviction, until
        unpin(prompt): computed now where not found, then held by a sequence of the pin's own (not
        free; the view marks them). Between requests: a ValueError, before anything changes,
        while any is in flight, or if they are more than the pool can spare beside the other pins
        and what its own request needs."""
        token_ids = tokenize(self, prompt)
        require(tuple(token_ids) not in self.pins, "pin: this prompt is pinned already")
        bm = self.block_manager
        num_blocks = len(token_ids) // bm.block_size
        require(not self.scheduler.has_unfinished(), "pin: only while no request is in flight")
        # beside the pins, room for its own request
        need = max_blocks_needed(self, len(token_ids), SamplingParams(max_tokens=1))
        spare = bm.num_blocks - self.num_pinned_blocks() - need
        require(num_blocks <= spare, f"pin: the prompt's {num_blocks} full blocks are more than "
                f"the device pool can spare: {spare} of {bm.num_blocks}, beside those pinned and a "
                "request's")
        self.generate([token_ids], SamplingParams(max_tokens=1))
        seq = Sequence(next(self.scheduler.seq_ids), token_ids + [0])
        bm.pin(seq)
        self.pins[tuple(token_ids)] = seq

    def unpin(self, prompt):
        """Let prompt's pinned blocks go: cached, the most recently used."""
        seq = self.pins.pop(tuple(tokenize(self, prompt)), None)
        require(seq is not None, "unpin: this prompt is not pinned")
        self.block_manager.free(seq)

    def num_pinned_blocks(self):
        return sum(len(seq.block_table) for seq in self.pins.values())

    def start_over(self, unmade):
        """Every request the pools hold lets go of its blocks, to be recomputed; the pools keep the
        prefix cache, but for the blocks that the copies in unmade (never made) were to write."""
        sched, bm = self.scheduler, self.block_manager
        lost = bm.put_back_sources(unmade)
        holders = sorted(sched.running + sched.swapped,
                         key=lambda r: r.request_id, reverse=True)
        sched.running = []
        sched.swapped = []
        for request in holders:
            # the newest first, so that the oldest ends in front
            # its blocks stamped as freeing them would (tail first; a shared block at its last
            # holder), for the rebuild's LRU order; then it lets go of them, to be recomputed
            pool = bm.host if request.status is RequestStatus.SWAPPED else bm.device
            for seq in request.seqs:
                for block_id in reversed(seq.block_table):
                    pool.blocks[block_id].cached_at = next(bm.clock)
                seq.block_table = []
            sched.recompute(request)
        for pool in bm.tiers:   # nobody holds a block; the registered stay cached
            bm.rebuild_pool(pool, lost)
        for seq in self.pins.values():   # pinned again
            seq.block_table = []
            bm.pin(seq)

    def abort(self, request_ids):
        """Drop a failed call's requests wherever they are, and their blocks."""
        sched = self.scheduler
        for request_id in request_ids:
            request = self.requests.pop(request_id, None)
            if request is not None:
                for line in (sched.waiting, sched.running, sched.swapped):
                    if request in line:
                        line.remove(request)
                for seq in request.seqs:
                    self.block_manager.free(seq)
                request.status = RequestStatus.FINISHED
        # stopped between steps, copies still on their way: given up (however slow the links), and
        # the requests left recompute, as after an undone step (the copies not made never trusted)
        if self.copy_engine and not self.copy_engine.idle():
            self.start_over(self.copy_engine.give_up(self.copier))


def require(ok, message):
    """A ValueError saying what is wrong and what is allowed."""
    if not ok:
        raise ValueError(message)


def is_int(x):
    """True is an int to Python, not to us."""
    return isinstance(x, int) and not isinstance(x, bool)


def is_number(x):   # a finite int or float
    return (is_int(x) or isinstance(x, float)) and math.isfinite(x)


def is_list(x):   # a list or a tuple
    return isinstance(x, (list, tuple))


# logits / temperature overflow float32 near 1e-38; 0 means greedy
MIN_TEMPERATURE = 0.01
# top_p is compared with float32 probabilities, where 1e-300 is 0
MIN_TOP_P = 1e-6
# 131072 ** 10 is about 1e51: no overflow, no division by zero
MAX_LENGTH_PENALTY = 10
# a count's most: a step's int32 tensors (block ids, offsets) hold it
MAX_COUNT = 2**31 - 1
# the slowest link emulated, a byte a second (1e-300: past any timer)
MIN_GBPS = 1e-9
FLOATS = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def count_rule(low, none=""):
    """ARG_RULES' rule for a count: an int from low to MAX_COUNT; none: "None or " where the
    knob's default is None."""
    allowed = f"{none}an int in [{low}, {MAX_COUNT}]"
    return lambda x: is_int(x) and low <= x <= MAX_COUNT, allowed


# every knob of EngineArgs, SamplingParams and BeamSearchParams checked on its own: (is a value
# allowed?, what is allowed). None, where a knob's default is None, means the default
# (check_fields). device and disk_path, and the rules across knobs, come after
ARG_RULES = {
    "model": (lambda x: isinstance(x, str), "None, a directory or 'random:<preset>'"),
    "dtype": (lambda x: x in [*FLOATS, *FLOATS.values()],
              "None, 'float32', 'bfloat16', 'float16' (or torch's)"),
    # a power of two: one bit set
    "block_size": (lambda x: is_int(x) and x >= 1 and x & (x - 1) == 0,
                   "a positive power of two (1, 2, 4, ... 16 ...)"),
    "preemption_mode": (lambda x: x in ("recompute", "swap", "auto"),
                        "'recompute', 'swap' or 'auto'"),
    "scheduling_policy": (lambda x: x in ("fcfs", "priority"), "'fcfs' or 'priority'"),
    "eviction_policy": (lambda x: x in EVICTION_POLICIES, "'lru', 'fifo', 'lfu' or 'leaf'"),
    "seed": (lambda x: is_int(x) and 0 <= x < 2**63, "an int in [0, 2**63)"),
    "temperature": (lambda x: is_number(x) and (x == 0 or x >= MIN_TEMPERATURE),
                    f"0 (greedy) or a number >= {MIN_TEMPERATURE}"),
    "top_p": (lambda x: is_number(x) and MIN_TOP_P <= x <= 1,
              f"a number in (0, 1], at least {MIN_TOP_P}"),
    # a finite power: see MAX_LENGTH_PENALTY
    "length_penalty": (lambda x: is_number(x) and abs(x) <= MAX_LENGTH_PENALTY,
                       f"a number in [-{MAX_LENGTH_PENALTY}, {MAX_LENGTH_PENALTY}]"),
    "tier_gbps": (lambda x: isinstance(x, dict) and all(
        k in ("host", "disk") and is_number(v) and v >= MIN_GBPS
        for k, v in x.items()),
                  f"None or a dict of GB/s >= {MIN_GBPS} (a byte a second) by tier, such as "
                  "{'host': 16, 'disk': 2}"),
    "watermark_blocks": count_rule(0, "None or "),
    # the rules several knobs share
    **dict.fromkeys(["kv_cache_dtype", "offload_kv_cache_dtype"],
                    (lambda x: x in ("auto", "int8"), "'auto' (the model's dtype) or 'int8'")),
    # None: num_blocks from a memory budget, max_model_len the model's
    **dict.fromkeys(["num_blocks", "max_model_len"], count_rule(1, "None or ")),
    # top_k 0: every token; priority_aging_steps 0: no aging
    **dict.fromkeys(["num_cpu_blocks", "num_disk_blocks", "top_k", "priority_aging_steps"],
                    count_rule(0)),
    **dict.fromkeys(["max_num_seqs", "max_num_batched_tokens", "max_tokens", "n", "beam_width"],
                    count_rule(1)),
    **dict.fromkeys(["enable_prefix_caching", "ignore_eos", "live", "async_copies"],
                    (lambda x: isinstance(x, bool), "a bool")),
}


def check_args(**args):   # each by its rule in ARG_RULES
    for name, x in args.items():
        allowed, what = ARG_RULES[name]
        require(allowed(x), f"{name} must be {what}, got {x!r}")


def check_fields(params):
    """Each field of a dataclass of knobs by its rule in ARG_RULES: a None where None is the
    default means the default (SamplingParams.seed); fields with no rule (EngineArgs' device and
    disk_path) are check_engine_args'."""
    for f in dataclasses.fields(params):
        value = getattr(params, f.name)
        if f.name in ARG_RULES and not (value is None and f.default is None):
            check_args(**{f.name: value})


def writable(path):
    """Can a file be written at path? Tried: os.access says yes to root."""
    # refused unopened: a folder, a FIFO (opening one waits for a reader), a dead link (opening
    # one makes its target)
    if not path or os.path.lexists(path) and not os.path.isfile(path):
        return False
    existed = os.path.exists(path)
    try:
        # no such folder, a read-only one, a name ending in a separator: an OSError
        open(path, "a").close()
    except (OSError, ValueError):   # ValueError: a NUL in the name
        return False
    if not existed:
        os.remove(path)
    return True


def check_engine_args(args):
    """What no single knob's rule says: the device, the disk file, the rules across knobs."""
    name = str(args.device)   # a string or a torch.device
    kind, _, index = name.partition(":")
    require(args.device is None or name in ("cpu", "cuda")
            or kind == "cuda" and index.isdigit(),
            f"device must be None, 'cpu' or 'cuda[:index]', got {args.device!r}")
    num_cuda = torch.cuda.device_count()   # 0 without CUDA
    require(kind != "cuda" or int(index or 0) < num_cuda,
            f"device {name!r}: this machine has {num_cuda} CUDA devices")
    path = args.disk_path
    given = os.fspath(path) if isinstance(path, (str, os.PathLike)) else ""
    # lexists: a dead link is taken (opened, it would make its target)
    require(path is None or not os.path.lexists(given) and writable(given),
            "disk_path must be None (a temporary file) or a new file in a folder you may write "
            f"(unlinked once mapped), got {path!r}")
    require(path is None or args.num_disk_blocks > 0,
            f"disk_path {path!r} holds the disk tier: give num_disk_blocks > 0 with it")
    require(args.enable_prefix_caching or not args.num_disk_blocks, "num_disk_blocks: the "
            "disk tier holds cached blocks only, and enable_prefix_caching is False")
    require(args.preemption_mode != "swap" or args.num_cpu_blocks > 0,
            "preemption_mode='swap' needs a host pool: num_cpu_blocks > 0")
    require(args.scheduling_policy == "priority" or args.priority_aging_steps == 0,
            "priority_aging_steps ages priorities: give scheduling_policy='priority' with it")


def check_loaded_model(llm, args, num_blocks):
    """What can only be checked once the model is known: its length, a block's size in bytes
    against this machine's memory."""
    block, kv_dtype = llm._block_shape(args)
    # Windows has none: no check
    sysconf = getattr(os, "sysconf", lambda name: math.inf)
    ram = sysconf("SC_PAGE_SIZE") * sysconf("SC_PHYS_PAGES")
    bytes_per_block = math.prod(block) * kv_dtype.itemsize
    low_dtype, low_block = offload_block(args, block, llm.model.config.head_dim, kv_dtype)
    host_bytes = math.prod(low_block) * low_dtype.itemsize
    on_cpu = llm.device.type == "cpu"   # the device pool is host memory too
    in_ram = args.num_cpu_blocks * host_bytes + (num_blocks * bytes_per_block if on_cpu else 0)
    require(in_ram <= ram, f"num_blocks {num_blocks} (device) and num_cpu_blocks "
            f"{args.num_cpu_blocks} (host) of {bytes_per_block} and {host_bytes} bytes exceed "
            f"this machine's memory ({ram / 2**30:.0f} GiB)")
    free = math.inf if on_cpu else torch.cuda.mem_get_info(llm.device)[0]
    require(num_blocks * bytes_per_block <= free, f"num_blocks {num_blocks} of "
            f"{bytes_per_block} bytes exceed the {free / 2**30:.1f} GiB free on {llm.device}")
    longest = llm.model.config.max_position_embeddings
    # None took the model's: only one given can fail
    require(llm.max_model_len <= longest,
            f"max_model_len {llm.max_model_len} exceeds the model's {longest}")


def tokenize(llm, prompt):
    if isinstance(prompt, str):
        require(llm.tokenizer is not None,
                "this model has no tokenizer (random weights): give prompts as token-id lists")
        return llm.tokenizer.encode(prompt, add_special_tokens=False)
    require(is_list(prompt),
            f"a prompt is a string or a list of token ids, got {type(prompt).__name__}")
    return list(prompt)


def checked_requests(llm, prompts, params, kind, priority=None):
    """[(token_ids, params, priority)] for add_requests, every one checked (a ValueError)."""
    require(kind in (SamplingParams, BeamSearchParams),
            f"kind must be SamplingParams or BeamSearchParams, got {kind!r}")
    one_prompt = is_list(prompts) and len(prompts) > 0 and is_int(prompts[0])
    if isinstance(prompts, str) or one_prompt:
        prompts = [prompts]
    require(is_list(prompts), "prompts must be a string, a list of strings "
            f"or of token-id lists, got {type(prompts).__name__}")
    # None: SamplingParams() for generate; beam_search has no default (the loop below refuses)
    if params is None and kind is SamplingParams:
        params = SamplingParams()
    # one for all, or a list or tuple of one per prompt
    if not is_list(params):
        params = [params] * len(prompts)
    require(len(params) == len(prompts),
            f"params: {len(params)} for {len(prompts)} prompts; give one, or one per prompt")
    for p in params:
        require(isinstance(p, kind), f"params: expected {kind.__name__}, got "
                f"{type(p).__name__} (generate takes SamplingParams, beam_search takes "
                "BeamSearchParams)")
    priority = [0] * len(prompts) if priority is None else priority
    require(is_list(priority) and len(priority) == len(prompts)
            and all(map(is_int, priority)),
            f"priority: one int per prompt ({len(prompts)} prompts), got {priority!r}")
    require(isinstance(llm.scheduler, PriorityScheduler) or not any(priority),
            f"priority {priority!r}: give LLM(scheduling_policy='priority') to use priorities")
    requests = [(tokenize(llm, x), p, q)
                for x, p, q in zip(prompts, params, priority)]
    for token_ids, p, _ in requests:
        validate_request(llm, token_ids, p)
    return requests


def max_blocks_needed(llm, num_prompt_tokens, params):
    """The most blocks a request holds at once: its prompt's full blocks, shared by all n (even
    after a preemption), and each one's own at full length. Alone in a pool this big it ends."""
    block_size = llm.block_manager.block_size
    # the last token ends it, unwritten
    written = num_prompt_tokens + params.max_tokens - 1
    shared = num_prompt_tokens // block_size
    return shared + params.n * (math.ceil(written / block_size) - shared)


def validate_request(llm, token_ids, params):
    vocab = llm.model.config.vocab_size
    require(len(token_ids) > 0, "empty prompt: a prompt needs at least one token")
    bad = [t for t in token_ids if not (is_int(t) and 0 <= t < vocab)]
    require(not bad, f"token id {bad[:1]} outside the vocabulary: ids are ints in [0, {vocab})")
    require(len(token_ids) + params.max_tokens <= llm.max_model_len,
            f"prompt ({len(token_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds "
            f"max_model_len ({llm.max_model_len})")
    require(params.n <= llm.scheduler.max_num_seqs,
            f"n (or beam_width) {params.n} > max_num_seqs {llm.scheduler.max_num_seqs}")
    require(not isinstance(params, BeamSearchParams) or 2 * params.beam_width <= vocab,
            f"beam_width {params.n}: 2 * beam_width candidates exceed the vocabulary ({vocab})")
    need = max_blocks_needed(llm, len(token_ids), params)
    # what pins leave of the pool
    room = llm.block_manager.num_blocks - llm.num_pinned_blocks()
    require(need <= room, f"the pool is too small for this request: it may need {need} blocks, "
            f"the pool has {room} (pinned: {llm.num_pinned_blocks()}); raise num_blocks, or "
            "lower max_tokens or n")

# ----------------------------------------------------------------------------------------------
# 6. Invariant checks: the block manager's rules, asserted (the tests call them after every step)

def check_block_manager(bm, step):
    """BlockManager.check_invariants (any KVCacheManager's): each rule, asserted by name, saying
    at which step which block breaks it, what it is and what the rule wants."""
    step = f"step {step}"
    # prefix_id -> (hash, tokens, parent's prefix_id), as registered in any tier
    prefixes = {}
    for pool in bm.tiers:
        # "block 3" on the device, "host block 3" below, as the trace names them
        name = "" if pool is bm.device else f"{pool.name} "
        held = Counter(b for seq in pool.seqs.values() for b in seq.block_table)
        # each block in one list, the one its fields say: used if held; else cached if
        # registered (it has a hash), empty if not
        listed = Counter([*pool.empty_block_ids, *pool.cached_block_ids, *held])
        for b in pool.blocks:
            assert b.ref_count == held[b.block_id], (f"{step}: {name}block {b.block_id} has "
                                                     f"ref_count {b.ref_count}, held by "
                                                     f"{held[b.block_id]} tables")
            registered = b.hash is not None
            in_cache = b.block_id in pool.cached_block_ids
            # its list: held if a table holds it, else cached if registered, else empty
            assert listed[b.block_id] == 1 and (b.ref_count or registered == in_cache), (
                f"{step}: partition: {name}block {b.block_id} is in {listed[b.block_id]} "
                f"lists (cached: {in_cache}), want one alone (ref_count {b.ref_count}, hash "
                f"{b.hash})")
            if registered:
                assert b.block_id in pool.hash_to_block_ids.get(b.hash, ()), (
                    f"{step}: hash map: {name}block {b.block_id} has hash {b.hash}, not listed")
                # copies of one prefix, in any tier, are one prefix
                entry = (b.hash, b.token_ids, b.parent_prefix_id)
                prefix = prefixes.setdefault(b.prefix_id, entry)
                assert prefix == entry, (f"{step}: hash map: prefix {b.prefix_id} is (hash, "
                                         f"tokens, parent) {prefix}, but {entry} in {name}block "
                                         f"{b.block_id}")
        # the map lists the registered blocks under their hashes (above), and no others
        for h, bucket in pool.hash_to_block_ids.items():
            assert bucket, f"{step}: hash map: {pool.name} hash {h} lists no block"
            for block_id in bucket:
                found = pool.blocks[block_id].hash
                assert found == h, (f"{step}: hash map: {name}block {block_id} is listed under "
                                    f"hash {h}, its hash is {found}")
        for seq in pool.seqs.values():
            # the newest token may lack its slot yet
            n = len(seq.block_table)
            sizes = sorted({bm._num_blocks_for(len(seq) - d) for d in (0, 1)})
            assert n in sizes, (f"{step}: block table: seq {seq.seq_id} has {n} blocks for "
                                f"{len(seq)} tokens, want {' or '.join(map(str, sizes))}")
    seq_ids = [s for pool in bm.tiers for s in pool.seqs]
    assert len(seq_ids) == len(set(seq_ids)), (f"{step}: partition: seqs "
                                               f"{[s for s in seq_ids if seq_ids.count(s) > 1]} "
                                               "have tables in two tiers")
    # a registered block holds the prefix of all its holders; it follows registered blocks only
    for seq in bm.device.seqs.values():
        # the prefix block i follows (None: the first, or it follows an unregistered block)
        parent = None
        for i, block_id in enumerate(seq.block_table):
            block = bm.device.blocks[block_id]
            # a hash is asked for of full blocks only: _block_hash
            if block.hash is not None:
                want = (bm._tokens(seq, i), bm._block_hash(seq, i), parent)
                found = (block.token_ids, block.hash, block.parent_prefix_id)
                assert found == want, (f"{step}: hash map: seq {seq.seq_id} block {i} (block "
                                       f"{block_id}) holds (tokens, hash, parent) {found}, want "
                                       f"{want}")
            # None once unregistered: a later block's parent differs
            parent = block.prefix_id

# ----------------------------------------------------------------------------------------------
# 7. What happened: events as records, for the live view and the trace; the metrics

def _ids(xs):
    """'0-3, 7, 12' for the event log: a run of three or more ids as first-last."""
    # x - i is the same along a run
    groups = itertools.groupby(enumerate(xs), lambda p: p[1] - p[0])
    runs = [[x for _, x in group] for _, group in groups]
    texts = (f"{r[0]}-{r[-1]}" if len(r) > 2 else ", ".join(map(str, r))
             for r in runs)
    return ", ".join(texts)


# the plain words of each kind of event, for the live view and the trace
EVENT_WORDS = {
    "prefix hit": "seq {seqs} finds blocks {blocks} in the prefix cache ({num_tokens} tokens)",
    "prompt": "seq {seqs}'s prompt: {sources}",
    "fork": "seq {seqs} forks from seq {parent}: blocks {blocks} shared",
    "copy": "seq {seqs} copies shared block {blocks} to block {to} before writing "
            "(copy-on-write)",
    "evict": "{tier.name} block {blocks} is evicted from the prefix cache ({why})",
    "write down": "{tier.name} block {blocks} evicted, its K/V written down to "
                  "{to_tier.name} block {to} ({why})",
    "write ahead": "{tier.name} block {blocks} written down ahead (it stays) to "
                   "{to_tier.name} block {to}",
    "drop": "{tier.name} block {blocks} evicted; its copy stays, in {to_tier.name} block {to} "
            "({why})",
    "load": "seq {seqs} finds block {blocks} in the {tier.name} tier: loaded into block {to}{why}",
    "swap out": "seq {seqs} swapped out: blocks {blocks} to host blocks {to}",
    "swap in": "seq {seqs} swapped in: host blocks {blocks} to blocks {to}",
    "preempt": "seq {seqs} preempted by {mode}: blocks {blocks} taken back{why}",
    "finish": "seq {seqs} finishes ({reason}): blocks {blocks} released",
    "watermark": "seq {seqs} waits: it fits, but the watermark keeps {num_blocks} free for "
                 "decodes",
    "copies made": "copies made in the background: {num_copies}",
    "loading": "seq {seqs} sits this step out (loading): its blocks are still in flight",
}


class Event(namedtuple("Event", "step kind seq_ids block_ids tier to_ids to_tier details")):
    """One record of what happened, as EventLog.record makes it: the step it happened in; its
    kind (a key of EVENT_WORDS); the sequences (seq_ids); the blocks it acts on (block_ids) and
    their tier, a Pool where the words name it (None: they do not); where they went (to_ids: the
    copy's block, the other tier's blocks) and their tier (to_tier); details: the rest its words
    say, by name. Ids as tuples."""

    def words(self):
        return EVENT_WORDS[self.kind].format(seqs=_ids(self.seq_ids),
                                             blocks=_ids(self.block_ids), to=_ids(self.to_ids),
                                             tier=self.tier, to_tier=self.to_tier,
                                             **self.details)


@dataclass
class EventLog:
    """What the block manager and the scheduler did, taken after each step."""
    step: int = 0   # the step the engine is in, stamped on each record
    records: list = field(default_factory=list)   # of Event

    def record(self, kind, seqs=(), block_ids=(), tier=None,
               to_ids=(), to_tier=None, **details):
        """An Event of kind: the Sequences it concerns (named by their ids), the rest as Event's."""
        seq_ids = tuple(s.seq_id for s in seqs)
        self.records.append(Event(self.step, kind, seq_ids, tuple(block_ids), tier,
                                  tuple(to_ids), to_tier, details))

    def take(self):
        records = self.records
        self.records = []
        return records


# the block manager's counts that stats() reports (BlockManager.__init__ says what each counts)
COUNTS = ["prefix_cache_queries", "prefix_cache_hits", "host_prefix_cache_hits",
          "disk_prefix_cache_hits", "num_swapped_out_blocks", "num_swapped_in_blocks",
          "num_cow_copies", "num_evictions", "num_offloaded_blocks", "num_loaded_blocks",
          "num_write_downs_skipped"]


def engine_stats(llm):
    """LLM.stats(): fractions and counts, named as vLLM names them."""
    bm = llm.block_manager
    used = bm.num_used_blocks()
    # the token slots holding K/V in each used block, a shared block's counted once:
    # block id -> its slots filled. Every holder of a shared block has written as much of it
    # (nobody writes a shared block but a leader, and the samples that wait for it count only
    # what it wrote): the holder counted last counts right
    filled = {}
    for seq in bm.device.seqs.values():
        # the blocks it has written whole, then the next one's slots written if it has that
        # block (zip stops at the shorter: the blocks after it hold none), one dict update at
        # C speed
        num_full, last = divmod(seq.num_written_tokens, bm.block_size)
        filled.update(zip(seq.block_table, [bm.block_size] * num_full + [last]))
    busy = llm.copier.busy_seconds
    waited = llm.copy_engine.copy_wait_seconds if llm.copy_engine else busy
    counts = bm.counts
    stats = {
        # cached blocks nobody holds count as free
        "kv_cache_usage_perc": used / bm.num_blocks,
        "token_occupancy_perc": sum(filled.values()) / max(1, used * bm.block_size),
    }
    # the counts (those not counted yet read 0); the prefix cache's in tokens: the queries, the
    # hits in any tier, and of those the tokens loaded up from the host and the disk
    for name in COUNTS:
        stats[name] = counts[name]
    queries = max(1, counts["prefix_cache_queries"])
    stats["prefix_cache_hit_rate"] = counts["prefix_cache_hits"] / queries
    # each prompt counted once: where its tokens were found, why the others were computed
    tokens = breakdown(bm.sources)
    stats["num_cached_tokens"], stats["cached_by_tier"], stats["computed_by_reason"] = tokens
    stats["num_preemptions"] = llm.scheduler.num_preemptions
    stats["num_prefill_tokens_computed"] = llm.num_prefill_tokens_computed
    stats["num_generated_tokens"] = llm.num_generated_tokens
    # the copies between tiers: seconds the steps waited for one (blocking: all of them),
    # seconds of copying hidden behind compute (async_copies), bytes over each tier's link
    stats["copy_wait_seconds"] = waited
    stats["copy_hidden_seconds"] = max(0.0, busy - waited)
    for tier in ("host", "disk"):
        stats[f"{tier}_bytes_moved"] = llm.copier.bytes_moved[tier]
    return stats

# ----------------------------------------------------------------------------------------------
# 8. Refinements of the block manager and the scheduler, each called from one place above:
#    exact prefixes under hash collisions, the write-down rule by hits, why a prompt missed the
#    cache, a recomputed n>1 request's leader, the cost rule (which tiers are worth loading
#    from; swap or recompute)

# Exact prefixes. A chain hash covers the whole prefix, but two prefixes may hash alike, and a
# block's own tokens say nothing of the blocks before it. So each registered prefix gets a
# prefix_id, a number never reused, which its copies in other tiers share, and each block keeps
# its parent's (parent_prefix_id): a block found is the prefix's if its tokens and its parent's
# prefix id are (BlockManager._lookup). The hash finds a block; the prefix id names it.

# The write-down rule. A cached block evicted from a tier is written down to the first tier
# below worth loading from that keeps it: one with an empty block, or a full one whose next
# block out was found less often (Block.hits: prompts that found it, and preempted requests that
# will look for it again). Otherwise the write is traffic for nothing: the tier would evict a
# block it may yet load for one it may never load. With a copy below already (written ahead,
# section 9, or swapped), none is made.

def keeps(tier, block):
    """Is block worth a write-down into tier?"""
    if tier.empty_block_ids:
        return True
    if not tier.cached_block_ids:   # full, of blocks somebody holds
        return False
    next_out = tier.blocks[next(iter(tier.cached_block_ids))]
    return block.hits > next_out.hits


# Why a prompt missed the cache. Each prompt token of a request is counted once, at its
# admission, before its blocks are taken: found in a tier (a hit), or computed, for one of
# REASONS. A hit is a chain of whole blocks, so the first block that misses tells why: it was
# never cached, or it was cached and evicted (bm.evicted: the prefixes lost lately, ARC's ghost
# list), or it sits below the device, not loaded; every block after it misses with it. A request
# preempted by recompute is admitted again: the prompt tokens it finds keep their record; the
# others are recomputed if it had computed its whole prompt (preempted in the middle of its
# prefill, they get the cache's reasons, as at its first admission). The engine's counts
# (bm.counts, by the same names) are the requests' sums.

TIERS = ["device", "host", "disk"]
REASONS = [
    "caching off",      # enable_prefix_caching=False
    # the block of the last prompt token, full: that token is always computed (its logits are
    # sampled), and a hit is whole blocks
    "last token",
    "partial block",    # the tokens after the last full block: a block is cached once full
    "first seen",       # never cached, or evicted longer ago than bm.evicted remembers
    "evicted",          # cached, then evicted: its K/V lost to the cache
    # in a tier below, not loaded: recomputing it is cheaper (the cost rule), or a swapped-out
    # request holds it
    "not loaded",
    "after a miss",     # a block before it missed: a hit is a prefix
    # computed again: its whole prompt was computed before a preemption by recompute (or an
    # undone step)
    "recomputed",
]


def breakdown(sources):
    """(num_cached_tokens, cached_by_tier, computed_by_reason) of a request's sources, or of the
    engine's counts."""
    counts = Counter(sources)
    by_tier = {t: counts[t] for t in TIERS if counts[t]}
    by_reason = {r: counts[r] for r in REASONS if counts[r]}
    return sum(by_tier.values()), by_tier, by_reason


def source_words(sources, block_size):
    """'device 8 (blocks 0, 1), first seen 4 (block 2)': each source's tokens and blocks."""
    parts = []
    for source in dict.fromkeys(sources):   # each once, in the prompt's order
        blocks = sorted({i // block_size for i, s in enumerate(sources) if s == source})
        noun = "blocks" if len(blocks) > 1 else "block"
        parts.append(f"{source} {sources.count(source)} ({noun} {_ids(blocks)})")
    return ", ".join(parts)


# A recomputed n>1 (or beam) request. Its samples share the prompt's blocks; preempted by
# recompute, each holds its own tokens since. They are admitted together again: the first, the
# leader, allocates (with prefix hits); each other forks from it, sharing the leading blocks of
# equal tokens, and waits (waits_for) until the leader has computed them (the one write to a
# block with ref_count > 1, before anybody reads it), then computes its own.

# The cost rule: copy blocks, or recompute their tokens, whichever costs less here. Two choices
# trade a copy against a recompute: preemption_mode='auto' (swap a request to the host and back,
# or recompute it) and the tiers (load a cached block from host or disk, or recompute it; a
# tier not worth loading from is not written down to either). Both take one measured rule.

@dataclass
class CostModel:
    """Recomputing costs tokens * seconds_per_token, the model's average over the steps (its
    forward alone, no wait for copies; an upper estimate: a forward's fixed cost is spread over
    its tokens); copying costs blocks * seconds_per_block."""
    block_size: int
    # tier -> seconds to copy one block between it and the device
    seconds_per_block: dict
    seconds_per_token: float = 0.0   # 0 until the first step is measured

    @classmethod
    def measure(cls, kv_caches, copier, block_size):
        """Times a few blocks' copies to each tier and back: the fastest of 3 rounds (warm-up)."""
        device = kv_caches["device"]
        seconds = {"device": 0.0}
        for tier in ("host", "disk"):
            cache = kv_caches[tier]
            # block ids
            probe = range(min(8, device.shape[2], cache.shape[2]))

            def round_trip():
                for i in probe:
                    cache[:, :, i].copy_(to_dtype(device[:, :, i], cache.dtype))
                    device[:, :, i].copy_(to_dtype(cache[:, :, i], device.dtype))   # (blocking)

            rounds = timeit.repeat(round_trip, number=1, repeat=3)
            seconds[tier] = min(rounds) / (2 * len(probe)) if probe else math.inf
            # as slow as the emulated link, at least
            seconds[tier] = max(seconds[tier], copier.seconds.get(tier, 0))
        return cls(block_size, seconds)

    def observe(self, report):   # a moving average, set by the first step
        weight = 0.1 if self.seconds_per_token else 1.0
        # the model's time alone: a step that waits for copies computes no slower
        per_token = report.batch.model_seconds / report.batch.num_tokens
        self.seconds_per_token += weight * (per_token - self.seconds_per_token)

    def worth_loading(self, tier):
        """A block's copy up against recomputing its tokens."""
        return self.seconds_per_block[tier.name] < self.block_size * self.seconds_per_token

    def load_figures(self, tier):
        """The rule's two sides for a block, as the trace tells them."""
        return (f"copy {ms(self.seconds_per_block[tier.name])} < recompute "
                f"{ms(self.block_size * self.seconds_per_token)}")

    def cheaper_mode(self, bm, request):
        """(mode, the rule's figures, as the trace tells them) for preemption_mode='auto'."""
        # a recompute computes the leader whole, the others past what they share
        leader, *others = request.seqs
        num_tokens = len(leader)
        for s in others:
            num_tokens += len(s) - bm.block_size * bm.num_shared(leader, s)
        num_blocks = len(distinct_blocks(request.seqs))
        # out, then back in
        swap_seconds = 2 * num_blocks * self.seconds_per_block["host"]
        recompute_seconds = num_tokens * self.seconds_per_token
        mode = "swap" if swap_seconds < recompute_seconds else "recompute"
        return mode, (f"copy 2 x {num_blocks} blocks {ms(swap_seconds)}, recompute "
                      f"{num_tokens} tokens {ms(recompute_seconds)}")

class BlockManager(KVCacheManager):
    """KVCacheManager with its refinements: its knobs checked; the event log; the write-down
    rule; why each prompt token missed the cache; a recomputed request's leader; the cost rule;
    write-ahead (section 9) and the undo's rebuild of the pools (section 10)."""

    def __init__(self, num_blocks, block_size, num_cpu_blocks=0, enable_prefix_caching=True,
                 events=None, num_disk_blocks=0, cost=None):
        check_args(num_blocks=num_blocks, block_size=block_size,
                   num_cpu_blocks=num_cpu_blocks, num_disk_blocks=num_disk_blocks)
        super().__init__(num_blocks, block_size, num_cpu_blocks, enable_prefix_caching,
                         num_disk_blocks)
        # what happened, for the view and the trace
        self.events = events or EventLog()
        # which tiers are worth loading from (the cost rule); None: all of them
        self.cost = cost
        # the prefixes lost to the cache lately, for why a prompt missed it: (hash, tokens) ->
        # from where, when, for whom; ARC's ghost list
        self.evicted = OrderedDict()
        # every prompt token admitted, by its source: a tier (TIERS) or a reason (REASONS)
        self.sources = Counter()
        # prefix id -> the device blocks registered after it: what continues it (the leaf policy's)
        self.children = defaultdict(set)
        # device blocks registered after a prefix lost to the device since: orphans, found again
        # only through a copy below (the replay has none)
        self.orphans = set()

    def record(self, kind, *args, **details):
        self.events.record(kind, *args, **details)

    def take_events(self):
        return self.events.take()

    def check_invariants(self):
        check_block_manager(self, self.events.step)   # (section 6)

    # -- what continues each device block; the orphans
    def _register(self, pool, block, like=None):
        super()._register(pool, block, like)
        if pool is self.device:
            self.children[block.parent_prefix_id].add(block.block_id)

    def _unregister(self, pool, block):
        if pool is self.device:
            self.orphan_continuations(block)
        super()._unregister(pool, block)

    def orphan_continuations(self, block):
        """block leaves the device's prefix cache: what continues it there, and what continues
        those, are orphans."""
        siblings = self.children[block.parent_prefix_id]
        siblings.discard(block.block_id)
        if not siblings:
            del self.children[block.parent_prefix_id]
        self.orphans.discard(block.block_id)
        stack = list(self.children.get(block.prefix_id, ()))
        while stack:
            block_id = stack.pop()
            self.orphans.add(block_id)
            stack += self.children.get(self.device.blocks[block_id].prefix_id, ())

    def pin(self, seq):
        """seq (a prompt) holds the device blocks that its prefix is found in, the leading run: they
        stay cached, pinned, until it is freed; seq is cut back to them and one token more."""
        for tier, block in self._cache_hits(seq):
            if tier is not self.device:
                break
            self._hold(self.device, block)
            seq.block_table.append(block.block_id)
        seq.num_computed_tokens = len(seq.block_table) * self.block_size
        del seq.token_ids[seq.num_computed_tokens + 1:]
        self.device.seqs[seq.seq_id] = seq

    # -- the write-down rule
    def tiers_below(self, pool):
        """The tiers under pool worth loading from, fastest first."""
        below = self.tiers[self.tiers.index(pool) + 1:]
        return [t for t in below if self.worth_loading(t)]

    def write_down_or_lose(self, pool, block, seq, why):
        """_evict's decision (for seq): a copy below already, a write-down, or lost."""
        lower = self.tiers_below(pool)
        copies = self._lookup(lower, block.hash, block.token_ids, block.parent_prefix_id)
        keeping = [t for t in lower if keeps(t, block)]
        if copies:
            tier, copy = copies[0]
            # the prompts that found it count on
            copy.hits = max(copy.hits, block.hits)
            self.record("drop", [], [block.block_id], pool,
                        [copy.block_id], tier, why=why)
        elif keeping:
            self._write_down(pool, block, keeping[0], "write down", seq, why)
        else:   # its K/V are lost to the prefix cache
            # a tier below had room, but only for a block found more often
            if any(t.num_free_blocks > 0 for t in lower):
                self.counts["num_write_downs_skipped"] += 1
            super().write_down_or_lose(pool, block, seq, why)
            self.remember_eviction(pool, block, seq)

    def _write_down(self, pool, block, below, kind, seq=None, why=""):
        """A copy of block's K/V in a block of the tier below, cached there (for seq; why: the
        eviction policy's words)."""
        dst = self._get_new_block(below, seq)
        self.copies.append(BlockCopy(pool, block.block_id,
                                     below, dst.block_id))
        # registered after its copy is queued (section 10)
        self._register(below, dst, like=block)
        self._cache(below, dst)
        self.counts["num_offloaded_blocks"] += 1
        self.record(kind, [], [block.block_id], pool,
                    [dst.block_id], below, why=why)

    # -- why a prompt missed the cache
    def explain_prompt(self, request):
        """Set request.sources (each prompt token's tier, or why it is computed), add them to the
        counts, and tell the trace. The look-up is allocate's, made first."""
        seq = request.seqs[0]
        hits = self._cache_hits(seq)
        found = []
        for tier, _ in hits:
            found += [tier.name] * self.block_size
        # a recomputed request's hits may go past its prompt
        found = found[:seq.num_prompt_tokens]
        num_computed = seq.num_prompt_tokens - len(found)
        computed = ["caching off"] * num_computed
        lost = ""
        if request.sources:   # admitted again: what it finds keeps its record
            found = list(request.sources[:len(found)])
        # its whole prompt computed before: what it computes now is computed again
        if request.past_first_token:
            computed = ["recomputed"] * num_computed
        elif self.enable_prefix_caching:
            computed, lost = self.why_computed(seq, hits)
        sources = tuple(found + computed)
        self.sources.subtract(request.sources)
        self.sources.update(sources)
        request.sources = sources
        # in the trace's words: each source's tokens and blocks, then an eviction's when, where
        # and for whom
        self.record("prompt", [seq], sources=source_words(sources, self.block_size) + lost)

    def why_computed(self, seq, hits):
        """(The reasons of the prompt tokens after the hits, words on an eviction.) The first block
        missed tells why; those after it miss with it; the last token's block is never looked up."""
        size = self.block_size
        # the block of the last prompt token
        last = (seq.num_prompt_tokens - 1) // size
        first = len(hits)
        computed = []
        lost = ""
        if first < last:
            h = self._block_hash(seq, first)
            tokens = self._tokens(seq, first)
            parent = hits[-1][1].prefix_id if hits else None
            # in a tier below (on the device it would be a hit)
            if self._lookup(self.tiers, h, tokens, parent):
                reason = "not loaded"
            elif (h, tokens) in self.evicted:
                reason = "evicted"
                lost = f"; block {first} was evicted {self.evicted[(h, tokens)]}"
            else:
                reason = "first seen"
            computed = [reason] * size + ["after a miss"] * (size * (last - first - 1))
        num_left = seq.num_prompt_tokens - last * size
        tail = "last token" if num_left == size else "partial block"
        return computed + [tail] * num_left, lost

    def remember_eviction(self, pool, block, seq):
        """In self.evicted: the prefix lost, where, when, for whom (the oldest forgotten past as
        many as the device pool holds)."""
        key = (block.hash, block.token_ids)
        self.evicted.pop(key, None)
        whom = f"seq {seq.seq_id}" if seq else "a write-ahead"
        self.evicted[key] = f"from the {pool.name} tier at step {self.events.step} for {whom}"
        if len(self.evicted) > self.num_blocks:
            self.evicted.popitem(last=False)

    # -- a recomputed request's leader
    def num_shared(self, leader, seq):
        """Blocks seq can share with leader: the leading blocks that hold the same tokens in both,
        before the block of either one's last token (its writer's own)."""
        limit = (min(len(seq), len(leader)) - 1) // self.block_size
        for i in range(limit):
            if self._tokens(leader, i) != self._tokens(seq, i):
                return i
        return limit

    def blocks_for_siblings(self, leader, siblings):
        """What forking siblings from leader takes."""
        return sum(self._num_blocks_for(len(seq)) - self.num_shared(leader, seq)
                   for seq in siblings)

    def allocate_sibling(self, leader, seq):
        """seq forks from leader, sharing what they share, and waits for the leader to write it."""
        self.fork(leader, seq, self.num_shared(leader, seq))
        seq.waits_for = leader

    # -- the cost rule
    def worth_loading(self, tier):
        """The device always is; with no cost rule, every tier."""
        return tier is self.device or self.cost is None or self.cost.worth_loading(tier)

    def load_figures(self, tier):
        """For the trace: the rule's two sides for a load from tier."""
        return f" ({self.cost.load_figures(tier)})" if self.cost is not None else ""

    def cheaper_mode(self, request):
        return self.cost.cheaper_mode(self, request)

    # -- write-ahead (section 9)
    def write_ahead(self):
        """Device blocks with no copy below get one in the first tier below that keeps it (as on
        eviction), in the background, and stay: the WRITE_AHEAD cached blocks next out first
        (write-back, ahead of need), then the full blocks that running sequences hold, each looked
        at once (write-through: a request that ends leaves its copies below). Evicting one later
        makes no copy, so no step waits for its write-down; the engine calls it when the link is
        idle. Each sequence keeps how far it was looked at, and the last block's id."""
        lower = self.tiers_below(self.device)
        left = WRITE_AHEAD_PER_STEP
        # the cached blocks next out first
        for block_id in itertools.islice(self.device.cached_block_ids, WRITE_AHEAD):
            if left == 0:
                return
            if self.write_down_ahead(lower, self.device.blocks[block_id]):
                left -= 1
        for seq in self.device.seqs.values():
            start, last = seq.written_through
            if start and seq.block_table[start - 1] != last:
                # other blocks: recomputed, or swapped out and back in
                start = 0
            for i in range(start, seq.num_computed_tokens // self.block_size):
                if left == 0:
                    return
                seq.written_through = i + 1, seq.block_table[i]
                if self.write_down_ahead(lower, self.device.blocks[seq.block_table[i]]):
                    left -= 1

    def write_down_ahead(self, lower, block):
        """A registered block with no copy in a tier below gets one, in the first tier below that
        keeps it, if any. Returns whether it had none: each such block counts against
        WRITE_AHEAD_PER_STEP, kept below or not."""
        copies = self._lookup(lower, block.hash, block.token_ids, block.parent_prefix_id)
        if block.hash is None or copies:
            return False
        tiers = lower
        if block.ref_count > 0:
            # held: only into room right below, evicting nothing there
            tiers = [t for t in lower[:1] if t.empty_block_ids]
        below = [t for t in tiers if keeps(t, block)]
        if below:
            self._write_down(self.device, block, below[0], "write ahead")
        return True

    # -- the undo's (section 10): the pools put back as a step that raised left them
    def put_back_sources(self, unmade):
        """The blocks whose K/V are not in place: those the copies in unmade (BlockCopy records, in
        the order queued) were to write. A copy never made leaves its source as it was, unless a
        copy before it was to write that block: the source takes back the place in the prefix cache
        that its copy was given, so that a load or a write-down stopped halfway loses no prefix
        (unless a later copy was to write the copy too, or it was evicted since: its entry is not
        this one)."""
        writes = [(c.dst_tier, c.dst) for c in unmade]
        # each block's last writer among them; and, as the loop goes back, the blocks that the
        # copies before the one at hand were to write
        last = {block: i for i, block in enumerate(writes)}
        before = Counter(writes)
        lost = set(writes)
        # from the last copy back: a source put back is no earlier copy's block to write, so no
        # entry read after it has changed
        for i in reversed(range(len(unmade))):
            src_tier, src, dst_tier, dst = unmade[i]
            before[dst_tier, dst] -= 1
            # no copy before it was to write its source: the source's K/V are as they were
            intact = not before[src_tier, src]
            if intact and last[dst_tier, dst] == i and is_registered(dst_tier, dst):
                # registered since (as it was, or another's by a copy never made): again, as
                # the copy is
                if is_registered(src_tier, src):
                    self._unregister(src_tier, src_tier.blocks[src])
                self._register(src_tier, src_tier.blocks[src], like=dst_tier.blocks[dst])
                lost.discard((src_tier, src))
        return lost

    def rebuild_pool(self, pool, lost):
        """Every block of pool empty, or cached if whole (not in lost) and registered as the step
        left it, in LRU order: by cached_at (start_over has stamped the blocks the step's holders
        held)."""
        # as the step left it: a block goes in last
        registered = pool.hash_to_block_ids
        if pool is self.device:   # registered anew below (an undo forgets the orphans)
            self.children = defaultdict(set)
            self.orphans = set()
        # its lists empty, as new
        pool.empty_block_ids = deque()
        pool.cached_block_ids = OrderedDict()
        pool.hash_to_block_ids = {}
        pool.seqs = {}
        for block in sorted(pool.blocks, key=lambda b: b.cached_at):
            whole = (pool, block.block_id) not in lost   # its K/V are in place
            if whole and block.block_id in registered.get(block.hash, ()):
                block.ref_count = 0
                self._register(pool, block)
                pool.cached_block_ids[block.block_id] = None
            else:
                # not registered, or half registered or half evicted as the step stopped
                pool.blocks[block.block_id] = Block(block.block_id)   # as new
                pool.empty_block_ids.append(block.block_id)

# -- eviction policies: which cached device block goes (eviction_policy; the tiers below keep
#    LRU). Each is a BlockManager that overrides the plain victim(): LRU, freed longest ago

class RankedEviction(BlockManager):
    """Evicts the cached device block of least rank(block), ties by LRU, found in a heap of (rank,
    cached_at, block id): an entry goes in as its block is cached, and one whose block has been
    held since (cached_at moved on) is passed over. A block's rank is set as it is cached."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.heap = []

    def _cache(self, pool, block):
        super()._cache(pool, block)
        if pool is self.device:
            heapq.heappush(self.heap, (self.rank(block), block.cached_at, block.block_id))
            # mostly entries passed over: anew
            if len(self.heap) > 4 * self.num_blocks:
                self.reheap()

    def reheap(self):
        """The heap anew: an entry per cached device block."""
        cached = [self.device.blocks[block_id] for block_id in self.device.cached_block_ids]
        self.heap = [(self.rank(b), b.cached_at, b.block_id) for b in cached]
        heapq.heapify(self.heap)

    def victim(self, pool):
        while pool is self.device:
            rank, cached_at, block_id = heapq.heappop(self.heap)
            block = pool.blocks[block_id]
            if block_id in pool.cached_block_ids and block.cached_at == cached_at:
                return block_id, self.why(block, rank)
        return super().victim(pool)

    def rebuild_pool(self, pool, lost):
        super().rebuild_pool(pool, lost)
        self.reheap()


class FIFOEviction(RankedEviction):
    """First cached, first evicted: a block keeps the place it took when first freed to the cache
    (a request frees its tail first), whatever hits it after."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.places = {}   # prefix id -> when its block was first cached (a tick of clock)

    def rank(self, block):
        return self.places.setdefault(block.prefix_id, block.cached_at)

    def why(self, block, rank):
        return "fifo: the first cached of the blocks cached now"

    def _unregister(self, pool, block):
        if pool is self.device:
            self.places.pop(block.prefix_id, None)
        super()._unregister(pool, block)


class LFUEviction(RankedEviction):
    """Fewest hits since the block was registered, ties by LRU: Block.hits, which counts on while
    the block stays cached, held and freed again."""

    # lab policy: below, LFU's rank
    def rank(self, block):
        return block.hits

    def why(self, block, hits):
        return f"lfu: {hits} hit{'s' * (hits != 1)}, the oldest of the blocks with {hits}"


class LeafEviction(BlockManager):
    """LRU among the leaves: the blocks that no registered device block continues. No orphans
    while a leaf is cached (a request frees its tail first: the leaves tend to come first)."""

    # lab policy: below, the leaf policy's victim
    def victim(self, pool):
        if pool is self.device:
            for block_id in pool.cached_block_ids:
                if not self.children.get(pool.blocks[block_id].prefix_id):
                    return block_id, "leaf: freed longest ago of the blocks nothing continues"
        return super().victim(pool)


class OptimalEviction(RankedEviction):
    """Belady's policy: the block whose next use lies farthest ahead, one never used again first.
    Only the replay knows the future: its requests (see replay), and now, the place of the one at
    hand. A block's next use holds while it is cached, and no block is orphaned: a prefix's next
    use comes no later than its continuation's, and among ties the continuation, freed first,
    goes first (ties by LRU)."""

    def __init__(self, num_blocks, block_size, requests):
        super().__init__(num_blocks, block_size)
        # chain hash -> the places of the requests whose prompts hold that prefix
        self.future = defaultdict(list)
        for i, ids in enumerate(requests):
            h = None
            for x in ids:   # the hash chain, as the block manager hashes replay's prompts
                h = self.compute_hash(h, (x,) * block_size)
                self.future[h].append(i)
        self.now = 0

    def rank(self, block):
        uses = self.future.get(block.hash, [])
        later = bisect.bisect_right(uses, self.now)
        return -uses[later] if later < len(uses) else -math.inf

    def why(self, block, rank):
        if rank == -math.inf:
            return "opt: never used again"
        return f"opt: used next by request {-rank}, the farthest ahead"


EVICTION_POLICIES = {"lru": BlockManager, "fifo": FIFOEviction, "lfu": LFUEviction,
                     "leaf": LeafEviction}


def replay(requests, policy, num_blocks, block_size):
    """Requests through the block manager of an eviction policy (a name of EVICTION_POLICIES, or
    "opt") with num_blocks device blocks, and no model: one at a time, in order, each allocated
    (its prefix hits), its blocks all computed and cached, and freed. A request is a list of ids,
    one per block of block_size tokens (the id, block_size times): two requests share their first
    k blocks exactly when they share their first k ids. Its prompt is its blocks and one token
    more (the last, always computed), so that every block can hit. Returns (blocks hit, prompt
    blocks, orphans after each request on average, evictions)."""
    longest = max(map(len, requests), default=0)
    require(longest < num_blocks, f"a request of {longest} blocks needs {longest + 1} (its last "
            f"token's too): more than the pool's {num_blocks}")
    if policy == "opt":
        bm = OptimalEviction(num_blocks, block_size, requests)
    else:
        bm = EVICTION_POLICIES[policy](num_blocks, block_size)
    hits = orphans = 0
    for i, ids in enumerate(requests):
        bm.now = i   # opt's clock (the others never read it)
        seq = Sequence(i, [x for x in ids for _ in range(block_size)] + [0])
        bm.allocate(seq)
        hits += seq.num_cached_tokens // block_size
        # its blocks computed and cached (not the last token's: with blocks of 1, it is full)
        seq.num_computed_tokens = len(seq) - 1
        bm.cache_full_blocks(seq)
        bm.free(seq)
        bm.take_events()
        orphans += len(bm.orphans)
    evictions = bm.counts["num_evictions"]
    return hits, sum(map(len, requests)), orphans / max(1, len(requests)), evictions

# ----------------------------------------------------------------------------------------------
# 9. The tiers' machinery: the host and disk pools, INT8 below the device, the block copier and
#    its emulated links, the copy engine that makes copies in the background, write-ahead

def offload_block(args, block, head_dim, kv_dtype):
    """(dtype, shape) of a block in the tiers below, offload_kv_cache_dtype's ("auto": the
    device's); block: a device block's shape, in kv_dtype."""
    low_dtype = torch.int8 if args.offload_kv_cache_dtype == "int8" else kv_dtype
    return low_dtype, block[:-1] + (kv_row(head_dim, low_dtype),)


def kv_row(head_dim, dtype):
    """A token's K (or V) in one KV head: INT8 holds its float32 scale after its values."""
    return head_dim + 4 if dtype == torch.int8 else head_dim


def to_dtype(kv, dtype):
    """K/V rows into another tier's dtype: quantized to INT8, or back."""
    if kv.dtype == dtype:
        return kv
    return quantize(kv) if dtype == torch.int8 else dequantize(kv, dtype)


def ms(seconds):   # a measured time, as the trace prints it
    return f"{1e3 * seconds:.3g} ms"


class BlockCopier:
    """Copies one block's K and V (all layers) between the tiers' caches (kv_caches, LLM's),
    converting between their dtypes. gbps, LLM's tier_gbps ({'host': G, 'disk': G}; {} for None),
    makes a tier's link to the others that slow, to emulate on any machine what PCIe and NVMe do
    to a GPU server: a copy is held until bytes / bandwidth have passed (a tier not named: the
    machine's own speed)."""

    def __init__(self, kv_caches, gbps):
        self.kv_caches = kv_caches
        # INT8 tiers: fewer bytes
        self.bytes_per_block = {
            t: c.element_size() * math.prod(c.shape[:2] + c.shape[3:])
            for t, c in kv_caches.items()
        }
        self.seconds = {t: self.bytes_per_block[t] / (g * 1e9)
                        for t, g in gbps.items()}
        # the lower tier of each copy -> bytes over its link
        self.bytes_moved = Counter()
        self.busy_seconds = 0.0        # copying, in all
        # set while the copy engine gives its copies up (CopyEngine.give_up): a copy held for
        # its link's time is let go at once
        self.stop = threading.Event()

    def copy(self, src_tier, src, dst_tier, dst):
        t0 = time.perf_counter()
        kv = self.kv_caches[src_tier.name][:, :, src]
        into = self.kv_caches[dst_tier.name][:, :, dst]
        # converted on the GPU, so that INT8 crosses PCIe
        if kv.dtype != into.dtype and into.is_cuda:
            kv = kv.to(into.device)
        # an INT8 tier's: quantized on the way down, dequantized on the way up
        into.copy_(to_dtype(kv, into.dtype))
        # the lower tier's link: of the two, the later in TIERS (fastest first, section 8)
        link = max(src_tier.name, dst_tier.name, key=TIERS.index)
        # INT8 below: fewer
        self.bytes_moved[link] += self.bytes_per_block[link]
        if link in self.seconds:
            # held until bytes / bandwidth have passed, or stop is set
            left = self.seconds[link] - (time.perf_counter() - t0)
            self.stop.wait(min(max(0.0, left), threading.TIMEOUT_MAX))
        self.busy_seconds += time.perf_counter() - t0


class CopyEngine:
    """async_copies=True: the copies between tiers are made on one worker thread (a
    ThreadPoolExecutor of one: in the order queued; torch's copies let go of the GIL; on CUDA on
    a side stream, after an event of the step that queued them), while the steps compute. Each
    queued copy is a Future: done once made. A request sits steps out (loading) while a copy
    still writes one of its blocks, or reads one it may write (not a write-ahead's read of a full
    block: the step only reads it too); copy-on-write is made at once, on the step's path; a step
    whose every request is loading waits for the first. A step that finds the link idle queues
    write-aheads (write_ahead): later evictions find copies below."""

    def __init__(self, llm):
        self.worker = concurrent.futures.ThreadPoolExecutor(1)
        # its thread starts now, with one OpenMP thread of its own (no team to spin on the cores)
        self.worker.submit(torch.set_num_threads, 1)
        # (tier name, block id) -> the last copy's Future that reads or writes it (the view's ~:
        # those in flight at the step's start)
        self.in_flight = {}
        # Future -> its BlockCopy, queued, until the trace tells it made
        self.started = {}
        # the exception, once a copy raised (no copy is made after it)
        self.failed = None
        self.stream = torch.cuda.Stream(llm.device) if llm.device.type == "cuda" else None
        self.copy_wait_seconds = 0.0   # the steps' time waiting for a copy
        # the worker ends with the engine, its queued copies made (at exit too: Python waits)
        weakref.finalize(llm, self.worker.shutdown, wait=False)

    def make(self, copier, copy, ready):   # on the worker thread
        # after a failure none is made: its Future says so, with an exception, as the failed one's
        if self.failed is not None:
            raise RuntimeError("not made: a copy before it failed")
        try:
            # on CUDA on the side stream, after the K/V the steps before wrote (a CPU: None)
            with torch.cuda.stream(self.stream):
                if ready is not None:
                    self.stream.wait_event(ready)
                copier.copy(*copy)
        except BaseException as e:   # the main thread raises it at its next step
            self.failed = e
            raise

    def start(self, llm, batch):
        """Queue the step's copies, then return batch without the requests still loading."""
        copies = llm.block_manager.copies
        if WRITE_AHEAD and self.idle() and not copies:
            # the link idle: write ahead
            llm.block_manager.write_ahead()
        while copies:
            # it leaves the queue once queued on the worker (or made)
            copy = copies[0]
            src_tier, src, dst_tier, dst = copy
            keys = [(src_tier.name, src), (dst_tier.name, dst)]
            if src_tier is dst_tier:
                # copy-on-write: after what is in flight on its blocks
                self.wait({self.in_flight[key] for key in keys if key in self.in_flight})
                llm.copier.copy(*copy)
            else:   # (a Ctrl-C anywhere here: the undo gives up whatever was queued)
                ready = torch.cuda.current_stream().record_event() if self.stream else None
                future = self.worker.submit(self.make, llm.copier, copy, ready)
                self.in_flight.update(dict.fromkeys(keys, future))
                self.started[future] = copy
            copies.popleft()
        # the copies each request waits for (none queued or on its way: nobody waits)
        waits = {}
        if self.started:
            waits = {e.request: self.loading(e.request) for e in batch.entries}
        if waits and all(waits.values()):
            # nobody can run: until the first of them can
            self.wait(*waits.values())
        # one moment for what has arrived
        unmade = {f for f in self.started if not f.done()}
        # a copy raised (set before its Future is done): the step too
        if self.failed is not None:
            raise RuntimeError(f"a block copy failed: {self.failed!r}") from self.failed
        self.record_made(llm.events, unmade)
        for request, futures in waits.items():
            if futures & unmade:
                batch.remove(request)
                llm.events.record("loading", request.seqs)
        return batch

    def record_made(self, events, unmade):
        """Forget the copies made (all but unmade's), and tell the trace how many."""
        num_made = len(self.started) - len(unmade)
        self.started = {future: copy for future, copy in self.started.items()
                        if future in unmade}
        self.in_flight = {key: f for key, f in self.in_flight.items()
                          if f in unmade}
        # (the view shows which: a block in flight is marked ~ until its copy is made)
        if num_made:
            events.record("copies made", num_copies=num_made)

    def loading(self, request):
        """The copies (Futures) its device blocks still wait for: those that write one, or read
        one evicted (unregistered: the step may write it); not a write-ahead's, which reads a
        registered block: K/V that never change, the step's too."""
        mine = {("device", b) for s in request.seqs for b in s.block_table}
        return {f for f, (src, i, dst, j) in self.started.items()
                if not f.done()
                and ((dst.name, j) in mine
                     or (src.name, i) in mine and src.blocks[i].hash is None)}

    def idle(self):   # has every copy queued been made (or failed)?
        return all(f.done() for f in self.started)

    def wait(self, *futures):
        """Until one of the sets of Futures is all done: the step waits."""
        t0 = time.perf_counter()
        while not any(all(f.done() for f in fs) for fs in futures):
            pending = {f for fs in futures for f in fs if not f.done()}
            concurrent.futures.wait(pending, return_when=concurrent.futures.FIRST_COMPLETED)
        self.copy_wait_seconds += time.perf_counter() - t0

    def give_up(self, copier):
        """(Undo, abort) Stop at once: the copies not begun are cancelled, the one under way is let
        go by its link. Returns the copies not made (BlockCopy, in the order queued): the K/V
        they were to write are not trusted. However slow the links, a Ctrl-C is answered in
        moments."""
        # made: done before the stop, with no exception (the one that failed, and every one after
        # it, has one); one under way may stop half made
        lost = [copy for future, copy in self.started.items()
                if not future.done() or future.exception() is not None]
        copier.stop.set()
        for future in self.started:
            # False for the one under way: it ends at its link's next wait
            future.cancel()
        concurrent.futures.wait(self.started)
        copier.stop.clear()
        # the bookkeeping starts over
        self.in_flight = {}
        self.started = {}
        self.failed = None
        return lost


# async_copies: an idle link copies below the cached blocks next out, WRITE_AHEAD of them (0: no
# write-ahead at all), then the full blocks that running sequences hold; at most
# WRITE_AHEAD_PER_STEP a step
WRITE_AHEAD = 16
WRITE_AHEAD_PER_STEP = 4


def open_disk_pool(path, shape, dtype):
    """The disk tier's K/V: a new file (by default a temporary one) mapped into memory, so that a
    copy is the OS's write or read (its page cache may keep it). Its space is reserved whole now:
    a disk too full for it is a ValueError here, never a SIGBUS at a later write. Its name is
    removed as soon as it is mapped: the mapping keeps the file, nameless, and the OS frees its
    space when the last mapping goes (the engine collected, the process ended, even by SIGKILL).
    Nothing is left behind, and no other process can open it."""
    if not shape[2]:   # no disk tier
        return torch.zeros(shape, dtype=dtype)
    try:
        if path is None:
            fd, path = tempfile.mkstemp(prefix="nanopaged-", suffix=".kv")
        else:
            # a str or a Path: torch.from_file takes a str
            path = os.fspath(path)
            # a new file only
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as e:
        raise ValueError(f"disk_path {path!r}: cannot create it ({e.strerror})") from None
    num_bytes = math.prod(shape) * dtype.itemsize
    try:
        # the space taken now. An OS without posix_fallocate gets a sparse file: a full disk
        # fails later there
        if hasattr(os, "posix_fallocate"):
            os.posix_fallocate(fd, 0, num_bytes)
        else:
            os.ftruncate(fd, num_bytes)
    except (OSError, OverflowError) as e:
        # no room; or more bytes than a file may have
        folder = os.path.dirname(os.path.abspath(path))
        # its own part is freed with it
        free = shutil.disk_usage(folder).free + os.fstat(fd).st_blocks * 512
        why = getattr(e, "strerror", e)
        raise ValueError(f"num_disk_blocks: {num_bytes / 2**20:.1f} MiB do not fit in "
                         f"{folder} ({free / 2**20:.1f} MiB free): {why}") from None
    else:   # mapped: the mapping keeps the file once its name is gone
        return torch.from_file(path, shared=True, size=math.prod(shape), dtype=dtype).view(shape)
    finally:
        # the name goes at once, mapped or not: nothing outlives the engine
        os.close(fd)
        os.remove(path)

# ----------------------------------------------------------------------------------------------
# 10. Failure recovery: a step that raises (an error, Ctrl-C) is undone
# LLM.step keeps an Undo (the fields a step can change, of the engine's objects and of the
# requests it can touch, and their random streams) to put back if the step raises, all but K/V
# it may have half-written: every request the pools held is recomputed. The prefix cache stays,
# in its LRU order: a block is registered once its K/V are written (or their copy is queued),
# unregistered before it is written again, so a recompute finds its full blocks there; a block
# whose queued copy was never made is dropped, and the source of a copy never made stays in the
# cache (put_back_sources). A step that computed a NaN raises before it registers anything
# (check_finite). The copies on their way are given up, not waited for (CopyEngine.give_up):
# however slow the links, Ctrl-C is answered at once.
# recovery() runs the undo (and generate()'s drop of its requests, which gives up the copies
# too if they were stopped between steps); a second Ctrl-C waits for it.

# What a step can change, by class, named in one place: the fields Undo saves and puts back.
# It need not save the others: set once made; rebuilt by start_over (the pools and their
# blocks); or kept apart (a sequence's tokens, cut back to their number; a request's random
# streams). tests/test_interrupts.py holds every class's fields to this table and that list.
UNDO_FIELDS = {
    "LLM": "num_steps num_prefill_tokens_computed num_generated_tokens",
    "Scheduler": "waiting running swapped num_preemptions",
    "PriorityScheduler": "waiting running swapped num_preemptions num_steps_waited",
    "BlockManager": "copies counts sources",
    "EventLog": "step records",
    "Request": "status seqs finished hypotheses first_token_time sources",
    "Sequence": "num_computed_tokens num_cached_tokens block_table waits_for prefill_until "
                "finish_reason finish_time logprobs cum_logprob",
}


def saved_state(obj):
    """obj's fields that a step can change (UNDO_FIELDS), with a copy of each list, deque or
    Counter among them (a step edits those in place)."""
    state = {}
    # a class's, or else its nearest base class's (an eviction policy's: BlockManager's)
    names = next(UNDO_FIELDS[c.__name__] for c in type(obj).__mro__ if c.__name__ in UNDO_FIELDS)
    for name in names.split():
        value = getattr(obj, name)
        state[name] = value.copy() if isinstance(value, (list, deque, Counter)) else value
    return state


class Undo:
    """What a step can change, as it was before it, and no more: the record grows with the
    requests the step can touch, not with their lengths (nor with the pool's size)."""

    def __init__(self, llm):
        self.llm = llm
        sched = llm.scheduler
        room = sched.max_num_seqs - sum(r.max_num_running_seqs for r in sched.running)
        # the waiting requests it can admit, or try to
        waiting = itertools.islice(sched.waiting, max(0, room) + 1)
        requests = [*sched.running, *sched.swapped, *waiting]
        seqs = [s for r in requests for s in r.seqs]
        objects = [llm, sched, llm.block_manager, llm.events, *requests, *seqs]
        self.states = [(obj, saved_state(obj)) for obj in objects]
        # the random streams, cloned
        self.generators = [(r, [g.clone_state() for g in r.generators])
                           for r in requests]
        # a sequence's tokens, which a step only appends to: their number, to cut them back to
        # (a copy would cost them whole, every step). Its hash chain needs no cut: a step hashes
        # only blocks whose tokens were all there before it. A prompt never changes.
        self.lengths = [(s.token_ids, len(s)) for s in seqs]

    def restore(self):
        """Called by recovery(), which holds Ctrl-C until it is done."""
        llm = self.llm
        # the copies never made, in the order queued: those the copy engine gives up, then those
        # not queued yet
        unmade = llm.copy_engine.give_up(llm.copier) if llm.copy_engine else []
        unmade += llm.block_manager.copies
        for obj, state in self.states:
            # bm.copies too: empty, as every step starts
            for name, value in state.items():
                setattr(obj, name, value)
        for request, generators in self.generators:
            request.generators = generators
        for token_ids, n in self.lengths:
            # the tokens the step appended, cut off
            del token_ids[n:]
        llm.start_over(unmade)


def is_registered(pool, block_id):
    """Wholly: a step stopped halfway may leave a block's fields set, not its place in the map
    (which _register fills last)."""
    return block_id in pool.hash_to_block_ids.get(pool.blocks[block_id].hash, ())


class Interrupts:
    """`with Interrupts() as interrupts:` a Ctrl-C (SIGINT: only the main thread gets it) waits
    until the block ends, then goes to the handler that was there before (Python's raises
    KeyboardInterrupt), while interrupts.held is True; at other times it goes there at once, and
    holding starts: a second Ctrl-C never cuts short what the first set off. (A handler that is
    not Python's, the default that kills or an ignore, is left to act.)"""

    def __init__(self):
        self.held = True
        self.caught = False
        self.previous = signal.getsignal(signal.SIGINT)
        # only the main thread may set handlers
        main = threading.current_thread() is threading.main_thread()
        self.installed = main and callable(self.previous)

    def __enter__(self):
        if self.installed:
            signal.signal(signal.SIGINT, self.handle)
        return self

    def handle(self, signum, frame):
        if self.held:
            self.caught = True
            return
        try:
            self.previous(signum, frame)   # Python's raises KeyboardInterrupt
        finally:
            # what it sets off (a recovery) is never cut short by another
            self.held = True

    def release(self):
        """From now on a Ctrl-C goes on at once (one caught so far: now)."""
        self.held = False
        if self.caught:
            self.caught = False
            self.handle(signal.SIGINT, None)

    def __exit__(self, *exc):
        if self.installed:
            signal.signal(signal.SIGINT, self.previous)
            if self.caught:   # to the handler that was there before
                signal.raise_signal(signal.SIGINT)


@contextlib.contextmanager
def recovery(undo):
    """`with recovery(undo):` if the block raises (an error, Ctrl-C), undo() runs before the
    exception goes on. In the block a Ctrl-C raises at once; after the first (or an error), and
    once the block is over, a Ctrl-C waits until undo() and the exit are done: no line of them
    is skipped. (One that comes just as the block ends undoes the block whole: the engine stays
    consistent either way.)"""
    with Interrupts() as interrupts:
        try:
            interrupts.release()
            yield
            interrupts.held = True   # the block is over
        except BaseException:
            interrupts.held = True
            undo()
            raise


# ----------------------------------------------------------------------------------------------
# 11. Beam search: the beams of a request are forks of one another, on shared blocks

# Each round every live beam offers its 2 * beam_width likeliest next tokens (vLLM's rule); an
# eos candidate completes a hypothesis, the beam_width best others live on: a beam chosen twice
# forks (ref_count + 1, no copy), one not chosen is freed, and the beams' common prefix stays
# shared.

BeamCandidate = namedtuple("BeamCandidate", "cum_logprob beam token")
# a hypothesis: a beam that ended (eos, or max_tokens)
BeamHypothesis = namedtuple("BeamHypothesis", "token_ids cum_logprob finish_reason")
# what beam_search() returns: its sequences best first; its prompt's record, as RequestOutput's
BeamSearchOutput = namedtuple("BeamSearchOutput", "request_id prompt_token_ids sequences "
                              "num_cached_tokens cached_by_tier computed_by_reason")
BeamSearchSequence = namedtuple("BeamSearchSequence",
                                "token_ids text cum_logprob score finish_reason")


def beam_round(scheduler, request):
    """One round, as above; returns how many tokens it adds."""
    params = request.params
    candidates = []
    for beam in request.seqs:
        top = beam.logprobs.topk(2 * params.beam_width)
        for logprob, token in zip(top.values.tolist(), top.indices.tolist()):
            candidates.append(BeamCandidate(beam.cum_logprob + logprob, beam, token))
        beam.logprobs = None
    eos = frozenset() if params.ignore_eos else scheduler.eos_token_ids
    request.hypotheses += [
        BeamHypothesis(c.beam.output_token_ids + [c.token], c.cum_logprob, "stop")
        for c in candidates if c.token in eos
    ]
    live = [c for c in candidates if c.token not in eos]
    chosen = sorted(live, key=lambda c: c.cum_logprob,
                    reverse=True)[:params.beam_width]
    # fork first (a child copies its parent's tokens), then append
    for beam in list(request.seqs):
        picks = [c for c in chosen if c.beam is beam]
        family = [beam]
        for _ in picks[1:]:
            family.append(scheduler.fork_seq(request, beam))
        for child, pick in zip(family, picks):
            child.append_token(pick.token)
            child.cum_logprob = pick.cum_logprob
        if not picks:   # not chosen (no fork, no token above): it ends
            scheduler.finish(request, beam, "pruned")
    if request.seqs and request.seqs[0].num_output_tokens >= params.max_tokens:
        for beam in list(request.seqs):
            # out of tokens: the live beams end here
            request.hypotheses.append(
                BeamHypothesis(beam.output_token_ids, beam.cum_logprob, "length"))
            scheduler.finish(request, beam, "length")
    return len(chosen)


def beam_output(llm, request):
    """The best hypotheses by vLLM's score, whose length counts no ending eos."""

    def score(h):
        length = len(request.prompt_token_ids) + len(h.token_ids)
        if h.finish_reason == "stop":
            length -= 1
        return h.cum_logprob / length ** request.params.length_penalty

    best = sorted(request.hypotheses, key=score,
                  reverse=True)[:request.params.beam_width]
    sequences = [BeamSearchSequence(h.token_ids, llm._detokenize(h.token_ids),
                                    h.cum_logprob, score(h), h.finish_reason)
                 for h in best]
    # an eos ends a hypothesis without joining a beam: it counts only if it is returned
    llm.num_generated_tokens += sum(1 for s in sequences if s.finish_reason == "stop")
    return BeamSearchOutput(request.request_id, request.prompt_token_ids, sequences,
                            *breakdown(request.sources))

# ----------------------------------------------------------------------------------------------
# 12. Priorities and aging: who goes first, and who gives up memory

# scheduling_policy="priority" (vLLM's --scheduling-policy priority): each request has a
# priority, lower first, ties by arrival. The Scheduler serves it unchanged: it keeps each line
# (waiting, running, swapped) in rank() order, so the first waiting request is the most urgent,
# and the victim of a preemption, the last running one, the least urgent (the newest among
# equals). One difference: a swapped request goes before a waiting one only if it ranks better.
#
# Serving the urgent first can starve the others: a steady stream of urgent requests holds a
# less urgent one back for ever. Aging (priority_aging_steps=K; 0: off) is the answer: a
# request's effective priority improves by one level for every K steps it has waited or sat
# swapped out, and what it earned stays with it when it runs (it is preempted less readily).
# The bound: a request r of priority p is never admitted after one that arrived K * (p - q) or
# more steps after it (q: that one's priority). So once K * (p - best) steps have passed (best:
# the best priority that comes), no later request goes first: r waits only for those that came
# before then. Why: the line is served in rank order, the first waiting request first or
# nobody; a request q that came d steps after r and goes first ranks better,
# q - (its steps waited) // K < p - (r's) // K, and it has waited at most r's steps - d, so
# d // K < p - q.

class PriorityScheduler(Scheduler):
    """A Scheduler whose lines are ranked by (effective priority, arrival): see above."""

    def __init__(self, block_manager, args, eos_token_ids):
        super().__init__(block_manager, args, eos_token_ids)
        self.aging_steps = args.priority_aging_steps
        # request_id -> steps it spent waiting or swapped out
        self.num_steps_waited = Counter()

    def rank(self, request):   # (effective priority, arrival)
        aged = 0
        if self.aging_steps:
            aged = self.num_steps_waited[request.request_id] // self.aging_steps
        return request.priority - aged, request.request_id

    def _next_in_line(self, batch):
        """The better ranked of the first swapped and first waiting."""
        firsts = self.swapped[:1]
        if self.waiting and not batch.is_full:
            firsts.append(self.waiting[0])
        return min(firsts, key=self.rank, default=None)

    def schedule(self):
        batch = super().schedule()
        # passed over this step, they age: a step more each
        self.num_steps_waited.update(r.request_id
                                     for r in [*self.waiting, *self.swapped])
        # a request in no line has finished: its count goes, for the undo copies the count each
        # step (kept, it would grow with every request ever served)
        live = {r.request_id
                for r in [*self.waiting, *self.running, *self.swapped]}
        self.num_steps_waited = Counter({i: self.num_steps_waited[i] for i in live})
        # aged, they may move up
        self.waiting = deque(sorted(self.waiting, key=self.rank))
        self.swapped.sort(key=self.rank)
        return batch

# ----------------------------------------------------------------------------------------------
# 13. The live view, drawn with rich after every step

def printable(text):
    """Never raw: a newline as a space, other control characters escaped."""
    chars = (c if c.isprintable() else repr(c)[1:-1]
             for c in text.replace("\n", " "))
    return "".join(chars)


NBSP = "\xa0"   # a space where a row never breaks


def wrapped(text, width, style=None, indent=2):
    """Rows of at most width columns, nothing cut; NBSP: a space, never a break."""
    rows = textwrap.wrap(text, width, subsequent_indent=" " * indent, break_on_hyphens=False)
    return [Text(row.replace(NBSP, " "), style) for row in rows]


def phrases(items, width, style=None):
    """Rows of whole phrases, " | " between them."""
    text = f"{NBSP}| ".join(item.replace(" ", NBSP) for item in items)
    return wrapped(text, width, style)


# a sequence row: its ids, state, K/V, block table, some text
MIN_VIEW_WIDTH = 64
HOLDER_COLOURS = ["cyan", "magenta", "green", "yellow", "blue", "red", "bright_cyan",
                  "orange3"]


def table_text(pool, block_table, width):
    """A block table in width columns: runs of ids as first-last (*: shared), its middle as
    (+k)."""

    def run_of(p):
        """(b - i, the same along a run of consecutive ids; its shared mark)."""
        i, b = p
        return b - i, "*" if pool[b].ref_count > 1 else ""

    # (text, blocks) of each run, all shared or none: the event log's runs ('0-2', '4, 5'),
    # each id marked, no commas
    parts = []
    for (_, mark), run in itertools.groupby(enumerate(block_table), run_of):
        ids = [b for _, b in run]
        parts.append((_ids(ids).replace(", ", f"{mark} ") + mark, len(ids)))
    for keep in range(len(parts), -1, -1):
        # the first and last parts, as many as fit
        head = parts[:(keep + 1) // 2]
        tail = parts[len(parts) - keep // 2:]
        hidden = len(block_table) - sum(n for _, n in head + tail)
        middle = [(f"(+{hidden})", hidden)] if hidden else []
        text = " ".join(t for t, _ in head + middle + tail)
        if len(text) + 2 <= width:
            break
    return f"[{text}]"


class View:
    """Draws the engine after every step (an on_step callback); live: in place, on the terminal's
    screen (the last frame stays), else a trace. `with View(llm): llm.generate(...)`."""

    def __init__(self, llm, live=True, console=None, delay=0.0):
        # delay: seconds to pause after a step, and as many per event it shows
        self.llm = llm
        self.delay = delay
        # a trace is plain text of a fixed width, so that runs with the same seed print the same
        self.console = console or (Console(highlight=False) if live else
                                   Console(highlight=False, color_system=None, width=80))
        # live: rich's Live, which keeps the frame it shows, on the terminal's own screen (what
        # was printed before, loading, stays off it), started on entering; a trace: None
        self.live = Live(console=self.console, auto_refresh=False, screen=True) if live else None

    def __enter__(self):
        self.llm.on_step.append(self)
        if self.live:
            self.live.start()
        return self

    def __exit__(self, *exc):
        self.llm.on_step.remove(self)
        if self.live:
            # the terminal is the user's again, after Ctrl-C too
            self.live.stop()
            # the last frame stays
            self.console.print(self.live.get_renderable())

    def __call__(self, report):
        if self.live:
            self.live.update(self.frame(report, self.console.height), refresh=True)
        else:
            self.console.rule(f"step {report.step}", characters="-")
            self.console.print(self.frame(report))
        time.sleep(self.delay * (1 + len(report.events)))

    def frame(self, report, height=None):
        """The engine after a step, in rows that fit the width: its figures, the batch, the pools,
        the sequences, then the step's events. With a height (a live terminal) the rows past it
        are cut, the last row left saying how many: the events go first, then the sequences;
        what is above them always shows, or a note saying the terminal is too small."""
        width = self.console.width
        top = self.metrics(report, width) + self.batch(report.batch, width)
        # all of a pool's rows, or as many as a terminal's height leaves
        top += self.pools(width, max(3, (height - 14) * 2 // 3) if height else None)
        rows = top + self.sequences(width)
        for e in report.events:   # a wrapped event continues 7 columns in
            rows += wrapped(f"{e.step:>5}  {e.words()}", width, indent=7)
        if height is None:
            return Group(*rows)
        # a terminal too small: a note saying what the view needs
        if width < MIN_VIEW_WIDTH or height - len(top) < 4:
            note = (f"step {report.step}: {len(report.events)} events. The terminal ({width}x"
                    f"{height}) is too small for the view: it needs {MIN_VIEW_WIDTH} columns "
                    f"and {len(top) + 4} rows")
            return Group(*wrapped(note, width, indent=0)[:height])
        if len(rows) > height:   # the last row and those below: a count
            rows[height - 1:] = [Text(f"  ... and {len(rows) - height + 1} more rows", "dim")]
        return Group(*rows)

    def metrics(self, report, width):
        """The pool's fill, then what the memory system did so far."""
        s = report.stats
        bm = self.llm.block_manager
        usage = f"({bm.num_used_blocks()}/{bm.num_blocks} blocks)"
        # the device's dtype, then the tiers' if others
        sizes = self.llm.copier.bytes_per_block
        kv = [f"{t} {str(c.dtype)[6:]} ({sizes[t]:,} bytes a block)"
              for t, c in self.llm.kv_caches.items()
              if c.dtype != self.llm.kv_cache.dtype or t == "device"]
        kv[0] = "KV cache: " + kv[0]   # (the device's)
        first = [f"step {report.step}", f"usage {s['kv_cache_usage_perc']:.0%} {usage}",
                 f"cached {len(bm.device.cached_block_ids)}",
                 f"occupancy {s['token_occupancy_perc']:.0%}",
                 f"hit rate {s['prefix_cache_hit_rate']:.0%}"]
        second = [f"preemptions {s['num_preemptions']}",
                  f"swapped out {s['num_swapped_out_blocks']} in {s['num_swapped_in_blocks']}",
                  f"copies {s['num_cow_copies']}", f"evictions {s['num_evictions']}"]
        # the tiers below: their traffic, in blocks
        if bm.host.blocks or bm.disk.blocks:
            host, disk = (s[f"{t}_prefix_cache_hits"] // bm.block_size for t in ("host", "disk"))
            second += [f"written down {s['num_offloaded_blocks']}",
                       f"loaded {s['num_loaded_blocks']} blocks (host {host}, disk {disk})"]
        return [row for items in (kv, first, second) for row in phrases(items, width)]

    def batch(self, batch, width):
        """Prefill chunks beside decodes, and the decodes' slots."""
        # each entry's last token
        ends = itertools.accumulate(n for _, _, n in batch.entries)
        parts, decodes = [], []
        for (_, s, n), end in zip(batch.entries, ends):
            # postprocess has moved seqs past the tokens they ran
            start = s.num_computed_tokens - n
            if start < s.prefill_until:
                parts.append(f"seq {s.seq_id} prefill {start}-{start + n - 1} of "
                             f"{s.prefill_until}")
            else:   # with the slot of its token
                decodes.append((s.seq_id, batch.slot_mapping[end - 1]))
        decodes.sort()
        if decodes:
            parts.append(f"seqs {_ids([seq_id for seq_id, _ in decodes])} decode")
        n = batch.num_tokens
        text = f"ran {n} token{'' if n == 1 else 's'}: " + " | ".join(parts)
        slots = f"{text} into slots {', '.join(str(slot) for _, slot in decodes)}"
        return wrapped(slots if decodes and len(slots) <= width else text, width)   # if it fits

    def _cells(self, pool, per_cell, pinned):
        """A cell per per_cell blocks of a tier: see pools(). pinned: its blocks pinned."""
        tables = [(set(seq.block_table), seq.request_id) for seq in pool.seqs.values()]
        # (tier name, block id) of each block a copy not made yet reads or writes (section 9)
        in_flight = self.llm.copy_engine.in_flight if self.llm.copy_engine else {}
        cells = Text()
        for i in range(0, len(pool.blocks), per_cell):
            group = pool.blocks[i:i + per_cell]
            used = [b for b in group if b.ref_count]
            if per_cell == 1 and (pool.name, group[0].block_id) in in_flight:
                cells.append("~", "bold cyan")
            elif not used:
                cells.append("·" if any(b.hash is not None for b in group) else ".", "dim")
            elif per_cell > 1:
                cells.append("█" if len(used) == len(group) else "▒", "bold")
            else:
                # its ref_count in its request's colour (white: several's), bold if shared
                b = used[0]
                requests = {request_id for table, request_id in tables if b.block_id in table}
                hue = "white" if len(requests) > 1 else HOLDER_COLOURS[min(requests, default=0) % 8]
                style = f"bold {hue}" if b.ref_count > 1 else hue
                if b.block_id in pinned:
                    style += " underline"
                cells.append(str(b.ref_count) if b.ref_count < 10 else "+", style)
        return cells

    def pools(self, width, max_rows):
        """Each tier's rows of cells, then a key to the symbols."""
        tiers = [pool for pool in self.llm.block_manager.tiers if pool.blocks]
        n = 64 if width >= 76 else 32   # cells a row
        lines, folds = [], []
        # the device blocks pinned, in order
        pinned = sorted(b for seq in self.llm.pins.values() for b in seq.block_table)
        for pool in tiers:
            rows = max(1, max_rows // len(tiers)) if max_rows else math.inf   # None: all blocks
            per_cell = max(1, math.ceil(len(pool.blocks) / (n * rows)))
            cells = self._cells(pool, per_cell, pinned if pool is tiers[0] else [])
            # each row led by its first block's id
            lines += [Text(f"{pool.name if i == 0 else '':<6}{i * per_cell:>5} ") + cells[i:i + n]
                      for i in range(0, len(cells), n)]
            if per_cell > 1:
                folds.append(f"{pool.name}: {per_cell} blocks a cell")
        key = ["digit: ref_count in its request's colour", "white: several", "bold: shared",
               "+: 10 or more", "·: cached", ".: free", "table: *: shared, (+k): k more",
               "host[...]: in the host pool"]
        if pinned:
            key.append(f"underlined: pinned (blocks {_ids(pinned)})")
        if self.llm.copy_engine:
            key.append("~: in flight (its copy not made yet)")
        if folds:
            key += folds + ["█ all used, ▒ some used, · some cached, . all free"]
        return lines + phrases(key, width, "dim")

    def sequences(self, width):
        """A row per live sequence: K/V, table, text."""
        bm, sched = self.llm.block_manager, self.llm.scheduler
        # under scheduling_policy="priority", each request's priority: effective (as given)
        ranked = isinstance(sched, PriorityScheduler)
        header = (f"{'seq':>5} {'req':>4}{'  priority' if ranked else ''}  {'state':<8} "
                  f"{'K':>4}/{'V':<4}  ")
        lines = [Text(f"{header}{'block table':<26} text", "bold")]
        for request in [*sched.running, *sched.swapped, *sched.waiting]:
            pool = bm.host if request.status is RequestStatus.SWAPPED else bm.device
            # a table into the host: host[...]
            where = "" if pool is bm.device else pool.name
            state = request.status.value
            # loading: its blocks in flight (section 9)
            if self.llm.copy_engine and self.llm.copy_engine.loading(request):
                state = "loading"
            for seq in request.seqs:
                table = where + table_text(pool.blocks, seq.block_table, 26 - len(where))
                line = Text(f"{seq.seq_id:>5} {seq.request_id:>4}",
                            HOLDER_COLOURS[seq.request_id % 8])
                if ranked:
                    line.append(f"  {sched.rank(request)[0]:>3} ({request.priority:>2})")
                line.append(f"  {state:<8} {seq.num_written_tokens:>4}/{len(seq):<4}  {table:<26} ")
                room = max(0, width - len(line))
                tail = seq.token_ids[-room:] if room else []
                line.append(printable(self.llm._detokenize(tail)
                                      or " ".join(map(str, tail)))[-room:])
                lines.append(line)
                # under a request's first row: its prompt's record (section 8)
                if seq is request.seqs[0] and request.sources:
                    words = source_words(request.sources, bm.block_size)
                    lines += wrapped(f"{' ' * 11}prompt: {words}", width, "dim", 13)
        return lines

def save_svg(llm, folder, report):
    """An on_step callback (bound to llm and folder): the view of the step saved as an SVG image
    (rich's export), step-N.svg, in colour, its columns as on a terminal: a picture for a slide."""
    console = Console(record=True, width=100, file=io.StringIO(), color_system="truecolor")
    console.print(View(llm, live=False, console=console).frame(report))
    console.save_svg(os.path.join(folder, f"step-{report.step}.svg"),
                     title=f"nanopaged: step {report.step}")

# ----------------------------------------------------------------------------------------------
# 14. Command line: demos that provoke each mechanism, watched live or traced

SYSTEM = "You are a helpful assistant. Answer in one short sentence."
QUESTIONS = ["What is a cache?", "Why is the sky blue?", "What makes a number prime?",
             "Name a planet.", "What does a scheduler do?"]
DEMOS = {   # name: what it shows
    "mix": "most of the below in one small pool (the default)",
    "prefix": "a system prompt computed once, found by later requests (one word changed: none); "
              "why each prompt token missed; in a small pool, a preempted request and an evicted "
              "prefix",
    "fork": "n=4 samples share their prompt's blocks; the last block is copied on write",
    "beam": "beam search, width 3: beams fork and die on shared blocks",
    "preempt": "five requests, a small pool: swapped out, or recomputed when host blocks run "
               "short",
    "evict": "finished requests' blocks stay cached until new prompts evict them, oldest first",
    "batching": "continuous batching: requests arrive while others decode and join their steps",
    "chunked": "chunked prefill: a long prompt computed over steps, 8 tokens a step with a "
               "decode",
    "watermark": "a request that would fit waits: it would leave no block for the next decode",
    "tiers": "two questions come back: their blocks, written down to host and disk, load back "
             "up",
    "overlap": "the tiers demo over slow links, copies in the background: others run meanwhile",
    "priority": "a long request of priority 1 among short ones of 0: it waits, aging lets it in",
}
# each demo's pool, of 4-token blocks: small enough for a screen to show every block
DEMO_POOLS = {
    "mix": dict(num_blocks=24, num_cpu_blocks=12, preemption_mode="swap"),
    "preempt": dict(num_blocks=36, num_cpu_blocks=14, preemption_mode="swap"),
    "chunked": dict(num_blocks=48, max_num_batched_tokens=8),
    "fork": dict(num_blocks=48),
    "evict": dict(num_blocks=12),
    "watermark": dict(num_blocks=100),   # a watermark of 1 block
    "tiers": dict(num_blocks=24, num_cpu_blocks=4, num_disk_blocks=12),
    "prefix": dict(num_blocks=20),
    "beam": dict(num_blocks=64),
    "batching": dict(num_blocks=64),
    "priority": dict(num_blocks=16, scheduling_policy="priority", priority_aging_steps=3),
}
# links of 20 and 10 MB/s: a 4-token block of the default model (184 KB) takes 9 and 18 ms, a
# good part of a step on a CPU, as 2,000 tokens of history over PCIe and NVMe take on a GPU server
DEMO_POOLS["overlap"] = dict(DEMO_POOLS["tiers"], async_copies=True,
                             tier_gbps={"host": 0.02, "disk": 0.01})


def demo_arrivals(name, llm):
    """A demo's requests to llm, [(step, prompts, params[, priority])]: each queued once the
    engine has run `step` steps (an idle engine skips ahead to the next): a trace repeats."""

    def text(s, length=None, system=""):
        """Token ids of a chat: the system prompt, then s from the user, in the model's chat
        template (random weights: two made-up ids a word, as long as a chat); repeated, then cut
        to length from the front (a chat ends as its template ends it)."""
        if isinstance(s, str) and llm.tokenizer is not None:
            # a model with no chat template (a base model) reads the plain text
            if llm.tokenizer.chat_template:
                chat = [{"role": "system", "content": system}, {"role": "user", "content": s}]
                s = llm.tokenizer.apply_chat_template(chat, tokenize=False,
                                                      add_generation_prompt=True)
            else:
                s = f"{system} {s}".strip()
            s = tokenize(llm, s)
        elif isinstance(s, str):
            vocab = llm.model.config.vocab_size
            s = [n % vocab for w in f"{system} {s}".split() for n in (sum(w.encode()), len(w))]
        return (s * length)[-length:] if length else s

    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    def one_every(steps, prompts):
        """A greedy request every `steps` steps, one per prompt."""
        return [(steps * i, [prompt], greedy) for i, prompt in enumerate(prompts)]

    longer = dataclasses.replace(greedy, max_tokens=24)
    samples = SamplingParams(temperature=0.8, n=4, max_tokens=10, ignore_eos=True, seed=0)
    pair = dataclasses.replace(samples, n=2, max_tokens=24, seed=1)
    beams = BeamSearchParams(beam_width=3, max_tokens=8, ignore_eos=True)
    ask = [text(q, system=SYSTEM) for q in QUESTIONS]
    # one word differs
    friendly = text(QUESTIONS[0], system=SYSTEM.replace("helpful", "friendly"))
    every_question = text(" ".join(QUESTIONS), system=SYSTEM)
    # tiers: two questions, three requests that push their blocks down, the two again
    # priority: a long request of priority 1, then short ones of priority 0 (the default), one
    # every 3 steps
    short = one_every(3, map(text, QUESTIONS * 4))
    arrivals = {
        "mix": [(0, ask[:1], samples), (10, ask[1:4], longer), (10, ask[4:], pair),
                (60, [text(QUESTIONS[0])], beams)],
        "prefix": [(0, ask[:1], greedy), (12, ask[1:3] + [friendly], greedy),
                   (24, [friendly], greedy)],
        "fork": [(0, [text("Write a haiku about memory:")], samples)],
        "beam": [(0, [text("The capital of France is")], beams)],
        "preempt": [(0, ask, longer)],
        "evict": one_every(12, ask[:4] + ask[3:4]),
        "batching": one_every(3, ask[:4]),
        "chunked": [(0, ask[:1], longer), (4, [every_question], greedy)],
        # 200 tokens (50 blocks), then 196 (49): at step 2 the first has taken its 51st block
        "watermark": [(0, [text(f"{QUESTIONS[0]} " * 40, 200)], greedy),
                      (1, [text(f"{QUESTIONS[1]} " * 40, 196)], greedy)],
        "tiers": [(0, ask[:2], greedy), (12, ask[2:], greedy), (24, ask[:2], greedy)],
        "priority": [(0, ask[:1], longer, [1])] + short,
    }
    return arrivals[name.replace("overlap", "tiers")]


def demo_pool(name, block_size):
    """A demo's pool: DEMO_POOLS counts 4-token blocks, smaller ones get more."""
    # a block_size < 1 is refused by check_args
    scale = max(1, 4 // max(1, block_size))
    # blocking copies but in overlap (its pool says so): each trace repeats exactly
    pool = {"async_copies": False}
    for knob, value in DEMO_POOLS[name].items():
        pool[knob] = value * scale if knob.startswith("num_") else value
    return pool


def run_arrivals(llm, arrivals):
    """Queue each arrival (step, prompts, params[, priority]) once the engine has run `step`
    steps (an idle engine skips ahead to it), and step until all are done: their request ids."""
    request_ids = []
    for step, prompts, params, *priority in arrivals:
        while llm.num_steps < step and llm.scheduler.has_unfinished():
            llm.step()
        request_ids += llm.add_requests(prompts, params, type(params), *priority)
    while llm.scheduler.has_unfinished():
        llm.step()
    return request_ids


def run_demo(llm, name, live=False, trace=False, delay=0.0):
    """Run a demo (every request checked first), print its outputs; return its seconds."""
    arrivals = demo_arrivals(name, llm)
    for _, prompts, params, *priority in arrivals:
        checked_requests(llm, prompts, params, type(params), *priority)
    t0 = time.perf_counter()
    with View(llm, live, None, delay) if live or trace else contextlib.nullcontext():
        request_ids = run_arrivals(llm, arrivals)
    for request_id in request_ids:
        out = llm.output(request_id)
        beams = isinstance(out, BeamSearchOutput)
        for c in out.sequences if beams else out.outputs:
            how = f"score {c.score:.3f}" if beams else c.finish_reason
            print(f"[{out.request_id}] {c.text or c.token_ids!r}  ({how})")
    return time.perf_counter() - t0


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message):
        """Bad input on the command line: one line, exit status 2 (argparse's own prints its
        usage first)."""
        self.exit(2, f"{self.prog}: error: {message}\n")


# the flags that set LLM's knobs (EngineArgs, dest the knob's name) over the demo's pool:
# flag -> (type, help); --host-gbps and --disk-gbps make tier_gbps
KNOB_FLAGS = {
    "--model": (str, "None: SmolLM2-135M-Instruct; a directory; random:<preset>"),
    "--device": (str, "cpu or cuda (default: cuda if available)"),
    "--num-blocks": (int, "blocks in the pool (default: the demo's)"),
    "--num-cpu-blocks": (int, "blocks in the host pool (swap, offload)"),
    "--num-disk-blocks": (int, "blocks in the disk pool (offload)"),
    "--disk-path": (str, "the disk pool's file (default: a temporary one)"),
    "--preemption-mode": (str, "recompute, swap or auto (see README)"),
    "--kv-cache-dtype": (str, "auto (the model's dtype) or int8"),
    "--offload-kv-cache-dtype": (str, "auto or int8: the host's and the disk's"),
    "--scheduling-policy": (str, "fcfs (the default) or priority"),
    "--eviction-policy": (str, "lru (the default), fifo, lfu or leaf: the device's victims"),
    "--priority-aging-steps": (int, "a level better every K steps waited"),
    "--max-num-batched-tokens": (int, "tokens a step computes at most"),
    "--max-num-seqs": (int, "sequences running at once, at most"),
    "--watermark-blocks": (int, "blocks a new prompt leaves free for decodes (default: 1%% of "
                                "the pool)"),
    "--host-gbps": (float, "emulate a host link of this many GB/s"),
    "--disk-gbps": (float, "emulate a disk link of this many GB/s"),
}


def parse_args(argv):
    p = ArgumentParser(
        description="nanopaged: run a demo through a paged KV cache and watch its blocks",
        epilog="demos: " + "; ".join(f"{name}: {what}" for name, what in DEMOS.items()))
    p.add_argument("--demo", default="mix", choices=DEMOS, help="which demo to run (see below)")
    p.add_argument("--live", action="store_true", help="redraw the pool and tables every step")
    p.add_argument("--trace", action="store_true", help="print a plain snapshot every step")
    p.add_argument("--delay", type=float, default=0.0,
                   help="seconds (at most 60) to pause after each step, and per event it shows")
    p.add_argument("--svg", help="save each step's view as an SVG image in this folder")
    p.add_argument("--block-size", type=int, default=4, help="tokens per KV cache block")
    p.add_argument("--no-prefix-caching", action="store_false", dest="enable_prefix_caching",
                   help="turn the prefix cache off")
    for flag, (kind, what) in KNOB_FLAGS.items():
        p.add_argument(flag, type=kind, help=what)
    return p, p.parse_args(argv)


def engine_knobs(args):
    """The knobs the command line gives LLM: the demo's pool, then each flag given (None: not)."""
    knobs = demo_pool(args.demo, args.block_size)
    for f in dataclasses.fields(EngineArgs):
        value = getattr(args, f.name, None)   # None: not a flag, or not given
        if value is not None:
            knobs[f.name] = value
    links = {"host": args.host_gbps, "disk": args.disk_gbps}
    links = {tier: gbps for tier, gbps in links.items() if gbps is not None}
    if links:
        knobs["tier_gbps"] = {**knobs.get("tier_gbps", {}), **links}
    return knobs


def main(argv=None):   # argv: the command line's (sys.argv[1:]), or a list
    p, args = parse_args(argv)
    # bad input, ours as the engine's: a ValueError, told in one line before anything runs
    try:
        require(0 <= args.delay <= 60, "--delay must be in [0, 60] seconds")   # as --help says
        require(args.live or args.trace or not args.delay, "--delay needs --live or --trace")
        require(args.svg is None or os.path.isdir(args.svg) and os.access(args.svg, os.W_OK),
                f"--svg {args.svg!r}: not a folder you may write")
        llm = LLM(**engine_knobs(args))
        if args.svg:
            llm.on_step.append(functools.partial(save_svg, llm, args.svg))
        seconds = run_demo(llm, args.demo, args.live, args.trace, args.delay)
    except ValueError as e:   # bad input: nothing ran
        p.error(str(e))
    except KeyboardInterrupt:
        # Ctrl-C: the view has given the terminal back, its last frame (or the trace's last
        # step) above; 130: 128 + SIGINT
        p.exit(130, "interrupted\n")
    for k, v in llm.stats().items():
        # a trace repeats exactly: no timings
        if not (args.trace and k.endswith("_seconds")):
            print(f"{k:28} {v:.3f}" if isinstance(v, float) else f"{k:28} {v}")
    if not args.trace:   # a trace repeats exactly: it prints no timings
        print(f"{llm.num_generated_tokens / seconds:.1f} tokens/s generated in {seconds:.1f} s")


if __name__ == "__main__":
    main()

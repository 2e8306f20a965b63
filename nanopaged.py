"""
nanopaged.py: a paged KV cache inference engine you can read in one sitting.

What it teaches: how an LLM server manages the memory that holds every request's keys and values.
The KV cache is cut into fixed-size blocks, like pages of virtual memory; each sequence has a block
table mapping its logical blocks to physical ones. That one indirection buys:
  - no reservation: a sequence takes a block only when it fills the last one (little waste);
  - sharing: requests with the same prefix point at the same blocks (prefix caching, through a
    hash chain), samples of one prompt share its blocks (fork), counted by ref_count;
  - copy-on-write: a shared block is copied only when somebody must write into it;
  - preemption: when blocks run out, the newest request gives its blocks back, swapped to a CPU
    pool of the same block shape or freed to be recomputed later;
  - beam search on shared blocks: beams fork and die every step, their common prefix stays shared.

Read it in the order one request travels:
  1. SamplingParams, BeamSearchParams, Sequence     what a request is
  2. BlockManager        the block pool: allocate, prefix cache, fork, copy-on-write, free, swap
  3. Scheduler           which tokens run this step; preemption when blocks run out
  4. LLM                 the engine: block copies, tensors for the model, sampling, beam search
  5. command line

    python nanopaged.py                  generate from a few prompts with the default model
    python nanopaged.py --help           the knobs (block size, pool sizes, preemption, debug log)
"""
import argparse
import bisect
import itertools
import math
import sys
import time
from collections import Counter, OrderedDict, deque, namedtuple
from dataclasses import dataclass, field
from enum import Enum

import torch

from kernel import num_kv_splits_for
from model import Batch, load_model   # transformers is imported only when a model is loaded

# ----------------------------------------------------------------------------------------------
# 1. What a request is

def require(*checks):
    """Bad input stops at the API, before anything changes: ValueError with the first failing (ok, message)."""
    for ok, message in checks:
        if not ok:
            raise ValueError(message)

@dataclass
class SamplingParams:
    temperature: float = 1.0   # 0: greedy (argmax)
    top_p: float = 1.0         # keep the smallest set of tokens whose probability reaches top_p
    top_k: int = 0             # keep the k most likely tokens; 0: all
    max_tokens: int = 16
    n: int = 1                 # samples of one prompt; they share the prompt's blocks
    ignore_eos: bool = False
    seed: int | None = None    # None: derived from the engine's seed and the request id

    def __post_init__(self):
        require((self.temperature >= 0, f"temperature must be >= 0 (0 is greedy), got {self.temperature}"),
                (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
                (self.top_k >= 0, f"top_k must be >= 0 (0 keeps all tokens), got {self.top_k}"),
                (self.max_tokens >= 1, f"max_tokens must be >= 1, got {self.max_tokens}"),
                (self.n >= 1, f"n must be >= 1, got {self.n}"))

@dataclass
class BeamSearchParams:
    beam_width: int
    max_tokens: int = 16
    length_penalty: float = 1.0   # score = cum_logprob / num_output_tokens ** length_penalty
    ignore_eos: bool = False

    def __post_init__(self):
        require((self.beam_width >= 1, f"beam_width must be >= 1, got {self.beam_width}"),
                (self.max_tokens >= 1, f"max_tokens must be >= 1, got {self.max_tokens}"))

    @property
    def n(self):   # the most sequences the request holds at once: what _validate sizes the pool by
        return self.beam_width

class SequenceStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"

class Sequence:
    """One stream of tokens: a prompt and what was generated after it. n>1 sampling and beam search fork
    several from one request (request_id), which is preempted as a whole."""
    _seq_ids = itertools.count()

    def __init__(self, token_ids, params=None, request_id=None):
        self.seq_id = next(Sequence._seq_ids)
        self.request_id = self.seq_id if request_id is None else request_id
        self.params = params or SamplingParams()
        self.status = SequenceStatus.WAITING
        self.token_ids = list(token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.num_computed_tokens = 0   # tokens whose K/V are in the cache (computed or found there)
        self.num_cached_tokens = 0     # of those, found in the prefix cache at the last allocate
        self.block_table = []          # physical block ids; token i's slot: block_table[i // bs] * bs + i % bs
        self.block_hashes = []         # hash chain over this sequence's full blocks (see BlockManager)
        self.finish_reason = None      # "stop" (eos), "length" (max_tokens) or "pruned" (a beam that lost)
        self.prefill_until = 0         # tokens before this position are prefill (set at each admission)
        self.logprobs = None           # beam search: (vocab,) float32 next-token log-probs, on the CPU
        self.cum_logprob = 0.0         # beam search: the beam's total log-probability
        self.arrival_time, self.first_token_time, self.finish_time = time.perf_counter(), None, None

    def __len__(self):
        return len(self.token_ids)

    @property
    def num_output_tokens(self):
        return len(self.token_ids) - self.num_prompt_tokens

    def append_token(self, token_id):
        self.token_ids.append(token_id)

# ----------------------------------------------------------------------------------------------
# 2. The block pool

def _ids(xs):   # '4, 7, 12' for the event log
    return ", ".join(map(str, xs))

@dataclass
class Block:
    block_id: int
    ref_count: int = 0                 # live block tables that hold this block
    # set while the block is registered in the prefix cache (full, computed, immutable). A hit needs the
    # same hash, the same tokens, and parent_entry == entry of the block already matched before it: a hash
    # can collide and tokens say nothing of the prefix, but by induction the whole prefix then matches.
    hash: int | None = None            # chain hash of the whole prefix up to and including this block
    token_ids: tuple = ()              # this block's tokens
    entry: int | None = None           # registration number, never reused: children of an evicted block stop matching
    parent_entry: int | None = None    # the entry of the block before it in the chain (None: first block)

class BlockManager:
    """Hands out blocks of the KV cache pool. Three kinds of block at any moment:
    used (ref_count > 0), cached (ref_count 0 but registered in the prefix cache: its K/V may be
    reused until it is evicted) and free. Allocate and free are O(1). An optional CPU pool of the
    same block shape holds swapped-out requests."""

    def __init__(self, num_blocks, block_size, num_cpu_blocks=0, enable_prefix_caching=True, log_events=False):
        require((block_size >= 1 and not block_size & (block_size - 1),
                 f"block_size must be a positive power of two (1, 2, 4, ... 16 ...), got {block_size}"),
                (num_blocks >= 1 and num_cpu_blocks >= 0, f"need num_blocks >= 1, num_cpu_blocks >= 0: {num_blocks}, {num_cpu_blocks}"))
        self.num_blocks, self.block_size, self.num_cpu_blocks = num_blocks, block_size, num_cpu_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_block_ids = deque(range(num_blocks))   # truly free: nothing worth keeping inside
        self.cached_block_ids = OrderedDict()            # ref_count 0, registered; least recently freed first
        # the prefix cache: chain hash -> registered block ids, as an ordered set (more than one when two
        # requests computed the same prefix at once, or when hashes collide)
        self.hash_to_block_ids = {}
        self.entries = itertools.count()                 # numbers the prefix cache's registrations
        self.seqs = {}                                   # seq_id -> Sequence, every sequence holding device blocks
        # the CPU tier: swapped-out sequences hold CPU block ids in their block tables
        self.cpu_blocks = [Block(i) for i in range(num_cpu_blocks)]
        self.free_cpu_block_ids = deque(range(num_cpu_blocks))
        self.swapped_seqs = {}                           # seq_id -> Sequence, every sequence holding CPU blocks
        # metrics, counted as they happen (vLLM's names where vLLM has one)
        self.prefix_cache_queries = self.prefix_cache_hits = 0   # in tokens
        self.num_cow_copies = self.num_evictions = 0
        self.num_swapped_out_blocks = self.num_swapped_in_blocks = 0
        # what happened, as (kind, plain words), drained by the engine after every step: the story
        # (prefix hits, forks, copies, evictions, swaps, preemptions) in plain words, and with
        # log_events every single ref-count change, allocation and free too, for the debug log
        self.log_events, self.events = log_events, []

    def _debug(self, kind, seq, block_id, detail=""):   # cheap when off: no string is built
        if self.log_events:
            self.events.append((kind, f"seq {seq.seq_id}: block {block_id} {detail or 'ref %d' % self.blocks[block_id].ref_count}"))

    # -- the hash chain: h[i] = H(h[i-1], tokens of block i), so one dictionary look-up finds a whole
    #    prefix. Hashes can collide; _lookup checks what the hash only summarises.

    @staticmethod
    def compute_hash(parent_hash, token_ids):
        # the first block hashes its tokens alone, not (None, *tokens): before Python 3.12 hash(None)
        # changes from run to run; tuples of ints hash the same every run, so traces and tests repeat
        return hash(tuple(token_ids)) if parent_hash is None else hash((parent_hash, *token_ids))

    def _tokens(self, seq, i):
        return tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size])

    def _block_hash(self, seq, i):
        """Hash of seq's full block i, computed once and kept on the sequence."""
        while len(seq.block_hashes) <= i:
            j = len(seq.block_hashes)
            parent_hash = seq.block_hashes[j - 1] if j else None
            seq.block_hashes.append(self.compute_hash(parent_hash, self._tokens(seq, j)))
        return seq.block_hashes[i]

    def _lookup(self, seq, i, parent):
        """The cached block holding seq's full block i, or None. parent: the block that holds seq's
        block i-1 (None for i = 0), itself a hit. The candidate must hold the same tokens and have been
        registered after that very parent: by induction the whole prefix matches, whatever collides."""
        for block_id in self.hash_to_block_ids.get(self._block_hash(seq, i), ()):
            block = self.blocks[block_id]
            if block.token_ids == self._tokens(seq, i) and block.parent_entry == (parent.entry if parent else None):
                return block
        return None

    def _num_hittable_blocks(self, seq):
        # the last token is always computed (its logits are needed), so the block holding it cannot hit
        return (len(seq) - 1) // self.block_size if self.enable_prefix_caching else 0

    def _cache_hits(self, seq):
        hits = []
        for i in range(self._num_hittable_blocks(seq)):
            block = self._lookup(seq, i, hits[-1] if hits else None)
            if block is None:
                break   # a chain: after the first miss no later block can be this prefix's
            hits.append(block)
        return hits

    # -- taking and returning single blocks

    @property
    def num_free_blocks(self):
        """Blocks allocatable now: truly free ones plus cached ones nobody holds (evictable)."""
        return len(self.free_block_ids) + len(self.cached_block_ids)

    def _take_free_block(self, seq):
        if self.free_block_ids:
            block = self.blocks[self.free_block_ids.popleft()]
        else:   # evict the cached block freed longest ago: its K/V are lost to the prefix cache
            block = self.blocks[self.cached_block_ids.popitem(last=False)[0]]
            bucket = self.hash_to_block_ids[block.hash]
            del bucket[block.block_id]
            if not bucket:
                del self.hash_to_block_ids[block.hash]
            block.hash, block.token_ids, block.entry, block.parent_entry = None, (), None, None
            self.num_evictions += 1
            self.events.append(("evict", f"evict block {block.block_id} (cached, unused)"))
        block.ref_count = 1
        self._debug("allocate", seq, block.block_id)
        return block.block_id

    def _hold(self, block, seq):
        if block.ref_count == 0:   # a cached block comes back to life
            del self.cached_block_ids[block.block_id]
        block.ref_count += 1
        self._debug("ref+1", seq, block.block_id)

    def _release(self, block, seq):
        block.ref_count -= 1
        self._debug("ref-1", seq, block.block_id)
        if block.ref_count == 0 and block.hash is not None:
            self.cached_block_ids[block.block_id] = None    # most recently freed: evicted last
            self._debug("cache", seq, block.block_id, "kept for prefix hits")
        elif block.ref_count == 0:
            self.free_block_ids.append(block.block_id)
            self._debug("free", seq, block.block_id, "free")

    # -- whole sequences

    def _num_blocks_for(self, num_tokens):
        return (num_tokens + self.block_size - 1) // self.block_size

    def can_allocate(self, seq, watermark=0):
        """Would allocate(seq) leave at least `watermark` blocks free? Hits on cached (unheld)
        blocks take them out of the free count too; hits on held blocks cost nothing."""
        hits_on_held = sum(1 for b in self._cache_hits(seq) if b.ref_count > 0)
        return self.num_free_blocks - (self._num_blocks_for(len(seq)) - hits_on_held) >= watermark

    def allocate(self, seq):
        """Give seq blocks for all its tokens: prefix-cache hits first, fresh blocks for the rest."""
        assert not seq.block_table, f"seq {seq.seq_id} already holds blocks"
        hits = self._cache_hits(seq)
        for block in hits:
            self._hold(block, seq)
        seq.block_table = [b.block_id for b in hits]
        seq.block_table += [self._take_free_block(seq) for _ in range(self._num_blocks_for(len(seq)) - len(hits))]
        seq.num_cached_tokens = seq.num_computed_tokens = len(hits) * self.block_size
        if hits:
            self.events.append(("prefix hit", f"prefix hit: seq {seq.seq_id} reuses {len(hits)} blocks "
                                              f"({seq.num_cached_tokens} tokens): {_ids(seq.block_table[:len(hits)])}"))
        if self.enable_prefix_caching:
            self.prefix_cache_queries += len(seq)
            self.prefix_cache_hits += seq.num_cached_tokens
        self.seqs[seq.seq_id] = seq

    def _needs_new_block(self, seq):
        # the next step writes the K/V of seq's last token; its block may not exist yet
        return (len(seq) - 1) // self.block_size == len(seq.block_table)

    def _needs_copy(self, seq):
        # ... or exist but be shared, and a block with ref_count > 1 is never written
        return not self._needs_new_block(seq) and self.blocks[seq.block_table[-1]].ref_count > 1

    def can_append(self, seq):
        """Can append_slot(seq) get the block it needs (a new one, or a copy of a shared last block)?"""
        return self.num_free_blocks >= 1 or not (self._needs_new_block(seq) or self._needs_copy(seq))

    def append_slot(self, seq):
        """Make sure the slot of seq's last token exists and may be written. Returns (src, dst)
        when a shared block had to be copied first (copy-on-write), else None."""
        if self._needs_new_block(seq):
            seq.block_table.append(self._take_free_block(seq))
        elif self._needs_copy(seq):   # shared and partly filled: this writer gets its own copy
            src = self.blocks[seq.block_table[-1]]
            dst = self._take_free_block(seq)
            self._release(src, seq)
            seq.block_table[-1] = dst
            self.num_cow_copies += 1
            self.events.append(("copy", f"copy-on-write: seq {seq.seq_id} copies block {src.block_id} to {dst}"))
            return src.block_id, dst
        return None

    def fork(self, parent, child):
        """child shares every block of parent: no K/V is copied, each block's ref_count goes up."""
        for block_id in parent.block_table:
            self._hold(self.blocks[block_id], child)
        child.block_table = list(parent.block_table)
        child.block_hashes = list(parent.block_hashes)
        child.num_computed_tokens = parent.num_computed_tokens
        self.seqs[child.seq_id] = child
        refs = sorted({self.blocks[b].ref_count for b in parent.block_table})
        self.events.append(("fork", f"seq {child.seq_id} forked from seq {parent.seq_id}: blocks "
                                    f"{_ids(parent.block_table)} now ref {'/'.join(map(str, refs))}"))

    def free(self, seq):
        """Drop seq's hold on its blocks, tail first: the tail is freed earlier, so evicted before the
        prefix, which other requests are likelier to share. (A swapped-out seq gives back CPU blocks.)"""
        if self.swapped_seqs.pop(seq.seq_id, None) is not None:
            for cpu_id in seq.block_table:
                self._release_cpu(cpu_id)
        else:
            for block_id in reversed(seq.block_table):
                self._release(self.blocks[block_id], seq)
            self.seqs.pop(seq.seq_id, None)
        seq.block_table = []

    def cache_full_blocks(self, seq):
        """Register seq's blocks that are full and computed in the prefix cache (called after a step).
        Only then may another request reuse them: their K/V are in place and will never change."""
        if not self.enable_prefix_caching:
            return
        end = seq.num_computed_tokens // self.block_size
        start = end   # registered blocks form a prefix of the block table: find where it stops
        while start > 0 and self.blocks[seq.block_table[start - 1]].hash is None:
            start -= 1
        for i in range(start, end):
            block, parent = self.blocks[seq.block_table[i]], self.blocks[seq.block_table[i - 1]] if i else None
            block.hash, block.entry = self._block_hash(seq, i), next(self.entries)
            block.parent_entry = parent.entry if parent else None
            block.token_ids = self._tokens(seq, i)
            self.hash_to_block_ids.setdefault(block.hash, {})[block.block_id] = None
            self._debug("register", seq, block.block_id, f"registered, prefix cache entry {block.entry}")

    # -- the CPU tier: a whole request moves, each distinct block once, so sharing survives the trip

    def _request(self, seqs, request_id):
        return [s for s in seqs.values() if s.request_id == request_id]

    def can_swap_out(self, seq):
        distinct = {b for s in self._request(self.seqs, seq.request_id) for b in s.block_table}
        return len(distinct) <= len(self.free_cpu_block_ids)

    def swap_out(self, seq):
        """Move seq's request (all its sequences) to the CPU pool. Returns [(device_block, cpu_block)]
        for the engine to copy, one pair per distinct block."""
        mapping = {}   # device block id -> cpu block id
        for s in self._request(self.seqs, seq.request_id):
            for i in reversed(range(len(s.block_table))):   # tail first, as free() does
                block_id = s.block_table[i]
                if block_id not in mapping:
                    mapping[block_id] = self.free_cpu_block_ids.popleft()
                    self._debug("swap block", s, block_id, f"to cpu block {mapping[block_id]}")
                self.cpu_blocks[mapping[block_id]].ref_count += 1
                self._release(self.blocks[block_id], s)
                s.block_table[i] = mapping[block_id]
            self.swapped_seqs[s.seq_id] = self.seqs.pop(s.seq_id)
        self.num_swapped_out_blocks += len(mapping)
        self.events.append(("swap out", f"swap out seq {_ids(s.seq_id for s in self._request(self.swapped_seqs, seq.request_id))}: "
                                        f"blocks {_ids(mapping)} to cpu blocks {_ids(mapping.values())}"))
        return list(mapping.items())

    def _release_cpu(self, cpu_id):
        self.cpu_blocks[cpu_id].ref_count -= 1
        if self.cpu_blocks[cpu_id].ref_count == 0:
            self.free_cpu_block_ids.append(cpu_id)

    def can_swap_in(self, seq, watermark=0):
        """Room for the request's distinct blocks and for what its next step writes: a new block for
        a sequence whose last block is full, a copy for each extra holder of a shared last block."""
        writers = [s for s in self._request(self.swapped_seqs, seq.request_id) if len(s) > s.num_computed_tokens]
        distinct = {b for s in self._request(self.swapped_seqs, seq.request_id) for b in s.block_table}
        new = sum(self._needs_new_block(s) for s in writers)
        last = [s.block_table[-1] for s in writers if not self._needs_new_block(s)]
        copies = sum(min(last.count(b), self.cpu_blocks[b].ref_count - 1) for b in set(last))
        return self.num_free_blocks - len(distinct) - new - copies >= watermark

    def swap_in(self, seq):
        """Move seq's request back to the device pool. Returns [(cpu_block, device_block)]."""
        mapping = {}   # cpu block id -> device block id
        for s in self._request(self.swapped_seqs, seq.request_id):
            for i, cpu_id in enumerate(s.block_table):
                if cpu_id not in mapping:
                    mapping[cpu_id] = self._take_free_block(s)
                    self._debug("swap block", s, mapping[cpu_id], f"from cpu block {cpu_id}")
                else:
                    self._hold(self.blocks[mapping[cpu_id]], s)
                self._release_cpu(cpu_id)
                s.block_table[i] = mapping[cpu_id]
            self.seqs[s.seq_id] = self.swapped_seqs.pop(s.seq_id)
        self.num_swapped_in_blocks += len(mapping)
        self.events.append(("swap in", f"swap in seq {_ids(s.seq_id for s in self._request(self.seqs, seq.request_id))}: "
                                       f"cpu blocks {_ids(mapping)} to blocks {_ids(mapping.values())}"))
        return list(mapping.items())

    # -- the rules, checked

    def check_invariants(self):
        """Raises AssertionError naming the broken rule: ref_count, partition, cached, free, hash map, block table."""
        for pool, blocks, seqs in (("device", self.blocks, self.seqs), ("cpu", self.cpu_blocks, self.swapped_seqs)):
            holders = Counter(b for seq in seqs.values() for b in seq.block_table)
            for block in blocks:
                assert block.ref_count == holders[block.block_id], (f"ref_count: {pool} block {block.block_id} has ref_count "
                                                                    f"{block.ref_count}, {holders[block.block_id]} tables hold it")
        assert not set(self.seqs) & set(self.swapped_seqs), "partition: a sequence holds blocks in both pools"
        cpu_free = Counter(self.free_cpu_block_ids)
        assert all(cpu_free[b.block_id] == (b.ref_count == 0) for b in self.cpu_blocks), "partition: cpu free list"
        free, cached = set(self.free_block_ids), set(self.cached_block_ids)
        used = {b.block_id for b in self.blocks if b.ref_count > 0}
        assert len(free) == len(self.free_block_ids), "partition: a block is twice in the free pool"
        assert not (free & cached) and not (free & used) and not (cached & used), \
            f"partition: blocks in two states: {free & cached} free&cached, {free & used} free&used, {cached & used} cached&used"
        assert len(free) + len(cached) + len(used) == self.num_blocks, "partition: some block is in no state"
        assert all(self.blocks[b].hash is not None for b in cached), "cached: a cached block has no hash"
        assert all(self.blocks[b].hash is None for b in free), "free: a free block still carries a hash"
        for h, bucket in self.hash_to_block_ids.items():
            assert bucket and all(self.blocks[b].hash == h for b in bucket), f"hash map: {h} lists another's block"
        assert sum(b.hash is not None for b in self.blocks) == sum(map(len, self.hash_to_block_ids.values())), \
            "hash map: a block carries a hash the map does not know"
        for seq in self.seqs.values():   # a registered block holds exactly the prefix of every sequence holding it
            for i, block_id in enumerate(seq.block_table):
                block, parent = self.blocks[block_id], self.blocks[seq.block_table[i - 1]] if i else None
                assert block.hash is None or (block.token_ids == self._tokens(seq, i) and block.hash == self._block_hash(seq, i)
                                              and block.parent_entry == (parent.entry if parent else None)), \
                    f"hash map: seq {seq.seq_id} block {i} (physical {block_id}) is registered for another prefix"
        for seq in [*self.seqs.values(), *self.swapped_seqs.values()]:
            assert len(seq.block_table) in (self._num_blocks_for(len(seq)), self._num_blocks_for(len(seq) - 1)), \
                f"block table: seq {seq.seq_id} has {len(seq.block_table)} blocks for {len(seq)} tokens"

    # -- what the metrics read

    def num_used_blocks(self):
        return self.num_blocks - self.num_free_blocks

    def num_stored_tokens(self):
        """Distinct token slots holding K/V in used blocks: a shared block counts once."""
        filled = {}
        for seq in self.seqs.values():
            for i, block_id in enumerate(seq.block_table):
                n = min(self.block_size, max(0, seq.num_computed_tokens - i * self.block_size))
                filled[block_id] = max(filled.get(block_id, 0), n)
        return sum(filled.values())

# ----------------------------------------------------------------------------------------------
# 3. The scheduler: which tokens run this step

@dataclass
class ScheduledBatch:
    seqs: list = field(default_factory=list)             # sequences that run this step
    num_new_tokens: list = field(default_factory=list)   # tokens each computes: 1 (decode) or a prefill chunk
    num_tokens: int = 0                                  # sum of num_new_tokens
    # block copies to make before the model runs, in the order they were decided (a later one may
    # overwrite a block an earlier one reads): ("copy", src, dst) copy-on-write inside the device
    # pool, ("swap out", device, cpu) and ("swap in", cpu, device) between the pools
    block_copies: list = field(default_factory=list)

    def add(self, seq, budget):
        # a prompt longer than what is left of the budget is computed in chunks (chunked prefill)
        self.seqs.append(seq)
        self.num_new_tokens.append(min(len(seq) - seq.num_computed_tokens, budget - self.num_tokens))
        self.num_tokens += self.num_new_tokens[-1]

    def remove(self, seq):
        if seq in self.seqs:
            i = self.seqs.index(seq)
            self.num_tokens -= self.num_new_tokens[i]
            del self.seqs[i], self.num_new_tokens[i]

@dataclass
class PreemptionCost:
    """What preemption_mode='auto' weighs, measured on this machine. Recomputing a request costs a
    prefill of all its tokens: tokens * seconds_per_token, the engine's own average over its steps
    (an upper estimate: a step's fixed overhead is spread over its tokens). Swapping costs moving its
    distinct blocks out and back in: 2 * blocks * bytes_per_block / copy bandwidth, measured when
    the engine starts by timing a round trip of a few blocks."""
    bytes_per_block: int
    swap_bytes_per_second: float
    seconds_per_token: float = 0.0    # 0 until the first step is measured

    def observe_step(self, num_tokens, seconds):
        self.seconds_per_token = seconds / num_tokens if not self.seconds_per_token else \
            0.9 * self.seconds_per_token + 0.1 * seconds / num_tokens

    def swap_is_cheaper(self, num_tokens, num_blocks):
        return 2 * num_blocks * self.bytes_per_block / self.swap_bytes_per_second < num_tokens * self.seconds_per_token

class Scheduler:
    """First come, first served continuous batching. Each step: every running sequence gets its next
    token (or its next prefill chunk); then swapped-out requests come back; then waiting prompts are
    admitted while the token budget, max_num_seqs and free blocks allow. If a running sequence
    cannot get a block, the most recently arrived running request is preempted: swapped to the CPU
    pool, or freed to be recomputed, before any new request runs."""

    def __init__(self, block_manager, max_num_seqs=256, max_num_batched_tokens=2048, watermark=0.01,
                 eos_token_ids=(), preemption_mode="recompute", cost=None):
        self.block_manager = block_manager   # (LLM checks the arguments, before the model loads)
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.preemption_mode, self.cost = preemption_mode, cost
        # admitting a prompt must leave this many blocks free, so that the next step's decodes do
        # not have to preempt straight away
        self.watermark_blocks = int(watermark * block_manager.num_blocks)
        self.waiting = deque()     # FCFS; requests preempted by recompute go back to the front
        self.running = []          # kept in arrival order (request_id, then seq_id)
        self.swapped = []          # requests (lists of sequences) on the CPU pool, in arrival order
        self.finished = []
        self.num_preemptions = 0   # requests preempted (all their sequences at once), either way

    def add(self, seq):
        self.waiting.append(seq)

    def has_unfinished(self):
        return bool(self.waiting or self.running or self.swapped)

    def _start_running(self, seq):
        seq.status = SequenceStatus.RUNNING
        bisect.insort(self.running, seq, key=lambda s: (s.request_id, s.seq_id))

    def _schedule_running(self, seq, batch, budget):
        """seq's next token (or chunk) joins the batch, with the slot it writes."""
        if len(seq) == seq.num_computed_tokens or batch.num_tokens == budget:
            return   # a beam that waits for its siblings' logits, or no budget left this step
        copy = self.block_manager.append_slot(seq)
        if copy is not None:
            batch.block_copies.append(("copy", *copy))
        batch.add(seq, budget)

    def schedule(self) -> ScheduledBatch:
        bm, batch = self.block_manager, ScheduledBatch()
        budget = self.max_num_batched_tokens
        preempted = False
        # 1. running sequences, oldest request first: one decode token each, or the next prefill chunk
        for seq in list(self.running):
            if batch.num_tokens == budget:
                break
            while seq.status is SequenceStatus.RUNNING and not bm.can_append(seq):
                self.preempt(self.running[-1].request_id, batch)   # running is in arrival order
                preempted = True
            if seq.status is SequenceStatus.RUNNING:   # else it was the newest request: preempted itself
                self._schedule_running(seq, batch, budget)
        # 2. swapped requests come back before any new one, unless this step had to preempt
        while self.swapped and batch.num_tokens < budget and not preempted:
            request = self.swapped[0]
            if self.running and len(self.running) + len(request) > self.max_num_seqs:
                break
            if not bm.can_swap_in(request[0], self.watermark_blocks if self.running else 0):
                break
            self.swapped.pop(0)
            batch.block_copies += [("swap in", cpu, dev) for cpu, dev in bm.swap_in(request[0])]
            for seq in request:
                self._start_running(seq)
                self._schedule_running(seq, batch, budget)
        # 3. waiting requests in order, while nothing is swapped out and this step did not preempt
        while self.waiting and not self.swapped and batch.num_tokens < budget and not preempted:
            seq = self.waiting[0]
            # a new n>1 request forks into n sequences at its first token: count them all now
            num_seqs = seq.params.n if seq.num_output_tokens == 0 else 1
            if self.running and len(self.running) + num_seqs > self.max_num_seqs:
                break
            # with nothing running no decode can be starved, so a request may fill the whole pool
            if not bm.can_allocate(seq, self.watermark_blocks if self.running else 0):
                break
            self.waiting.popleft()
            bm.allocate(seq)
            seq.prefill_until = len(seq)
            self._start_running(seq)
            batch.add(seq, budget)
        # 4. stuck: every running sequence waits (beams for siblings still queued) and nothing fits:
        #    make room by recomputing the newest running request (a swap would bring it straight back)
        if not batch.seqs and self.running and (self.waiting or self.swapped):
            self.preempt(self.running[-1].request_id, batch, mode="recompute")
            retry = self.schedule()
            retry.block_copies[:0] = batch.block_copies   # a swap-out decided above still has to happen first
            return retry
        return batch

    def _choose_mode(self, victims):
        distinct = len({b for s in victims for b in s.block_table})
        if self.preemption_mode == "recompute" or not self.block_manager.can_swap_out(victims[0]):
            return "recompute"   # a full CPU pool falls back to recompute
        if self.preemption_mode == "swap":
            return "swap"
        if self.cost is None:
            return "swap"   # auto with no cost measured (a Scheduler built by hand): swap while it fits
        return "swap" if self.cost.swap_is_cheaper(sum(len(s) for s in victims), distinct) else "recompute"

    def preempt(self, request_id, batch, mode=None):
        """Take a running request's blocks back, all its sequences at once. Swap: move them to the CPU
        pool; it resumes where it was. Recompute: free them (the prefix cache may keep much of it) and
        queue the request at the front; its generated tokens stay and are computed again as prompt."""
        victims = [s for s in self.running if s.request_id == request_id]
        mode = mode or self._choose_mode(victims)
        held = len({b for s in victims for b in s.block_table})
        self.block_manager.events.append(("preempt", f"preempt seq {_ids(s.seq_id for s in victims)}: {mode}, "
                                                     f"{held} blocks " + ("to the CPU pool" if mode == "swap" else "given back")))
        for seq in victims:
            self.running.remove(seq)
            batch.remove(seq)
        if mode == "swap":
            batch.block_copies += [("swap out", dev, cpu) for dev, cpu in self.block_manager.swap_out(victims[0])]
            for seq in victims:
                seq.status = SequenceStatus.SWAPPED
            bisect.insort(self.swapped, victims, key=lambda g: g[0].request_id)
        else:
            for seq in victims:
                self.block_manager.free(seq)
                seq.status, seq.num_computed_tokens, seq.logprobs = SequenceStatus.WAITING, 0, None
            self.waiting.extendleft(reversed(victims))
        self.num_preemptions += 1
        return mode

    def postprocess(self, batch, sampled):
        """After the model ran: advance each sequence, register its newly full blocks in the prefix
        cache, append sampled tokens (forking n>1 samples at their first token), finish sequences.
        sampled: seq -> list of token ids (n of them at the first sample of an n>1 request)."""
        bm, now = self.block_manager, time.perf_counter()
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed_tokens += n
            bm.cache_full_blocks(seq)
            if seq not in sampled:
                continue   # in the middle of its prompt, or a beam (the engine picks beams)
            tokens = sampled[seq]
            samples = [seq] + [self.fork(seq) for _ in tokens[1:]]
            for s, token in zip(samples, tokens):
                s.append_token(token)
                s.first_token_time = s.first_token_time or now
                if token in self.eos_token_ids and not s.params.ignore_eos:
                    self.finish(s, "stop")
                elif s.num_output_tokens >= s.params.max_tokens:
                    self.finish(s, "length")

    def fork(self, parent):
        """A new sequence of parent's request sharing all its blocks (n>1 samples, beams)."""
        child = Sequence(parent.token_ids, parent.params, parent.request_id)
        child.num_prompt_tokens, child.arrival_time = parent.num_prompt_tokens, parent.arrival_time
        child.first_token_time, child.prefill_until = parent.first_token_time, parent.prefill_until
        self.block_manager.fork(parent, child)
        self._start_running(child)
        return child

    def finish(self, seq, reason):
        """reason: "stop" (eos), "length" (max_tokens), or "pruned" (a beam that lost)."""
        seq.status, seq.finish_reason, seq.finish_time = SequenceStatus.FINISHED, reason, time.perf_counter()
        self.block_manager.events.append(("finish", f"seq {seq.seq_id} {'pruned' if reason == 'pruned' else 'finished'} "
                                                    f"({reason}): {len(seq.block_table)} blocks released"))
        self.block_manager.free(seq)
        self.running.remove(seq)
        self.finished.append(seq)

# ----------------------------------------------------------------------------------------------
# 4. The engine

# what generate() and beam_search() return. outputs: n CompletionOutputs; finish_reason: "stop" (eos) or
# "length" (max_tokens); ttft: seconds from arrival to the first token; tpot: seconds per later token
# (mean over the samples); token_ids: the output's tokens, after the prompt; sequences: best score first
RequestOutput = namedtuple("RequestOutput", "request_id prompt_token_ids outputs ttft tpot")
CompletionOutput = namedtuple("CompletionOutput", "index token_ids text finish_reason")
BeamSearchOutput = namedtuple("BeamSearchOutput", "request_id prompt_token_ids sequences")
BeamSearchSequence = namedtuple("BeamSearchSequence", "token_ids text cum_logprob score")

class LLM:
    """The engine: owns the model, the KV cache pool, the block manager and the scheduler.
    generate() adds requests and runs step() until they finish; step() is one batch through the model."""

    def __init__(self, model=None, device=None, dtype=None, block_size=16, num_blocks=None, num_cpu_blocks=0,
                 enable_prefix_caching=True, max_num_seqs=256, max_num_batched_tokens=2048,
                 max_model_len=None, preemption_mode="auto", seed=0, swap_space=None, debug_blocks=False):
        # the arguments are checked before the model loads (BlockManager checks some again, for its own callers)
        require((block_size >= 1 and not block_size & (block_size - 1),
                 f"block_size must be a positive power of two (1, 2, 4, ... 16 ...), got {block_size}"),
                (preemption_mode in ("recompute", "swap", "auto"),
                 f"preemption_mode must be 'recompute', 'swap' or 'auto', got {preemption_mode!r}"),
                (preemption_mode != "swap" or num_cpu_blocks or swap_space,
                 "preemption_mode='swap' needs a CPU pool: num_cpu_blocks > 0 (or swap_space in GiB), or use 'recompute'"),
                (max_num_seqs >= 1 and max_num_batched_tokens >= 1, "max_num_seqs and max_num_batched_tokens must be >= 1"),
                ((num_blocks is None or num_blocks >= 1) and num_cpu_blocks >= 0 and (swap_space or 0) >= 0,
                 f"num_blocks must be >= 1 (or None: from a memory budget), num_cpu_blocks and swap_space >= 0; "
                 f"got {num_blocks}, {num_cpu_blocks}, {swap_space}"))
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        self.dtype = dtype or (torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        self.model, self.tokenizer, eos_token_ids = load_model(model, self.device, self.dtype, seed)
        cfg = self.model.config
        self.max_model_len = max_model_len or cfg.max_position_embeddings
        # a block holds K and V of block_size tokens in every layer: one block id serves all layers
        bytes_per_block = 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * self.dtype.itemsize
        num_blocks = num_blocks if num_blocks is not None else self._default_num_blocks(bytes_per_block)
        shape = (2, cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.kv_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)  # (2, num_layers, num_blocks, block_size, kv_heads, head_dim)
        # the CPU tier: the same block shape in host memory, pinned on CUDA so copies run asynchronously
        num_cpu_blocks = num_cpu_blocks or int((swap_space or 0) * (1 << 30) // bytes_per_block)
        self.cpu_cache = torch.zeros(shape[:2] + (num_cpu_blocks,) + shape[3:], dtype=self.dtype,
                                     pin_memory=self.device.type == "cuda")  # (2, num_layers, num_cpu_blocks, block_size, kv_heads, head_dim)
        self.block_manager = BlockManager(num_blocks, block_size, num_cpu_blocks, enable_prefix_caching, debug_blocks)
        cost = PreemptionCost(bytes_per_block, self._measure_swap_bandwidth()) if num_cpu_blocks else None
        self.scheduler = Scheduler(self.block_manager, max_num_seqs, max_num_batched_tokens,
                                   eos_token_ids=eos_token_ids, preemption_mode=preemption_mode, cost=cost)
        self.debug_blocks = debug_blocks
        self.num_sms = torch.cuda.get_device_properties(self.device).multi_processor_count if self.device.type == "cuda" else 0
        self.seed = seed
        self.request_ids = itertools.count()
        self.generators = {}   # request_id -> torch.Generator: each request samples from its own stream
        self.beams = {}        # request_id -> its live beams (Sequences), for beam_search requests
        self.completed_beams = {}   # request_id -> [(output token ids, cum_logprob)] that ended
        self.num_steps = self.num_prefill_tokens_computed = self.num_generated_tokens = 0

    def _measure_swap_bandwidth(self):
        """Bytes per second of a device -> CPU -> device round trip of a few blocks (PreemptionCost)."""
        n = min(8, self.kv_cache.shape[2], self.cpu_cache.shape[2])
        for _ in range(2):   # the first round warms up
            t0 = time.perf_counter()
            self.copy_blocks([("swap out", i, i) for i in range(n)] + [("swap in", i, i) for i in range(n)])
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            seconds = time.perf_counter() - t0
        return 2 * self.kv_cache[:, :, :n].numel() * self.dtype.itemsize / max(seconds, 1e-9)

    def _default_num_blocks(self, bytes_per_block):
        # on CUDA most of what the weights leave free (as vLLM's gpu_memory_utilization); 1 GiB on a CPU
        budget = 0.8 * torch.cuda.mem_get_info(self.device)[0] if self.device.type == "cuda" else 1 << 30
        return max(1, int(budget // bytes_per_block))

    # -- requests in

    def _validate(self, token_ids, params):
        """Everything that could go wrong with a request, checked before anything changes."""
        vocab, bs, total = self.model.config.vocab_size, self.block_manager.block_size, len(token_ids) + params.max_tokens
        bad = [t for t in token_ids if not (isinstance(t, int) and 0 <= t < vocab)]
        # worst case: the prompt's full blocks shared, every sample's own blocks at full length
        need = len(token_ids) // bs + params.n * (math.ceil(total / bs) - len(token_ids) // bs)
        require((params.n <= self.scheduler.max_num_seqs, f"n (or beam_width) {params.n} > max_num_seqs {self.scheduler.max_num_seqs}"),
                (token_ids, "empty prompt: a prompt needs at least one token"),
                (not bad, f"token id {bad[:1]} is outside the vocabulary: ids must be ints in [0, {vocab})"),
                (total <= self.max_model_len, f"prompt ({len(token_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                                              f"max_model_len ({self.max_model_len})"),
                (need <= self.block_manager.num_blocks, f"the pool is too small for this request: it may need {need} blocks of "
                 f"{bs} tokens, the pool has {self.block_manager.num_blocks}; raise num_blocks or lower max_tokens or n"))

    def _tokenize(self, prompt):
        if isinstance(prompt, str):
            require((self.tokenizer, "this model has no tokenizer (random weights): pass prompts as lists of token ids"))
            return self.tokenizer.encode(prompt, add_special_tokens=False)
        return list(prompt)

    def add_requests(self, prompts, params=None, kind=SamplingParams):
        """Validate all, then queue all: a bad prompt leaves the engine as it was. Returns request ids."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = params or kind()
        params = params if isinstance(params, list) else [params] * len(prompts)
        require((len(params) == len(prompts), f"{len(params)} {kind.__name__} for {len(prompts)} prompts: give one, or one each"),
                (all(isinstance(p, kind) for p in params), f"expected {kind.__name__}, got {type(params[0]).__name__} "
                 "(generate takes SamplingParams, beam_search takes BeamSearchParams)"))
        token_lists = [self._tokenize(p) for p in prompts]
        for token_ids, p in zip(token_lists, params):
            self._validate(token_ids, p)
        request_ids = []
        for token_ids, p in zip(token_lists, params):
            request_id = next(self.request_ids)
            seed = self.seed * 1_000_003 + request_id if getattr(p, "seed", None) is None else p.seed
            self.generators[request_id] = torch.Generator().manual_seed(seed)
            self.scheduler.add(Sequence(token_ids, p, request_id))
            request_ids.append(request_id)
        return request_ids

    def generate(self, prompts, params=None):
        """prompts: a string, a list of strings or a list of token-id lists; params: one for all, or one
        per prompt. Returns one RequestOutput per prompt, in order."""
        request_ids = self.add_requests(prompts, params)
        while self.scheduler.has_unfinished():
            self.step()
        return [self._output(r) for r in request_ids]

    def beam_search(self, prompts, params):
        """Keep the beam_width most likely continuations of each prompt. Beams of one request share
        their common prefix's blocks: a beam chosen twice forks (ref_count + 1, no copy), a beam not
        chosen is freed, and only a shared, partly filled last block is ever copied (on write).
        Returns one BeamSearchOutput per prompt, its sequences best first."""
        request_ids = self.add_requests(prompts, params, kind=BeamSearchParams)
        for r in request_ids:
            self.beams[r] = [s for s in self.scheduler.waiting if s.request_id == r]
            self.completed_beams[r] = []
        while self.scheduler.has_unfinished():
            self.step()
        return [self._beam_output(r) for r in request_ids]

    def _beam_round(self, request_id):
        """Every live beam has its next-token log-probs: pick the new beams (vLLM's rule). Each beam
        offers its 2 * beam_width best tokens; an eos candidate ends (completed), the beam_width best
        others by cumulative log-prob live on."""
        params, beams = self.beams[request_id][0].params, self.beams[request_id]
        candidates = []   # (cum_logprob, parent beam, token)
        for beam in beams:
            top = beam.logprobs.topk(2 * params.beam_width)
            candidates += [(beam.cum_logprob + lp, beam, t) for lp, t in zip(top.values.tolist(), top.indices.tolist())]
            beam.logprobs = None
        ends = lambda t: t in self.scheduler.eos_token_ids and not params.ignore_eos
        for cum, beam, t in candidates:
            if ends(t):   # an eos candidate is a finished sequence: keep its tokens and score, no blocks
                self.completed_beams[request_id].append((beam.token_ids[beam.num_prompt_tokens:] + [t], cum))
                self.num_generated_tokens += 1
        chosen = sorted((c for c in candidates if not ends(c[2])), key=lambda c: c[0], reverse=True)[:params.beam_width]
        new_beams = []
        for beam in beams:   # fork first (children copy the parent's tokens), then append
            picks = [(c, t) for c, b, t in chosen if b is beam]
            if not picks:
                self.scheduler.finish(beam, "pruned")
                continue
            family = [beam] + [self.scheduler.fork(beam) for _ in picks[1:]]
            for child, (cum, t) in zip(family, picks):
                child.append_token(t)
                child.cum_logprob = cum
            new_beams += family
        self.num_generated_tokens += len(new_beams)
        if new_beams and new_beams[0].num_output_tokens >= params.max_tokens:   # out of tokens: the live beams end here
            for beam in new_beams:
                self.completed_beams[request_id].append((beam.token_ids[beam.num_prompt_tokens:], beam.cum_logprob))
                self.scheduler.finish(beam, "length")
            new_beams = []
        self.beams[request_id] = new_beams

    def _pop_finished(self, request_id):
        """The request's finished sequences, oldest first, taken out of the scheduler's list."""
        seqs = sorted((s for s in self.scheduler.finished if s.request_id == request_id), key=lambda s: s.seq_id)
        self.scheduler.finished = [s for s in self.scheduler.finished if s.request_id != request_id]
        self.generators.pop(request_id)
        return seqs

    def _beam_output(self, request_id):
        del self.beams[request_id]   # [] by now: every beam ended, into completed_beams
        first = self._pop_finished(request_id)[0]
        params = first.params
        score = lambda tokens, cum: cum / len(tokens) ** params.length_penalty
        best = sorted(self.completed_beams.pop(request_id), key=lambda c: score(*c), reverse=True)[:params.beam_width]
        return BeamSearchOutput(request_id, first.token_ids[:first.num_prompt_tokens],
                                [BeamSearchSequence(t, self._detokenize(t), c, score(t, c)) for t, c in best])

    def _output(self, request_id):
        seqs = self._pop_finished(request_id)
        outs = [CompletionOutput(i, s.token_ids[s.num_prompt_tokens:], self._detokenize(s.token_ids[s.num_prompt_tokens:]),
                                 s.finish_reason) for i, s in enumerate(seqs)]
        ttft = seqs[0].first_token_time - seqs[0].arrival_time
        tpot = sum((s.finish_time - s.first_token_time) / max(1, s.num_output_tokens - 1) for s in seqs) / len(seqs)
        return RequestOutput(request_id, seqs[0].token_ids[:seqs[0].num_prompt_tokens], outs, ttft, tpot)

    def _detokenize(self, token_ids):
        return self.tokenizer.decode(token_ids, skip_special_tokens=True) if self.tokenizer else ""

    # -- one step

    def step(self):
        """Schedule, copy blocks, run the model on one flat batch, sample, postprocess. Returns the batch."""
        t0 = time.perf_counter()
        batch = self.scheduler.schedule()
        assert batch.seqs, "the scheduler found nothing to run (a request too large for the pool?)"
        # 1. block copies, in the order the scheduler decided them, before anybody writes into a block
        self.copy_blocks(batch.block_copies)
        # 2. the batch as tensors (model.Batch), and which sequences get a next token this step
        model_batch, samplers = self._prepare(batch)
        # 3. the model writes every new token's K/V into its slot and returns logits for the samplers
        logits = self.model(model_batch, self.kv_cache).cpu()   # (num_sampled, vocab)
        # 4. sampling: n tokens at the first sample of an n>1 request (those fork), else one;
        #    a beam keeps its log-probs until all beams of its request have theirs
        sampled = {}
        for seq, row in zip(samplers, logits):
            if isinstance(seq.params, BeamSearchParams):
                seq.logprobs = row.log_softmax(-1)
            else:
                n = seq.params.n if seq.num_output_tokens == 0 else 1
                sampled[seq] = self._sample(row, seq.params, self.generators[seq.request_id], n)
        # 5. metrics, then the scheduler advances the sequences
        for seq, n in zip(batch.seqs, batch.num_new_tokens):   # tokens before prefill_until are prefill
            self.num_prefill_tokens_computed += max(0, min(seq.num_computed_tokens + n, seq.prefill_until) - seq.num_computed_tokens)
        self.num_generated_tokens += sum(len(t) for t in sampled.values())
        self.scheduler.postprocess(batch, sampled)
        # 6. beam search: a round ends when every live beam of a request is running with its log-probs
        for request_id, beams in self.beams.items():
            if beams and all(b.logprobs is not None and b.status is SequenceStatus.RUNNING
                             and b.num_computed_tokens == len(b) for b in beams):
                self._beam_round(request_id)
        self.num_steps += 1
        if self.scheduler.cost is not None:
            self.scheduler.cost.observe_step(batch.num_tokens, time.perf_counter() - t0)
        events, self.block_manager.events = self.block_manager.events, []
        if self.debug_blocks:   # the debug log: every block event of this step
            for kind, text in events:
                print(f"step {self.num_steps:5}  {kind:10}  {text}", file=sys.stderr)
        return batch

    def copy_blocks(self, block_copies):
        """Carry out a ScheduledBatch's block copies, in order: each moves every layer's K and V of one block."""
        for kind, src, dst in block_copies:
            if kind == "copy":        # copy-on-write inside the device pool
                self.kv_cache[:, :, dst].copy_(self.kv_cache[:, :, src])
            elif kind == "swap out":  # device -> pinned host memory; the CUDA stream keeps the order
                self.cpu_cache[:, :, dst].copy_(self.kv_cache[:, :, src], non_blocking=True)
            else:                     # swap in: host -> device
                self.kv_cache[:, :, dst].copy_(self.cpu_cache[:, :, src], non_blocking=True)

    def _prepare(self, batch):   # ScheduledBatch -> (model.Batch, samplers); shapes: model.Batch
        bs = self.block_manager.block_size
        input_ids, positions, slot_mapping, query_start_loc, logits_indices, samplers = [], [], [], [0], [], []
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            start = seq.num_computed_tokens   # this step computes positions [start, start + n)
            input_ids += seq.token_ids[start:start + n]
            positions += range(start, start + n)
            slot_mapping += [seq.block_table[p // bs] * bs + p % bs for p in range(start, start + n)]
            query_start_loc.append(query_start_loc[-1] + n)
            if start + n == len(seq):   # the chunk reaches the last token: its logits pick the next one
                logits_indices.append(query_start_loc[-1] - 1)
                samplers.append(seq)
        max_blocks = max(len(s.block_table) for s in batch.seqs)
        block_tables = [s.block_table + [0] * (max_blocks - len(s.block_table)) for s in batch.seqs]
        t = lambda x, dtype: torch.tensor(x, dtype=dtype, device=self.device)
        context_lens = [s.num_computed_tokens + n for s, n in zip(batch.seqs, batch.num_new_tokens)]
        num_kv_splits = 1 if self.device.type != "cuda" else num_kv_splits_for(
            len(batch.seqs), self.model.config.num_kv_heads, max(context_lens), self.num_sms)
        return Batch(input_ids=t(input_ids, torch.long), positions=t(positions, torch.long),
                     slot_mapping=t(slot_mapping, torch.long), block_tables=t(block_tables, torch.int32),
                     context_lens=t(context_lens, torch.int32), query_start_loc=t(query_start_loc, torch.int32),
                     logits_indices=t(logits_indices, torch.long), max_query_len=max(batch.num_new_tokens),
                     num_kv_splits=num_kv_splits), samplers

    @staticmethod
    def _sample(logits, params, generator, n):
        """logits: (vocab,) float32 on the CPU. Returns n token ids."""
        if params.temperature == 0:
            return [int(logits.argmax())] * n
        logits = logits / params.temperature
        if params.top_k:
            kth = torch.topk(logits, min(params.top_k, logits.numel())).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if params.top_p < 1:
            sorted_logits, order = logits.sort(descending=True)
            probs = sorted_logits.softmax(-1)
            drop = probs.cumsum(-1) - probs >= params.top_p   # tokens whose predecessors already reach top_p
            logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
        return torch.multinomial(logits.softmax(-1), n, replacement=True, generator=generator).tolist()

    def stats(self):
        """The engine's metrics (vLLM's names where vLLM has one), as fractions (0..1) and counts."""
        bm, used = self.block_manager, self.block_manager.num_used_blocks()
        return {"kv_cache_usage_perc": used / bm.num_blocks,   # cached blocks nobody holds count as free
                "token_occupancy_perc": bm.num_stored_tokens() / (used * bm.block_size) if used else 0.0,
                "prefix_cache_queries": bm.prefix_cache_queries, "prefix_cache_hits": bm.prefix_cache_hits,   # tokens
                "prefix_cache_hit_rate": bm.prefix_cache_hits / bm.prefix_cache_queries if bm.prefix_cache_queries else 0.0,
                "num_preemptions": self.scheduler.num_preemptions, "num_swapped_out_blocks": bm.num_swapped_out_blocks,
                "num_swapped_in_blocks": bm.num_swapped_in_blocks, "num_cow_copies": bm.num_cow_copies,
                "num_evictions": bm.num_evictions, "num_prefill_tokens_computed": self.num_prefill_tokens_computed,
                "num_generated_tokens": self.num_generated_tokens}

# ----------------------------------------------------------------------------------------------
# 5. Command line

PROMPTS = ["The capital of France is", "Write a haiku about memory:", "def fibonacci(n):",
           "Paging splits the KV cache into blocks because"]

def main():
    p = argparse.ArgumentParser(description="nanopaged: generate through a paged KV cache and print what it did")
    p.add_argument("--model", default=None, help="None: SmolLM2-135M-Instruct; a local directory; random:<preset>")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block")
    p.add_argument("--num-blocks", type=int, default=None, help="blocks in the pool (default: from a memory budget)")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens to generate per prompt")
    p.add_argument("--n", type=int, default=1, help="samples per prompt (they share the prompt's blocks)")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--beam-width", type=int, default=0, help="beam search of this width instead of sampling")
    p.add_argument("--num-cpu-blocks", type=int, default=0, help="blocks in the CPU swap pool")
    p.add_argument("--preemption-mode", default="auto", choices=["recompute", "swap", "auto"],
                   help="what to do with the newest request when blocks run out")
    p.add_argument("--debug-blocks", action="store_true",
                   help="log every ref-count change, allocation, free, copy, eviction and swap to stderr")
    args = p.parse_args()
    llm = LLM(args.model, device=args.device, block_size=args.block_size, num_blocks=args.num_blocks,
              num_cpu_blocks=args.num_cpu_blocks, preemption_mode=args.preemption_mode, debug_blocks=args.debug_blocks)
    prompts = PROMPTS if llm.tokenizer else [[1 + i] * (5 + 3 * i) for i in range(len(PROMPTS))]
    if args.beam_width:
        for out in llm.beam_search(prompts, BeamSearchParams(args.beam_width, args.max_tokens)):
            for i, b in enumerate(out.sequences):
                print(f"[{out.request_id}.{i}] {b.text or b.token_ids!r}  (score {b.score:.3f})")
    else:
        params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, n=args.n)
        for out in llm.generate(prompts, params):
            for c in out.outputs:
                print(f"[{out.request_id}.{c.index}] {c.text or c.token_ids!r}  ({c.finish_reason})")
    for k, v in llm.stats().items():
        print(f"{k:28} {v:.3f}" if isinstance(v, float) else f"{k:28} {v}")

if __name__ == "__main__":
    main()

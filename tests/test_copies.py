"""The copy engine (async_copies=True): copies between the tiers made in the background while the
steps compute. Random block-manager operations with copies finishing at moments the test does
not choose never let the model read or write a block a copy still reads or writes; the engine
gives a blocking run's tokens over slow links, with a request loading while others run."""
import threading
from collections import Counter, deque

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant, rule

import nanopaged
from conftest import SEQ_IDS, assert_no_block_held, checked, computed
from nanopaged import LLM, BlockManager, CopyEngine, SamplingParams, ScheduledBatch, ScheduledSeq
from test_properties import BLOCK_SIZE, BlockManagerMachine


def recording(engine):
    """engine, keeping every copy it queues to its worker, in order, in engine.queued."""
    engine.queued, submit = [], engine.worker.submit

    def queue(fn, *args):
        if fn == engine.make:   # (copier, copy, ready)
            engine.queued.append(args[1])
        return submit(fn, *args)

    engine.worker.submit = queue
    return engine


def all_made(engine):   # until every copy engine queued is made
    engine.wait(set(engine.started))


class GatedLinks:
    """Links over the token model of K/V (tier -> (block, offset) -> token): a copy moves tokens.
    Each copy waits for the gate, at most a few ms, so copies finish at moments of their own."""

    def __init__(self, kv):
        self.kv = kv
        self.gate = threading.Event()
        self.made = []   # the background copies made, in order (copy-on-write's are not)

    def copy(self, src_pool, src, dst_pool, dst):
        self.gate.wait(0.003)
        for o in range(BLOCK_SIZE):
            if (src, o) in self.kv[src_pool.name]:
                self.kv[dst_pool.name][(dst, o)] = self.kv[src_pool.name][(src, o)]
            else:
                self.kv[dst_pool.name].pop((dst, o), None)
        if src_pool is not dst_pool:
            self.made.append((src_pool, src, dst_pool, dst))


class Holder:
    """What CopyEngine reads of an LLM: device, copier; start() reads block_manager and events."""


class Request:   # what start() reads of a request: its sequences
    def __init__(self, seqs):
        self.seqs = seqs


class CopyEngineMachine(BlockManagerMachine):
    """BlockManagerMachine's operations, the copies made by a real CopyEngine in the background:
    the model's writes (and reads) go through start(), as a step's do."""

    def __init__(self):
        super().__init__()
        self.copier = GatedLinks(self.kv)
        self.holder = Holder()
        self.holder.device, self.holder.copier = torch.device("cpu"), self.copier
        self.holder.block_manager, self.holder.events = self.bm, self.bm.events
        self.engine = recording(CopyEngine(self.holder))

    def pending(self, tier, reads=True):
        """Blocks of tier a queued copy writes (or reads) and has not yet: the truth, not the
        engine's bookkeeping."""
        queued = Counter(self.engine.queued) - Counter(self.copier.made)
        return {b for src, s, dst, d in queued for pool, b in ((src, s if reads else -1), (dst, d))
                if pool.name == tier}

    draining = False   # teardown: each start() waits for every copy

    def make_copies(self):   # queued to the copy engine, as at a step's start
        self.engine.start(self.holder, ScheduledBatch(10**6))
        if self.draining:
            self.every_copy_finishes()

    def write(self, seq, start):
        """A step that runs seq (and a bystander): the engine holds seq back while its blocks are
        in flight; once they have arrived its tokens are written, as the model would."""
        others = [s for s in self.live if s is not seq and s.block_table]
        entries = [ScheduledSeq(Request([s]), s, 1) for s in [seq] + others[:1]]
        batch = self.engine.start(self.holder, ScheduledBatch(10**6, list(entries)))
        for entry in batch.entries:   # what runs reads no block a copy writes, and writes none
            table = entry.seq.block_table   # a copy reads (a write-ahead may read its full blocks)
            flying = self.pending("device", reads=False) & set(table)
            flying |= self.pending("device") & set(table[entry.seq.num_computed_tokens // BLOCK_SIZE:])
            assert not flying, f"seq {entry.seq.seq_id} runs on blocks in flight: {flying}"
        if entries[0] not in batch.entries:   # loading: a later step runs it, once they arrive
            self.engine.wait(self.engine.loading(entries[0].request))
            self.holds_back += 1
        writes = seq.block_table[start // BLOCK_SIZE:]
        assert not self.pending("device", reads=False) & set(seq.block_table), "read in flight"
        assert not self.pending("device") & set(writes), "written in flight"
        super().write(seq, start)   # (its make_copies finds nothing new queued)

    @rule(open_gate=st.booleans())
    def the_link_changes_pace(self, open_gate):
        (self.copier.gate.set if open_gate else self.copier.gate.clear)()

    @rule()
    def every_copy_finishes(self):
        all_made(self.engine)

    @invariant()
    def every_sequence_reads_its_own_tokens(self):
        """Once its copies are made: each sequence reads its own tokens through its table."""
        for tier, seqs in (("device", self.live), ("host", [s for g in self.swapped for s in g])):
            flying = self.pending(tier)
            for seq in (s for s in seqs if not flying & set(s.block_table)):
                for p in range(seq.num_computed_tokens):
                    slot = (seq.block_table[p // BLOCK_SIZE], p % BLOCK_SIZE)
                    got = self.kv[tier].get(slot)
                    assert got == seq.token_ids[p], f"seq {seq.seq_id} position {p} reads {got}"

    @invariant()
    def every_registered_block_holds_its_tokens(self):
        for pool in self.bm.tiers:
            flying = self.pending(pool.name)
            for block in pool.blocks:
                if block.hash is not None and block.block_id not in flying:
                    got = tuple(self.kv[pool.name].get((block.block_id, o))
                                for o in range(BLOCK_SIZE))
                    assert got == block.token_ids, f"{pool.name} block {block.block_id}: {got}"

    holds_back = 0

    def teardown(self):
        self.draining = True   # then every sequence and block is checked, none in flight
        self.every_copy_finishes()
        BlockManagerMachine.every_sequence_reads_its_own_tokens(self)
        BlockManagerMachine.every_registered_block_holds_its_tokens(self)
        super().teardown()
        self.engine.worker.shutdown()


CopyEngineMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30,
                                               deadline=None)
TestCopyEngineProperties = CopyEngineMachine.TestCase


def test_the_machine_reaches_a_request_held_back_while_its_blocks_are_in_flight():
    """The random operations above do reach the hold-back: a sequence whose loaded blocks are in
    flight sits out while a bystander runs (a fixed sequence, the link slow: it cannot pass by
    luck), and its tokens are right once they arrive."""
    m = CopyEngineMachine()

    def drop(seq):
        m.bm.free(seq)
        m.live.remove(seq)

    m.allocate(0, 12, [1])   # a prefix, computed, then freed: cached
    drop(m.live[0])
    m.allocate(1, 4, [1])   # the bystander, holding 2 blocks
    fillers = [[500 + 20 * j + t for t in range(17)] for j in range(3)]
    for filler in fillers:   # push the prefix down to the host
        m.allocate(0, 0, filler)
        drop(m.live[-1])
    assert m.bm.host.hash_to_block_ids, "nothing was written down"
    m.every_copy_finishes()
    loaded, held = m.bm.counts["num_loaded_blocks"], m.holds_back
    m.allocate(0, 12, [1])   # found below: loaded, in flight while the bystander runs
    assert m.bm.counts["num_loaded_blocks"] > loaded and m.holds_back == held + 1
    m.every_sequence_reads_its_own_tokens()
    m.teardown()


class OrderedLinks:
    """Links that record the order of the copies they make; each waits for the gate."""

    def __init__(self):
        self.gate = threading.Event()
        self.made = []

    def copy(self, *copy):
        self.gate.wait()
        self.made.append(copy)


def test_a_request_runs_while_its_full_blocks_are_written_through_and_their_eviction_drops():
    """On an idle link a step writes the full blocks a running request holds through to the host;
    the request runs meanwhile (the copies only read them). Freed and then evicted, the blocks
    are dropped, their copies found below; nothing is written down a second time."""
    bm = nanopaged.BlockManager(4, BLOCK_SIZE, num_cpu_blocks=4, events=nanopaged.EventLog())
    holder = Holder()
    holder.device, holder.copier = torch.device("cpu"), OrderedLinks()   # the link held
    holder.block_manager, holder.events = bm, bm.events
    engine = CopyEngine(holder)
    seq = nanopaged.Sequence(next(SEQ_IDS), list(range(2 * BLOCK_SIZE + 1)))
    bm.allocate(seq)
    seq.num_computed_tokens = len(seq)
    bm.cache_full_blocks(seq)   # blocks 0 and 1 full and registered, 2 holds the last token
    opener = threading.Timer(10, holder.copier.gate.set)   # (if start() waited: not forever)
    opener.start()
    ran = engine.start(holder, ScheduledBatch(10**6, [ScheduledSeq(Request([seq]), seq, 1)]))
    assert [e.seq for e in ran.entries] == [seq]   # not held back: its blocks are only read
    assert bm.copies == deque() and len(engine.started) == 2, "the step waited for the copies"
    full = seq.block_table[:2]
    opener.cancel()
    holder.copier.gate.set()
    all_made(engine)
    assert [(src.name, b, dst.name) for src, b, dst, _ in holder.copier.made] == [
        ("device", full[0], "host"), ("device", full[1], "host")]
    bm.free(seq)
    other = nanopaged.Sequence(next(SEQ_IDS), list(range(100, 100 + 4 * BLOCK_SIZE - 1)))
    bm.allocate(other)   # takes all four device blocks: both cached ones evicted
    drops = [e.block_ids for e in bm.events.take() if e.kind == "drop"]
    assert sorted(b for ids in drops for b in ids) == sorted(full)
    assert bm.counts["num_offloaded_blocks"] == 2 and not bm.copies
    bm.free(other)
    bm.check_invariants()
    engine.worker.shutdown()


def test_a_swap_out_reading_a_block_does_not_hide_its_load_still_in_flight():
    """A load into device block 0 is in flight, then a swap-out of another holder reads block 0
    (registered, its tokens known): B, whose table holds block 0, still waits for the load (the
    read comes last on the block, but the write before it is not made); a bystander runs."""
    bm = nanopaged.BlockManager(8, BLOCK_SIZE, num_cpu_blocks=8, events=nanopaged.EventLog())
    holder = Holder()
    holder.device, holder.copier = torch.device("cpu"), OrderedLinks()   # the link held
    holder.block_manager, holder.events = bm, bm.events
    engine = CopyEngine(holder)
    b, bystander = (nanopaged.Sequence(next(SEQ_IDS), [1] * BLOCK_SIZE) for _ in range(2))
    b.block_table, bystander.block_table = [0], [5]
    bm.device.blocks[0].hash = 123   # registered when its load was queued

    def step(*seqs):
        batch = ScheduledBatch(10**6, [ScheduledSeq(Request([s]), s, 1) for s in seqs])
        return [e.seq for e in engine.start(holder, batch).entries]

    bm.copies.append((bm.host, 3, bm.device, 0))   # b's load
    assert step(bystander, b) == [bystander]
    bm.copies.append((bm.device, 0, bm.host, 4))   # another holder of block 0 swapped out
    assert step(bystander, b) == [bystander], "b ran on a block still arriving"
    holder.copier.gate.set()
    all_made(engine)
    assert step(bystander, b) == [bystander, b]
    engine.worker.shutdown()


GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def chats(llm, turns=3):
    """Four chats at once, turn after turn; between turns other prompts push them down the tiers."""
    convs = [[(7 * i + j) % 250 + 1 for j in range(24)] for i in range(4)]
    for turn in range(turns):
        outs = llm.generate(convs, GREEDY)
        convs = [c + list(o.outputs[0].token_ids) + [3, 4, 5, 6] for c, o in zip(convs, outs)]
        llm.generate([[200 + turn + t] * 30 for t in range(4)], GREEDY)
    return convs


def test_async_copies_give_the_tokens_of_blocking_ones_over_slow_links():
    """A multi-turn workload over links of 0.5 and 0.25 MB/s (a block takes 4 and 8 ms): async
    copies give blocking copies' tokens, invariants hold after every step, no block is held at
    the end, and a request sits steps out (loading) while others run."""
    runs, reports = {}, []
    for async_copies in (False, True):
        llm = checked(LLM("random:tiny", block_size=4, num_blocks=40, num_cpu_blocks=24,
                          num_disk_blocks=48, async_copies=async_copies,
                          tier_gbps={"host": 0.0005, "disk": 0.00025}))
        llm.block_manager.cost = None   # the cost rule off: timing cannot change what is copied
        llm.on_step.append(reports.append)
        runs[async_copies] = chats(llm)
        assert_no_block_held(llm)
        assert llm.stats()["num_loaded_blocks"] > 0
    assert runs[True] == runs[False]
    loading_beside_others = [r.step for r in reports if r.batch.entries
                             and any(e.kind == "loading" for e in r.events)]
    assert loading_beside_others, "no request ever loaded while another ran"


def test_a_slow_link_holds_each_copy_and_the_cost_rule_reads_it():
    """tier_gbps makes a copy take bytes / bandwidth at least; the cost rule reads the link it
    timed at start-up: over a disk link of 1 KB/s (seconds a block) it recomputes instead, and
    nothing is written down to the disk or loaded from it; the host's 10 MB/s is worth it."""
    llm = checked(LLM("random:tiny", block_size=4, num_blocks=12, num_cpu_blocks=4,
                      num_disk_blocks=16, tier_gbps={"host": 0.01, "disk": 1e-6}))
    bytes_per_block = llm.copier.bytes_per_block["device"]   # (every tier float32 here)
    cost = llm.block_manager.cost
    assert cost.seconds_per_block["host"] >= bytes_per_block / 1e7   # 0.01 GB/s: 0.2 ms a block
    assert cost.seconds_per_block["disk"] >= bytes_per_block / 1e3
    for turn in range(3):
        llm.generate([[(7 * turn + t) % 250 + 1 for t in range(30)] for _ in range(2)], GREEDY)
    assert not cost.worth_loading(llm.block_manager.disk) and cost.worth_loading(llm.block_manager.host)
    s = llm.stats()
    assert s["disk_prefix_cache_hits"] == 0 == s["disk_bytes_moved"] and s["host_bytes_moved"] > 0
    assert_no_block_held(llm)


def test_a_swapped_request_swaps_in_ahead_while_others_spend_the_step():
    """Prefetch: a swapped request whose blocks fit starts its swap-in in a step whose token
    budget a running prefill spends (it runs from the next step, not once that prefill is done),
    and the tokens are those of a run that never swapped."""
    prompts = [[(5 * t) % 250 + 1 for t in range(3)], [(3 * t) % 250 + 1 for t in range(40)]]
    want = [o.outputs[0].token_ids for o in
            LLM("random:tiny", block_size=4, num_blocks=64).generate(prompts, GREEDY)]
    llm = checked(LLM("random:tiny", block_size=4, num_blocks=64, num_cpu_blocks=32,
                      preemption_mode="swap", max_num_batched_tokens=8))
    request_ids = llm.add_requests(prompts, GREEDY)
    llm.step()   # the short prompt whole, 5 tokens of the long one
    llm.step()   # a decode, 7 more
    short, long = llm.scheduler.running
    llm.scheduler.preempt(short, ScheduledBatch(budget=8), mode="swap")
    report = llm.step()   # the long prompt's next 8 tokens spend the budget
    assert [(e.request, e.num_new_tokens) for e in report.batch.entries] == [(long, 8)]
    assert [e.seq_ids for e in report.events if e.kind == "swap in"] == [(short.seqs[0].seq_id,)]
    all_made(llm.copy_engine)   # (a busy machine: the worker not yet run)
    report = llm.step()   # the short one decodes again, while the long one still prefills
    assert [e.request for e in report.batch.entries] == [short, long]
    assert long.seqs[0].num_computed_tokens < len(prompts[1])
    while llm.scheduler.has_unfinished():
        llm.step()
    assert [llm.output(r).outputs[0].token_ids for r in request_ids] == want
    assert_no_block_held(llm)


def test_write_through_follows_a_sequence_swapped_out_in_and_out_again():
    """Write-ahead remembers how far it wrote each sequence's blocks, and the
    last block's id (Sequence.written_through), not by the sequence object or its table: a
    sequence swapped out and back in holds other device blocks (its table edited in place), and
    they are written through again."""
    bm = BlockManager(8, 4, num_cpu_blocks=8)
    seq = computed(bm, list(range(13)))   # 3 full blocks, one partly filled
    for _ in range(3):
        bm.write_ahead()
        # each full block it holds now, written down to the host, and no other
        assert [c.src for c in bm.copies] == seq.block_table[:3]
        assert {c.dst_tier.name for c in bm.copies} == {"host"}
        bm.copies.clear()
        bm.swap_out(seq)
        bm.swap_in(seq)
        # the blocks it left cached on the device and every copy below, lost: nothing else to
        # write ahead, and no copy below stands in for its blocks
        for pool in (bm.device, bm.host):
            while pool.cached_block_ids:
                bm._evict(pool, None)
        bm.copies.clear()
        bm.check_invariants()

"""Property-based (hypothesis): random operations on a BlockManager of three tiers never break an
invariant, never lose or mix up a token's K/V in any tier, and every block comes back at the end;
random whole requests through the engine, in pools down to the smallest it accepts, all finish
with a roomy pool's tokens.

The K/V are modelled by the token each slot holds, in each tier: the test writes a sequence's
tokens into its slots as the model would, makes every block copy the block manager queues
(copy-on-write, swap out and in, write-downs on eviction, loads on a hit below the device), and
checks after every operation that each sequence reads its own tokens back through its block
table, and that every block registered in the prefix cache, in any tier, holds the tokens it is
registered with: whatever was shared, copied, evicted, written down, loaded or swapped."""
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from conftest import SEQ_IDS, assert_no_block_held, checked
from nanopaged import (LLM, BeamSearchParams, BlockManager, SamplingParams, Sequence,
                       max_blocks_needed)

BLOCK_SIZE = 4
PREFIXES = [list(range(100, 112)), list(range(200, 212)), [100, 101, 102, 103] + list(range(300, 308))]


class Rule:
    """A stand-in for the engine's cost rule: which tiers below the device are worth loading from."""

    def __init__(self):
        self.worth = {"host": True, "disk": True}

    def worth_loading(self, tier):
        return self.worth[tier.name]

    def load_figures(self, tier):   # what a load event says of the rule
        return f"{tier.name} worth loading"


class BlockManagerMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.rule = Rule()
        self.bm = BlockManager(num_blocks=12, block_size=BLOCK_SIZE, num_cpu_blocks=6, num_disk_blocks=6,
                               cost=self.rule)
        self.kv = {"device": {}, "host": {}, "disk": {}}   # tier -> (block_id, offset) -> the token its K/V are of
        self.live, self.swapped = [], []   # sequences on the device; requests (lists) in host memory

    def make_copies(self):
        """What the engine does before the model runs: every queued copy, in order."""
        while self.bm.copies:
            src_pool, src, dst_pool, dst = self.bm.copies.popleft()
            src_tier, dst_tier = src_pool.name, dst_pool.name
            for o in range(BLOCK_SIZE):
                if (src, o) in self.kv[src_tier]:
                    self.kv[dst_tier][(dst, o)] = self.kv[src_tier][(src, o)]
                else:
                    self.kv[dst_tier].pop((dst, o), None)

    def write(self, seq, start):
        """What the model does: K/V of positions start.. go into their slots; then they are computed."""
        self.make_copies()
        for p in range(start, len(seq)):
            self.kv["device"][(seq.block_table[p // BLOCK_SIZE], p % BLOCK_SIZE)] = seq.token_ids[p]
        seq.num_computed_tokens = len(seq)
        self.bm.cache_full_blocks(seq)

    @rule(prefix=st.integers(0, 2), k=st.integers(0, 12), own=st.lists(st.integers(0, 40), min_size=1, max_size=9))
    def allocate(self, prefix, k, own):
        seq = Sequence(next(SEQ_IDS), PREFIXES[prefix][:k] + own)
        if self.bm.can_allocate(seq):
            self.bm.allocate(seq)
            self.write(seq, seq.num_computed_tokens)   # prefix hits, loaded or not, are not written again
            self.live.append(seq)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), token=st.integers(0, 40))
    def append(self, data, token):
        seq = data.draw(st.sampled_from(self.live))
        seq.append_token(token)
        if not self.bm.can_append(seq):
            seq.token_ids.pop()
            return
        self.bm.append_slot(seq)
        self.write(seq, len(seq) - 1)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(self.live))
        child = Sequence(next(SEQ_IDS), parent.token_ids, request_id=parent.request_id)
        self.bm.fork(parent, child)
        self.live.append(child)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        seq = data.draw(st.sampled_from(self.live))
        self.bm.free(seq)
        self.live.remove(seq)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def swap_out(self, data):
        seq = data.draw(st.sampled_from(self.live))
        group = [s for s in self.live if s.request_id == seq.request_id]
        if self.bm.can_swap_out(*group):
            self.bm.swap_out(*group)
            self.make_copies()
            self.live = [s for s in self.live if s not in group]
            self.swapped.append(group)

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def swap_in(self, data):
        group = data.draw(st.sampled_from(self.swapped))
        if self.bm.can_swap_in(*group):
            self.bm.swap_in(*group)
            self.make_copies()
            self.swapped.remove(group)
            self.live += group

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def free_swapped(self, data):
        group = data.draw(st.sampled_from(self.swapped))
        for seq in group:
            self.bm.free(seq)
        self.swapped.remove(group)

    @rule(tier=st.sampled_from(["host", "disk"]), worth=st.booleans())
    def cost_rule_changes(self, tier, worth):
        """The measured costs move: a tier may stop (or start) being worth loading from."""
        self.rule.worth[tier] = worth

    @invariant()
    def rules_hold(self):
        self.bm.check_invariants()

    @invariant()
    def every_sequence_reads_its_own_tokens(self):
        self.make_copies()
        for tier, seqs in (("device", self.live), ("host", [s for g in self.swapped for s in g])):
            for seq in seqs:
                for p in range(seq.num_computed_tokens):
                    slot = (seq.block_table[p // BLOCK_SIZE], p % BLOCK_SIZE)
                    assert self.kv[tier].get(slot) == seq.token_ids[p], f"seq {seq.seq_id} position {p} reads {self.kv[tier].get(slot)}"

    @invariant()
    def every_registered_block_holds_its_tokens(self):
        self.make_copies()
        for pool in self.bm.tiers:
            for block in pool.blocks:
                if block.hash is not None:
                    got = tuple(self.kv[pool.name].get((block.block_id, o)) for o in range(BLOCK_SIZE))
                    assert got == block.token_ids, f"{pool.name} block {block.block_id} holds {got}, registered as {block.token_ids}"

    def teardown(self):
        for seq in self.live + [s for g in self.swapped for s in g]:
            self.bm.free(seq)
            self.bm.check_invariants()
        assert self.bm.num_free_blocks == self.bm.num_blocks, "a device block leaked"
        for pool in self.bm.tiers:
            assert pool.num_free_blocks == len(pool.blocks) and not pool.seqs, f"a {pool.name} block leaked"


BlockManagerMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestBlockManagerProperties = BlockManagerMachine.TestCase
TestBlockManagerProperties.__doc__ = ("Random allocate/append/fork/free/swap/evict/write-down/load sequences over three "
                                      "tiers keep every invariant and every token, in every tier.")


def test_the_random_operations_reach_every_tier():
    """The random operations above do reach what they are meant to test: write-downs to host and to disk, loads from
    both, evictions off the bottom, swaps (a fixed sequence of the same operations, so it cannot pass by luck)."""
    m = BlockManagerMachine()
    fillers = [[500 + 20 * j + t for t in range(17)] for j in range(5)]   # 4 full blocks each, all distinct
    # fill; each filler computed, then found once (a block found more often than a full tier's
    # next out pushes it down), pushing the prefixes down the tiers; come back up
    found = [(0, 0, f + x) for f in fillers for x in ([], [2])]
    for prefix, k, own in [(0, 12, [1]), (1, 12, [1]), (2, 12, [1])] + found + \
            [(0, 0, fillers[1] + [3]), (2, 12, [2])]:
        m.allocate(prefix, k, own)
        for seq in list(m.live):
            m.bm.free(seq)
            m.live.remove(seq)
        m.every_registered_block_holds_its_tokens()
        m.rules_hold()
    bm = m.bm
    name = lambda tier: tier.name if tier else ""
    kinds = {(c.kind, name(c.tier), name(c.to_tier)) for c in bm.events.records}
    assert {("write down", "device", "host"), ("write down", "host", "disk"), ("evict", "disk", "")} <= kinds
    assert ("load", "host", "device") in kinds and ("load", "disk", "device") in kinds
    assert bm.counts["num_loaded_blocks"] > 0
    m.teardown()


# ----------------------------------------------------------------------------------------------
# Whole requests through the engine: every request that passes validation finishes



def prompt_ids(seed, n):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


requests = st.lists(st.tuples(st.integers(0, 999), st.integers(1, 20), st.integers(1, 4),
                              st.integers(1, 10)), min_size=1, max_size=4)


@settings(max_examples=40, deadline=None)
@given(requests=requests, beams=st.booleans(), block_size=st.sampled_from([1, 2, 4, 8, 16]),
       prefix_caching=st.booleans(), mode=st.sampled_from(["recompute", "swap", "auto"]),
       extra_blocks=st.sampled_from([0, 0, 1, 3]), cpu_share=st.sampled_from([0.3, 1.0, 2.0]),
       max_num_batched_tokens=st.sampled_from([2048, 7, 2]), max_num_seqs=st.sampled_from([256, 5]),
       policy=st.sampled_from(["lru", "fifo", "lfu", "leaf"]))
def test_every_request_that_passes_validation_finishes(requests, beams, block_size, prefix_caching,
                                                       mode, extra_blocks, cpu_share,
                                                       max_num_batched_tokens, max_num_seqs, policy):
    """Greedy n>1 and beam requests, prefix caching on and off, recompute and swap, every eviction
    policy (it changes what is cached, never what is generated), in pools from
    the smallest validate_request accepts upward: every request finishes with a roomy pool's tokens, no
    step runs more than max_num_seqs sequences, and no block is held at the end."""
    prompts = [prompt_ids(seed, length) for seed, length, _, _ in requests]
    if beams:
        params = [BeamSearchParams(beam_width=n, max_tokens=m) for _, _, n, m in requests]
    else:
        params = [SamplingParams(temperature=0, n=n, max_tokens=m) for _, _, n, m in requests]

    def run(llm):
        if beams:
            return [[s.token_ids for s in o.sequences] for o in llm.beam_search(prompts, params)]
        return [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params)]

    roomy = LLM("random:tiny", block_size=block_size, num_blocks=1000)
    want = run(roomy)
    # the smallest pool validate_request accepts for these requests (it refuses one block less)
    smallest = max(max_blocks_needed(roomy, len(p), q) for p, q in zip(prompts, params))
    num_blocks = smallest + extra_blocks
    llm = checked(LLM("random:tiny", block_size=block_size, num_blocks=num_blocks,
                      enable_prefix_caching=prefix_caching, preemption_mode=mode,
                      num_cpu_blocks=0 if mode == "recompute" else max(1, int(cpu_share * num_blocks)),
                      max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                      eviction_policy=policy))
    running = []

    def watch(report):
        running.append(len(llm.block_manager.device.seqs))
        assert report.step < 3000, "no progress: a livelock"

    llm.on_step.append(watch)
    assert run(llm) == want
    assert max(running) <= max_num_seqs
    assert_no_block_held(llm)

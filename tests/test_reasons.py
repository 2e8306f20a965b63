"""Why a prompt missed the cache: every prompt token of every request is found in a tier or computed
for one reason, exactly the tokens a workload was built to miss for it; the sums hold for every
request and for the engine, roomy and under pressure; counting changes no token."""
import io
import re

import pytest
import torch
from rich.console import Console

import nanopaged
from conftest import assert_no_block_held, checked
from nanopaged import LLM, SamplingParams, View

BS = 4
GREEDY = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)


def ids(seed, n):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def engine(**knobs):
    return checked(LLM("random:tiny", block_size=BS, **knobs))


def run(llm, prompt, params=GREEDY):
    """One request, alone: its RequestOutput, and the words of its 'prompt' events."""
    words = []
    llm.on_step.append(lambda report: words.extend(e.words() for e in report.events
                                                   if e.kind == "prompt"))
    out = llm.generate([prompt], params)[0]
    llm.on_step.pop()
    return out, words


def record(out):
    return out.num_cached_tokens, out.cached_by_tier, out.computed_by_reason


def test_a_new_prompt_misses_at_block_0_and_every_block_after_it():
    """14 tokens, never seen: block 0 is first seen, blocks 1-2 miss after it (the chain is
    broken), block 3 is partial (2 tokens): nothing is cached."""
    llm = engine(num_blocks=16)
    out, words = run(llm, ids(0, 14))
    assert record(out) == (0, {}, {"first seen": 4, "after a miss": 8, "partial block": 2})
    assert len(words) == 1 and words[0].endswith("'s prompt: first seen 4 (block 0), after a miss "
                                                 "8 (blocks 1, 2), partial block 2 (block 3)")
    assert_no_block_held(llm)


def test_a_prompt_that_differs_in_block_2_finds_blocks_0_and_1():
    """The same first 8 tokens, then others: blocks 0-1 are found on the device, block 2 is first
    seen (its tokens differ), block 3 partial."""
    llm = engine(num_blocks=16)
    first = ids(0, 14)
    run(llm, first)
    out, words = run(llm, first[:8] + ids(1, 6))
    assert record(out) == (8, {"device": 8}, {"first seen": 4, "partial block": 2})
    assert words[0].endswith("device 8 (blocks 0, 1), first seen 4 (block 2), partial block 2 "
                             "(block 3)")
    assert_no_block_held(llm)


def test_the_block_of_the_last_token_is_computed_even_when_cached():
    """A 12-token prompt sent twice: the second finds blocks 0-1, and computes block 2 whole: it
    holds the last prompt token (computed for its logits), and a hit is whole blocks."""
    llm = engine(num_blocks=16)
    prompt = ids(0, 12)
    out, _ = run(llm, prompt)
    assert record(out) == (0, {}, {"first seen": 4, "after a miss": 4, "last token": 4})
    out, _ = run(llm, prompt)
    assert record(out) == (8, {"device": 8}, {"last token": 4})
    assert_no_block_held(llm)


def test_a_shared_prefix_shorter_than_a_block_never_hits():
    """Two 3-token prompts alike: both are one partial block, never cached."""
    llm = engine(num_blocks=16)
    for _ in range(2):
        out, _ = run(llm, ids(0, 3))
        assert record(out) == (0, {}, {"partial block": 3})
    assert_no_block_held(llm)


def test_with_prefix_caching_off_every_token_is_caching_off():
    """enable_prefix_caching=False: nothing is looked up, every prompt token says so."""
    llm = engine(num_blocks=16, enable_prefix_caching=False)
    for _ in range(2):
        out, words = run(llm, ids(0, 14))
        assert record(out) == (0, {}, {"caching off": 14})
    assert words[0].endswith("'s prompt: caching off 14 (blocks 0-3)")
    assert llm.stats()["computed_by_reason"] == {"caching off": 28}
    assert_no_block_held(llm)


def test_an_evicted_prefix_is_missed_for_eviction_naming_tier_step_and_seq():
    """A's three full blocks are cached, then B and C evict them (tail first): A again misses at
    block 0 as evicted, and the words say from which tier, at which step, for which sequence, as
    the evict events of that step show."""
    llm = engine(num_blocks=8)
    a = ids(0, 12)
    run(llm, a)
    events = []
    llm.on_step.append(lambda report: events.extend(report.events))
    run(llm, ids(1, 20))
    run(llm, ids(2, 20))
    llm.on_step.pop()
    bm = llm.block_manager
    key = (bm.compute_hash(None, a[:4]), tuple(a[:4]))
    where = re.fullmatch(r"from the device tier at step (\d+) for seq (\d+)", bm.evicted[key])
    step, whom = int(where[1]), int(where[2])
    out, words = run(llm, a)
    assert record(out) == (0, {}, {"evicted": 4, "after a miss": 4, "last token": 4})
    assert words[0].endswith(f"; block 0 was evicted {where[0]}")
    # that step evicted device blocks for the sequence it admitted
    evicted = [e for e in events if e.step == step and e.kind == "evict"]
    admitted = [e.seq_ids[0] for e in events if e.step == step and e.kind == "prompt"]
    assert evicted and admitted == [whom]
    assert_no_block_held(llm)


class NotWorthIt:
    """A cost rule under which no tier below the device is worth loading from."""

    def worth_loading(self, tier):
        return False


def test_a_prefix_in_a_tier_not_worth_loading_is_not_loaded():
    """A's blocks are written down to the host when B evicts them; once the host is not worth
    loading from, A again finds block 0 there but does not load it: not loaded."""
    llm = engine(num_blocks=8, num_cpu_blocks=16, async_copies=False)
    a = ids(0, 12)
    run(llm, a)
    run(llm, ids(1, 20))
    run(llm, ids(2, 20))
    bm = llm.block_manager
    assert bm._lookup([bm.host], bm.compute_hash(None, a[:4]), tuple(a[:4]), None)
    bm.cost = NotWorthIt()
    out, _ = run(llm, a)
    assert record(out) == (0, {}, {"not loaded": 4, "after a miss": 4, "last token": 4})
    assert_no_block_held(llm)


def test_a_prefix_loaded_from_the_host_counts_as_a_host_hit():
    """The same, with the host worth loading from: A finds blocks 0-1 there, loaded up."""
    llm = engine(num_blocks=8, num_cpu_blocks=16, async_copies=False)
    a = ids(0, 12)
    run(llm, a)
    run(llm, ids(1, 20))
    run(llm, ids(2, 20))
    out, _ = run(llm, a)
    assert record(out) == (8, {"host": 8}, {"last token": 4})
    assert llm.stats()["cached_by_tier"]["host"] == 8
    assert_no_block_held(llm)


def test_a_request_preempted_by_recompute_keeps_what_it_finds_and_the_rest_is_recomputed():
    """Two long requests in a small pool: the second is preempted by recompute. Admitted again,
    the prompt tokens it finds keep their first record, every prompt token after them is
    recomputed, exactly."""
    llm = engine(num_blocks=10, preemption_mode="recompute")
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    first_id, second_id = llm.add_requests([ids(0, 14), ids(1, 14)], params)
    request = llm.requests[second_id]
    leader = request.seqs[0]
    records = []   # at each admission: (its record, the tokens its look-up found)
    while llm.scheduler.has_unfinished():
        report = llm.step()
        if any(e.kind == "prompt" and e.seq_ids == (leader.seq_id,) for e in report.events):
            records.append((request.sources, leader.num_cached_tokens))
    assert llm.stats()["num_preemptions"] > 0 and len(records) == 2
    (first, _), (again, num_found) = records
    num_found = min(14, num_found)
    assert 14 - num_found > 0
    assert again == first[:num_found] + ("recomputed",) * (14 - num_found)
    assert record(llm.output(second_id))[2]["recomputed"] == 14 - num_found
    llm.output(first_id)
    assert_no_block_held(llm)


def test_a_request_preempted_in_the_middle_of_its_prefill_gets_the_caches_reasons():
    """Chunked prefill (4 tokens a step) preempted by recompute after 12 of its 36 prompt tokens:
    admitted again it finds blocks 0-2 (their first record kept), and what it computes now was
    never computed: block 3 first seen, 4-7 after a miss, 8 the last token's; none recomputed."""
    llm = engine(num_blocks=12, max_num_batched_tokens=4, preemption_mode="recompute",
                 watermark_blocks=0)
    first_id, second_id = llm.add_requests(
        [ids(0, 8), ids(1, 36)], [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                                  SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)])
    request = llm.requests[second_id]
    leader = request.seqs[0]
    computed, words = [], []
    while llm.scheduler.has_unfinished():
        before = leader.num_computed_tokens
        report = llm.step()
        for e in report.events:
            if e.kind == "preempt" and e.seq_ids == (leader.seq_id,):
                computed.append(before)
            if e.kind == "prompt" and e.seq_ids == (leader.seq_id,):
                words.append(e.words())
    assert computed == [12] and len(words) == 2
    assert words[1].endswith("'s prompt: first seen 8 (blocks 0, 3), after a miss 24 (blocks 1, 2, "
                             "4-7), last token 4 (block 8)")
    assert record(llm.output(second_id)) == (0, {}, {"first seen": 8, "after a miss": 24,
                                                     "last token": 4})
    llm.output(first_id)
    assert_no_block_held(llm)


def test_beam_search_outputs_carry_their_prompts_record():
    """Beam search requests are counted as the others: each output's record adds up to its
    prompt, and the engine's sums are the outputs'."""
    llm = engine(num_blocks=32)
    prompt = ids(0, 14)
    outs = llm.beam_search([prompt, prompt[:8] + ids(1, 6)],
                           nanopaged.BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True))
    assert record(outs[0]) == (0, {}, {"first seen": 4, "after a miss": 8, "partial block": 2})
    sums(outs, llm.stats())
    assert_no_block_held(llm)


PRESSURE = {
    "roomy": dict(num_blocks=256),
    "swap": dict(num_blocks=24, num_cpu_blocks=64, preemption_mode="swap"),
    "recompute": dict(num_blocks=24, preemption_mode="recompute"),
    "tiers": dict(num_blocks=24, num_cpu_blocks=8, num_disk_blocks=64, async_copies=False),
    "async copies": dict(num_blocks=24, num_cpu_blocks=8, num_disk_blocks=64,
                         tier_gbps={"host": 0.01, "disk": 0.005}),
}


def workload():
    """Prompts sharing prefixes (a 12-token system prompt, some of them twice), one n=2."""
    system = ids(0, 12)
    prompts = [system + ids(i, 5 + i) for i in range(1, 7)] + [system + ids(1, 6), ids(9, 9)]
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)] * len(prompts)
    params[2] = SamplingParams(temperature=0.8, n=2, max_tokens=10, ignore_eos=True, seed=3)
    return prompts, params


def sums(outs, stats):
    """Each request's record adds up to its prompt; the engine's to the requests'."""
    tiers, reasons = {}, {}
    for out in outs:
        num_cached, by_tier, by_reason = record(out)
        assert num_cached == sum(by_tier.values())
        assert num_cached + sum(by_reason.values()) == len(out.prompt_token_ids)
        for name, n in by_tier.items():
            tiers[name] = tiers.get(name, 0) + n
        for name, n in by_reason.items():
            reasons[name] = reasons.get(name, 0) + n
    assert stats["cached_by_tier"] == tiers and stats["computed_by_reason"] == reasons
    assert stats["num_cached_tokens"] == sum(tiers.values())
    return reasons


def test_the_sums_hold_roomy_and_under_pressure_and_no_token_changes():
    """Swap, recompute, tiers below and copies in the background: every request's hits plus its
    computed tokens by reason are its prompt, the engine's sums are the requests', and every
    configuration gives the roomy one's tokens (each configuration's pressure asserted)."""
    prompts, params = workload()
    tokens = {}
    for name, knobs in PRESSURE.items():
        llm = engine(**knobs)
        outs = llm.generate(prompts, params) + llm.generate(prompts[:3], params[:3])
        stats = llm.stats()
        reasons = sums(outs, stats)
        tokens[name] = [[c.token_ids for c in o.outputs] for o in outs]
        assert reasons["first seen"] > 0 and stats["num_cached_tokens"] > 0, name
        if name in ("swap", "recompute"):
            assert stats["num_preemptions"] > 0, name
        if name == "recompute":
            assert reasons.get("recomputed", 0) > 0
        if name in ("tiers", "async copies"):
            assert stats["num_loaded_blocks"] > 0, name
        assert_no_block_held(llm)
    assert all(t == tokens["roomy"] for t in tokens.values())


def test_an_undone_step_puts_the_record_and_the_counts_back():
    """A step that raises after admitting a request leaves no record and no count of it; run again,
    the request gets the record a fresh engine gives it."""
    llm = engine(num_blocks=16)
    forward = llm.model.forward
    calls = []

    def broken(*args):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("broken once")
        return forward(*args)

    llm.model.forward = broken
    request_id, = llm.add_requests([ids(0, 14)], GREEDY)
    with pytest.raises(RuntimeError):
        llm.step()
    assert llm.requests[request_id].sources == ()
    assert llm.stats()["computed_by_reason"] == {}
    while llm.scheduler.has_unfinished():
        llm.step()
    out = llm.output(request_id)
    assert record(out) == (0, {}, {"first seen": 4, "after a miss": 8, "partial block": 2})
    assert llm.stats()["computed_by_reason"] == out.computed_by_reason
    assert_no_block_held(llm)


def test_the_view_shows_a_running_requests_record():
    """The trace's sequence rows carry each request's prompt record under its first row."""
    llm = engine(num_blocks=16)
    console = Console(file=io.StringIO(), width=80, color_system=None)
    with View(llm, live=False, console=console):
        llm.generate([ids(0, 14)], GREEDY)
    text = console.file.getvalue()
    assert re.search(r"\n {11}prompt: first seen 4 \(block 0\), after a miss 8 \(blocks 1, 2\),",
                     text)
    assert_no_block_held(llm)


def test_the_prefix_demo_says_why_seq_3_finds_one_block(capsys):
    """In the prefix demo's trace, seq 3's prompt (one word changed in the system prompt) is told
    as found at block 0, first seen at block 1 (the changed word), every block after it missed
    after it."""
    # sequences numbered from 0: each engine counts its own
    llm = LLM("random:tiny", block_size=BS, **nanopaged.demo_pool("prefix", BS))
    nanopaged.run_demo(llm, "prefix", trace=True)
    trace = " ".join(capsys.readouterr().out.split())
    assert ("seq 3's prompt: device 4 (block 0), first seen 4 (block 1), after a miss 16 "
            "(blocks 2-5)") in trace
    # in its small pool seq 3 is preempted; what it had computed and does not find when it comes
    # back is recomputed; the friendly prompt again (seq 4) misses block 4, evicted for another
    # sequence
    assert ("seq 3's prompt: device 4 (block 0), first seen 4 (block 1), after a miss 8 "
            "(blocks 2, 3), recomputed 12") in trace
    evicted = re.search(r"seq 4's prompt: device 16 \(blocks 0-3\), evicted 4 \(block 4\), "
                        r"after a miss 4 \(block 5\), last token 4 \(block 6\); block 4 was "
                        r"evicted from the device tier at step (\d+) for seq (\d+)", trace)
    assert evicted and int(evicted[1]) < 25 and evicted[2] in "012"

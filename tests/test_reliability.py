"""Nothing is ever lost: pressure runs in every preemption mode, swapping keeps K/V intact, beam search
on shared blocks equals a simple beam search, and every step's events are reported as the references balance."""

import pytest
import torch

from conftest import assert_no_block_held, checked, running_seqs
from nanopaged import LLM, BeamSearchParams, SamplingParams, ScheduledBatch


def ids(seed, n, vocab=256):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# ----------------------------------------------------------------------------------------------
# Pressure: 120 requests, a pool at about a sixth of their peak need


def pressure_workload():
    """Mixed lengths, four shared prefixes, every fifth request n=3 (greedy, so its samples agree)."""
    g = torch.Generator().manual_seed(0)
    prefixes = [ids(100 + i, 12 + 8 * i) for i in range(4)]
    prompts, params = [], []
    for i in range(120):
        own = ids(1000 + i, int(torch.randint(1, 30, (1,), generator=g)))
        prompts.append((prefixes[i % 4] if i % 3 else []) + own)
        params.append(SamplingParams(temperature=0, max_tokens=int(torch.randint(2, 24, (1,), generator=g)),
                                     n=3 if i % 5 == 0 else 1))
    return prompts, params


@pytest.fixture(scope="module")
def unconstrained():
    """The workload with room for everything: its outputs and its peak block need."""
    prompts, params = pressure_workload()
    llm = LLM("random:tiny", block_size=4, num_blocks=4000)
    peaks = [0]
    llm.on_step.append(lambda report: peaks.append(llm.block_manager.num_used_blocks()))
    outs = llm.generate(prompts, params)
    assert llm.stats()["num_preemptions"] == 0
    return [[c.token_ids for c in o.outputs] for o in outs], max(peaks)


@pytest.fixture(scope="module")
def pressure_runs(unconstrained):
    want, peak = unconstrained
    prompts, params = pressure_workload()
    runs = {}
    for mode in ("recompute", "swap", "auto"):
        llm = checked(LLM("random:tiny", block_size=4, num_blocks=peak // 6, preemption_mode=mode,
                          num_cpu_blocks=0 if mode == "recompute" else peak // 6))
        outs = llm.generate(prompts, params)
        runs[mode] = ([[c.token_ids for c in o.outputs] for o in outs], llm)
    return runs


@pytest.mark.parametrize("mode", ["recompute", "swap", "auto"])
def test_pressure_run_finishes_everything_with_unconstrained_outputs(unconstrained, pressure_runs, mode):
    """At a sixth of the peak need, every request finishes with the unconstrained run's greedy tokens, and no block is held."""
    want, peak = unconstrained
    got, llm = pressure_runs[mode]
    stats = llm.stats()
    assert peak // 6 < peak and stats["num_preemptions"] > 0
    if mode != "recompute":
        assert stats["num_swapped_out_blocks"] > 0 and stats["num_swapped_in_blocks"] == stats["num_swapped_out_blocks"]
    else:
        assert stats["num_swapped_out_blocks"] == 0
    assert len(got) == 120 and got == want
    assert_no_block_held(llm)
    assert llm.block_manager.host.num_free_blocks == len(llm.block_manager.host.blocks) and not llm.block_manager.host.seqs


def test_swap_and_recompute_give_identical_outputs(pressure_runs):
    """The same workload preempted by swapping and by recomputing gives the same tokens."""
    assert pressure_runs["swap"][0] == pressure_runs["recompute"][0]


# ----------------------------------------------------------------------------------------------
# Swapping keeps K/V intact


def kv_of(llm, seq, cache=None):
    """seq's K/V in logical order, gathered through its block table: (2, layers, tokens, kv_heads, head_dim)."""
    cache = llm.kv_cache if cache is None else cache
    n = seq.num_computed_tokens
    return cache[:, :, seq.block_table].flatten(2, 3)[:, :, :n].clone()


@pytest.mark.parametrize("async_copies", [False, True])
def test_swap_out_and_in_keeps_kv_and_continues_exactly(async_copies):
    """A request swapped out and back in mid-generation holds the same K/V bit for bit and ends as one that never left."""
    prompt, params = ids(7, 21), SamplingParams(temperature=0, max_tokens=12, n=2)
    want = [c.token_ids for c in LLM("random:tiny", block_size=4, num_blocks=64).generate([prompt], params)[0].outputs]
    llm = checked(LLM("random:tiny", block_size=4, num_blocks=64, num_cpu_blocks=32, preemption_mode="swap",
                      async_copies=async_copies))
    [request_id] = llm.add_requests([prompt], params)
    for _ in range(5):
        llm.step()
    [request] = llm.scheduler.running
    seqs = list(request.seqs)
    assert len(seqs) == 2 and seqs[0].block_table[:5] == seqs[1].block_table[:5]   # samples share the prompt
    before = [kv_of(llm, s) for s in seqs]
    batch = ScheduledBatch(budget=2048)
    assert llm.scheduler.preempt(request, batch, mode="swap") == "swap"
    copies = list(llm.block_manager.copies)
    if async_copies:   # made in the background: until they are
        llm.copy_engine.start(llm, batch)
        llm.copy_engine.wait(set(llm.copy_engine.started))
    else:
        llm._make_copies(batch)
    distinct = len({b for s in seqs for b in s.block_table})
    assert len(copies) == distinct and {(c[0].name, c[2].name) for c in copies} == {("device", "host")}   # each distinct block moved once: sharing survives
    assert seqs[0].block_table[:5] == seqs[1].block_table[:5]
    for s, kv in zip(seqs, before):
        assert torch.equal(kv_of(llm, s, llm.kv_caches["host"]), kv)
    llm.block_manager.check_invariants()
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks   # all in host memory now
    llm.step()   # swaps the request back in and continues
    assert request.status.value in ("running", "finished")
    while llm.scheduler.has_unfinished():
        llm.step()
    out = llm.output(request_id)
    assert [c.token_ids for c in out.outputs] == want
    assert_no_block_held(llm)


def test_swapped_in_kv_equals_swapped_out_kv():
    """After the round trip the device blocks hold exactly the K/V that left (blocking copies)."""
    llm = checked(LLM("random:tiny", block_size=4, num_blocks=64, num_cpu_blocks=32, preemption_mode="swap",
                      async_copies=False))
    [request_id] = llm.add_requests([ids(8, 18)], SamplingParams(temperature=0, max_tokens=20))
    for _ in range(4):
        llm.step()
    [request] = llm.scheduler.running
    [seq] = request.seqs
    before = kv_of(llm, seq)
    batch = ScheduledBatch(budget=2048)
    llm.scheduler.preempt(request, batch, mode="swap")
    llm._make_copies(batch)
    llm.kv_cache.normal_()   # whatever the device pool held is gone
    batch = llm.scheduler.schedule()
    assert [c for c in llm.block_manager.copies if c[0].name == "host"] and seq in [e.seq for e in batch.entries]
    llm._make_copies(batch)
    assert torch.equal(kv_of(llm, seq), before)


# ----------------------------------------------------------------------------------------------
# Beam search: the paged engine against a plain beam search with full recompute


def simple_beam_search(hf, prompt, width, max_tokens, eos_ids, length_penalty=1.0):
    """Beam search written plainly: no cache, every step recomputes every beam from scratch."""
    beams, completed = [([], 0.0)], []
    for _ in range(max_tokens):
        candidates = []
        for tokens, cum in beams:
            with torch.no_grad():
                logprobs = hf(torch.tensor([prompt + tokens])).logits[0, -1].float().log_softmax(-1)
            top = logprobs.topk(2 * width)
            candidates += [(cum + lp, tokens, t) for lp, t in zip(top.values.tolist(), top.indices.tolist())]
        completed += [(tokens + [t], c) for c, tokens, t in candidates if t in eos_ids]
        beams = [(tokens + [t], c) for c, tokens, t in
                 sorted((c for c in candidates if c[2] not in eos_ids), key=lambda c: c[0], reverse=True)[:width]]
    completed += beams

    def score(c):   # the length counts the prompt, not an ending eos
        tokens, cum = c
        return cum / (len(prompt) + len(tokens) - (tokens[-1] in eos_ids)) ** length_penalty

    return max(completed, key=score)[0]


@pytest.mark.parametrize("width", [2, 4])
def test_beam_search_matches_simple_beam_search_tiny(width):
    """On random:tiny the best beam equals the plain beam search's, for several prompts in one call."""
    from model import load_hf
    hf, _ = load_hf("random:tiny")
    prompts = [ids(20, 5), ids(21, 14), ids(22, 9)]
    llm = checked(LLM("random:tiny", block_size=4, num_blocks=96))
    outs = llm.beam_search(prompts, BeamSearchParams(beam_width=width, max_tokens=10))
    for prompt, out in zip(prompts, outs):
        assert out.sequences[0].token_ids == simple_beam_search(hf, prompt, width, 10, set())
        assert len(out.sequences) == width
        assert [s.score for s in out.sequences] == sorted([s.score for s in out.sequences], reverse=True)
    assert_no_block_held(llm)


@pytest.mark.parametrize("width", [2, 4])
def test_beam_search_matches_simple_beam_search_default_model(default_hf, width):
    """On the default model (eos ends beams) the best beam equals the plain beam search's."""
    hf, tokenizer = default_hf
    prompts = [tokenizer.encode(p, add_special_tokens=False) for p in ["The capital of France is", "def add(a, b):"]]
    llm = checked(LLM(num_blocks=128))
    outs = llm.beam_search(prompts, BeamSearchParams(beam_width=width, max_tokens=8))
    for prompt, out in zip(prompts, outs):
        assert out.sequences[0].token_ids == simple_beam_search(hf, prompt, width, 8, {2})
    assert_no_block_held(llm)


def test_beam_search_width4_shares_blocks():
    """Width-4 beams hold at most 60% of the blocks they would hold unshared; copies only of partial blocks."""
    llm = checked(LLM("random:tiny", block_size=16, num_blocks=128))
    seen = []

    def watch(report):
        beams = running_seqs(llm)
        seen.append((len({b for s in beams for b in s.block_table}), sum(len(s.block_table) for s in beams)))

    llm.on_step.append(watch)
    llm.beam_search([ids(30, 100)], BeamSearchParams(beam_width=4, max_tokens=24))
    shared = max(s for s, _ in seen)
    unshared = max(u for _, u in seen)
    assert shared <= 0.6 * unshared, f"{shared} blocks with sharing vs {unshared} without"
    assert llm.stats()["num_cow_copies"] > 0
    assert_no_block_held(llm)


def test_beam_search_under_preemption_matches_unconstrained():
    """Beam search in a pool too small for every request at once preempts and still finds the same beams."""
    prompts, params = [ids(40 + i, 6 + 3 * i) for i in range(5)], BeamSearchParams(beam_width=3, max_tokens=10)
    want = [[s.token_ids for s in o.sequences] for o in LLM("random:tiny", block_size=4, num_blocks=200).beam_search(prompts, params)]
    for mode, cpu in (("recompute", 0), ("swap", 40)):
        llm = checked(LLM("random:tiny", block_size=4, num_blocks=20, num_cpu_blocks=cpu, preemption_mode=mode))
        got = [[s.token_ids for s in o.sequences] for o in llm.beam_search(prompts, params)]
        assert llm.stats()["num_preemptions"] > 0
        assert got == want
        assert_no_block_held(llm)


# ----------------------------------------------------------------------------------------------
# The events: what the trace and the view tell


def test_every_step_reports_its_events_and_the_references_balance():
    """Each step's report carries its events, stamped with that step and naming their sequences;
    after every step each block's ref_count is the number of tables holding it (check_invariants:
    the balance a per-reference debug log used to show), and at the end nothing is held."""
    llm = LLM("random:tiny", block_size=4, num_blocks=20, num_cpu_blocks=20, preemption_mode="swap")
    events = []

    def watch(report):
        assert all(e.step == report.step for e in report.events)
        events.extend(report.events)
        llm.block_manager.check_invariants()

    llm.on_step.append(watch)
    llm.generate([ids(50, 10), ids(51, 9), ids(52, 11) + ids(50, 10)], SamplingParams(temperature=0, max_tokens=12, n=2))
    kinds = {e.kind for e in events}
    for kind in ("copy", "swap out", "swap in", "preempt", "fork", "finish"):
        assert kind in kinds, f"no {kind} event in the reports"
    assert all(e.seq_ids and e.block_ids for e in events if e.kind in ("copy", "fork", "finish", "preempt"))
    assert_no_block_held(llm)


# ----------------------------------------------------------------------------------------------
# Edges a review found


def test_swapped_request_that_fills_the_pool_comes_back():
    """A request that needs the whole pool is swapped out and swapped back in (it asks only for what its next step writes)."""
    prompts, params = [ids(60, 4), ids(61, 33)], [SamplingParams(temperature=0, max_tokens=6), SamplingParams(temperature=0, max_tokens=3, n=2)]
    want = [[c.token_ids for c in o.outputs] for o in LLM("random:tiny", block_size=4, num_blocks=40).generate(prompts, params)]
    for mode in ("swap", "recompute"):
        llm = checked(LLM("random:tiny", block_size=4, num_blocks=10, num_cpu_blocks=10, preemption_mode=mode))
        assert [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params)] == want
        assert llm.stats()["num_preemptions"] > 0
        assert_no_block_held(llm)


def test_max_num_seqs_counts_the_samples_of_n_gt_1():
    """With max_num_seqs=4, two n=4 requests never run more than 4 sequences at once."""
    llm = checked(LLM("random:tiny", block_size=4, num_blocks=64, max_num_seqs=4))
    running = []
    llm.on_step.append(lambda report: running.append(len(running_seqs(llm))))
    outs = llm.generate([ids(70, 5), ids(71, 7)], SamplingParams(temperature=0.9, n=4, max_tokens=5, seed=3))
    assert max(running) == 4 and all(len(o.outputs) == 4 for o in outs)
    with pytest.raises(ValueError, match="max_num_seqs"):
        llm.generate([ids(72, 5)], SamplingParams(n=5))
    assert_no_block_held(llm)


def test_wrong_params_kind_is_a_value_error():
    """generate takes SamplingParams and beam_search takes BeamSearchParams; the other raises ValueError."""
    llm = LLM("random:tiny", num_blocks=16)
    with pytest.raises(ValueError, match="BeamSearchParams"):
        llm.beam_search([ids(0, 4)], SamplingParams())
    with pytest.raises(ValueError, match="SamplingParams"):
        llm.generate([ids(0, 4)], BeamSearchParams(beam_width=2))
    assert not llm.scheduler.has_unfinished()


def test_auto_mode_follows_its_cost_estimate():
    """preemption_mode='auto' swaps when moving the blocks is cheaper than recomputing, recomputes when it is not,
    and a full host pool falls back to recompute."""
    prompts, params = [ids(80 + i, 9 + 2 * i) for i in range(6)], SamplingParams(temperature=0, max_tokens=12)
    want = [o.outputs[0].token_ids for o in LLM("random:tiny", block_size=4, num_blocks=80).generate(prompts, params)]
    for bandwidth, cpu_blocks, swaps in ((1e15, 30, True), (1.0, 30, False), (1e15, 1, False)):
        llm = checked(LLM("random:tiny", block_size=4, num_blocks=14, num_cpu_blocks=cpu_blocks, preemption_mode="auto"))
        llm.block_manager.cost.seconds_per_block["host"] = 1 / bandwidth   # 1 block/s: a swap would take forever
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == want
        stats = llm.stats()
        assert stats["num_preemptions"] > 0 and (stats["num_swapped_out_blocks"] > 0) == swaps
        assert_no_block_held(llm)


@pytest.mark.parametrize("temperature", [0, 1.0])
def test_nan_logits_are_an_error_naming_the_step_and_requests_and_the_engine_serves_on(temperature):
    """Logits that come back NaN for a step (a broken model) raise FloatingPointError naming the
    step and the requests, before any token is sampled (greedy took token 0 again and again,
    sampling failed inside torch); the step is undone, the call's request dropped, a request
    queued alongside ends with a run's tokens that never failed, and the next call is served."""
    params = SamplingParams(temperature=temperature, max_tokens=8, seed=3, ignore_eos=True)

    def engine():
        return checked(LLM("random:tiny", block_size=4, num_blocks=32))

    fresh = engine()
    [want_queued] = fresh.generate([ids(1, 7)], params)
    [want_call] = fresh.generate([ids(2, 9)], params)
    llm = engine()
    [queued] = llm.add_requests([ids(1, 7)], params)
    llm.step()   # the queued request's first token
    forward = llm.model.forward

    def broken(*args):   # this step's logits all NaN; the next forward is the model's again
        llm.model.forward = forward
        logits, finite = forward(*args)
        return logits * float("nan"), finite

    llm.model.forward = broken
    message = ("step 2: requests 0, 1: NaN/inf in their logits or hidden states: the model's "
               "weights or inputs are broken")
    with pytest.raises(FloatingPointError, match=message):
        llm.generate([ids(2, 9)], params)
    llm.block_manager.check_invariants()
    assert list(llm.requests) == [queued] and llm.num_steps == 1
    assert llm.requests[queued].seqs[0].num_output_tokens == 1   # its token of step 1, no other
    while llm.scheduler.has_unfinished():
        llm.step()
    assert llm.output(queued).outputs[0].token_ids == want_queued.outputs[0].token_ids
    [again] = llm.generate([ids(2, 9)], params)
    assert again.outputs[0].token_ids == want_call.outputs[0].token_ids
    assert_no_block_held(llm)

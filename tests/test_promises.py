"""The engine keeps validate_request's promise: a request that passes validation finishes, with the tokens
it would get in a roomy pool, and an input the engine cannot serve is refused with a ValueError
naming the parameter, before anything is queued (issue 9, item 5).

Runs that could livelock are capped by counting model calls (one per step), so a regression fails
instead of hanging; the model wrapper also lets a test make a step raise."""
import contextlib
import math

import pytest
import torch
import transformers

from conftest import assert_no_block_held
from model import config_from_hf
from nanopaged import LLM, BeamSearchParams, SamplingParams

MAX_STEPS = 2000   # far more than any run here needs: reaching it means no progress


def ids(seed, n):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class Livelock(Exception):
    pass


class ModelProbe:
    """Stands in for llm.model: records the pool before each call, stops a run that never ends, and
    raises on a chosen call (a step that fails)."""

    def __init__(self, llm, raise_on=None):
        self.llm, self.inner, self.raise_on = llm, llm.model, raise_on
        self.calls = self.most_seqs = self.most_used_blocks = 0

    def __getattr__(self, name):   # config and anything else the engine reads from its model
        return getattr(self.inner, name)

    def __call__(self, *args, **kwargs):
        self.calls += 1
        bm = self.llm.block_manager
        self.most_seqs = max(self.most_seqs, len(bm.device.seqs))
        self.most_used_blocks = max(self.most_used_blocks, bm.num_blocks - bm.num_free_blocks)
        if self.calls == self.raise_on:
            raise RuntimeError(f"injected failure at model call {self.calls}")
        if self.calls > MAX_STEPS:
            raise Livelock(f"no end after {MAX_STEPS} steps, {self.llm.stats()['num_preemptions']} "
                           "preemptions")
        return self.inner(*args, **kwargs)


@contextlib.contextmanager
def probed(llm, raise_on=None):
    probe = ModelProbe(llm, raise_on)
    llm.model = probe
    try:
        yield probe
    finally:
        llm.model = probe.inner


def sample_tokens(llm, prompts, params):
    with probed(llm) as probe:
        outs = llm.generate(prompts, params)
    return [[c.token_ids for c in o.outputs] for o in outs], probe


def beam_tokens(llm, prompts, params):
    with probed(llm) as probe:
        outs = llm.beam_search(prompts, params)
    return [[s.token_ids for s in o.sequences] for o in outs], probe


# ----------------------------------------------------------------------------------------------
# Every request that passes validation finishes, in any pool it was admitted to


N_GT_1_CASES = {   # found by fuzzing; each made step() assert "the scheduler found nothing to run"
    "fuzz-bs2-n2-prefix-recompute": (dict(block_size=2, enable_prefix_caching=True,
                                          preemption_mode="recompute"), [7, 14], [11, 12], 2),
    "bs2-n4-prefix-recompute": (dict(block_size=2, enable_prefix_caching=True,
                                     preemption_mode="recompute"), [15, 7], [5, 7], 4),
    "bs4-n4-noprefix-recompute": (dict(block_size=4, enable_prefix_caching=False,
                                       preemption_mode="recompute"), [10, 14], [8, 8], 4),
    "bs4-n4-noprefix-swap": (dict(block_size=4, enable_prefix_caching=False, preemption_mode="swap",
                                  num_cpu_blocks=5), [15, 11], [8, 12], 4),
}


@pytest.mark.parametrize("case", list(N_GT_1_CASES))
def test_n_gt_1_requests_in_a_small_pool_finish_with_roomy_tokens(case):
    """n>1 requests in a 20-block pool finish with the greedy tokens of a 400-block pool."""
    kwargs, lengths, max_tokens, n = N_GT_1_CASES[case]
    prompts = [ids(10 + i, length) for i, length in enumerate(lengths)]
    params = [SamplingParams(temperature=0, n=n, max_tokens=m) for m in max_tokens]
    want, roomy = sample_tokens(LLM("random:tiny", **kwargs, num_blocks=400), prompts, params)
    assert roomy.most_used_blocks > 20   # the small pool really is too small for both at once
    llm = LLM("random:tiny", **kwargs, num_blocks=20)
    got, _ = sample_tokens(llm, prompts, params)
    assert got == want
    assert_no_block_held(llm)


BEAM_CASES = {   # found by fuzzing; each preempted at every step and never ended
    "bs4-recompute": (dict(block_size=4, num_blocks=12, preemption_mode="recompute"),
                      [16, 12, 2], [2, 4, 3], [3, 3, 8]),
    "bs2-swap": (dict(block_size=2, num_blocks=13, preemption_mode="swap", num_cpu_blocks=5),
                 [7, 9, 6], [2, 2, 2], [8, 6, 2]),   # (with other prompts it may finish)
}


@pytest.mark.parametrize("case", list(BEAM_CASES))
def test_beam_search_without_prefix_caching_in_a_tight_pool_finishes(case):
    """Beam search with prefix caching off in a tight pool finishes with a roomy pool's beams."""
    kwargs, lengths, widths, max_tokens = BEAM_CASES[case]
    prompts = [ids(1 + i, length) for i, length in enumerate(lengths)]
    params = [BeamSearchParams(beam_width=w, max_tokens=m) for w, m in zip(widths, max_tokens)]
    roomy_llm = LLM("random:tiny", block_size=kwargs["block_size"], num_blocks=400,
                    enable_prefix_caching=False)
    want, roomy = beam_tokens(roomy_llm, prompts, params)
    assert roomy.most_used_blocks > kwargs["num_blocks"]
    llm = LLM("random:tiny", **kwargs, enable_prefix_caching=False)
    got, _ = beam_tokens(llm, prompts, params)
    assert got == want
    assert_no_block_held(llm)


# ----------------------------------------------------------------------------------------------
# max_num_seqs counts an admitted n>1 or beam request as n from admission


@pytest.mark.parametrize("kind", ["generate", "beam_search"])
def test_max_num_seqs_counts_an_admitted_request_as_n(kind):
    """With max_num_seqs=4, a request of 4 and three of 1 never run over 4 sequences at once."""
    prompts = [ids(30 + i, 5 + i) for i in range(4)]
    if kind == "generate":
        params = [SamplingParams(temperature=0, n=n, max_tokens=6) for n in (4, 1, 1, 1)]
        run = sample_tokens
    else:
        params = [BeamSearchParams(beam_width=w, max_tokens=6) for w in (4, 1, 1, 1)]
        run = beam_tokens
    want, _ = run(LLM("random:tiny", block_size=4, num_blocks=200), prompts, params)
    llm = LLM("random:tiny", block_size=4, num_blocks=200, max_num_seqs=4)
    got, probe = run(llm, prompts, params)
    assert probe.most_seqs == 4
    assert got == want
    assert_no_block_held(llm)


# ----------------------------------------------------------------------------------------------
# Seeded sampling does not depend on scheduling


SEEDED_PROMPTS = [ids(1, 5), ids(2, 6), ids(3, 7)]
SEEDED_PARAMS = [SamplingParams(temperature=1.0, n=n, max_tokens=8, seed=5 + i)
                 for i, n in enumerate((1, 4, 4))]


@pytest.mark.parametrize("kwargs", [dict(max_num_batched_tokens=8), dict(max_num_batched_tokens=3),
                                    dict(num_blocks=20, preemption_mode="recompute")],
                         ids=["budget-8", "budget-3", "preempted"])
def test_seeded_n_gt_1_samples_do_not_depend_on_scheduling(kwargs):
    """Seeded n=4 samples are the same whatever the token budget, and under preemption."""
    roomy = LLM("random:tiny", block_size=4, num_blocks=400, max_num_batched_tokens=2048)
    want, _ = sample_tokens(roomy, SEEDED_PROMPTS, SEEDED_PARAMS)
    llm = LLM("random:tiny", block_size=4, **{"num_blocks": 400, **kwargs})
    got, _ = sample_tokens(llm, SEEDED_PROMPTS, SEEDED_PARAMS)
    if "preemption_mode" in kwargs:
        assert llm.stats()["num_preemptions"] > 0
    assert got == want
    assert_no_block_held(llm)


# ----------------------------------------------------------------------------------------------
# Bad input is a ValueError naming the parameter, before anything is queued


GOOD = ids(40, 6)
GREEDY = SamplingParams(temperature=0, max_tokens=4)


def good_tokens(llm):
    return llm.generate([GOOD], GREEDY)[0].outputs[0].token_ids


def assert_refused(llm, call, match):
    """call(llm) raises ValueError matching `match`; the engine is left as it was and serves on."""
    want = good_tokens(llm)
    before = llm.stats()
    with pytest.raises(ValueError, match=match):
        call(llm)
    assert not llm.scheduler.has_unfinished()
    assert llm.stats() == before
    assert good_tokens(llm) == want
    assert_no_block_held(llm)


def with_good(**bad):   # a good request first, then the bad one: neither may be queued
    return lambda llm: llm.generate([GOOD, ids(41, 5)],
                                    [GREEDY, SamplingParams(max_tokens=4, **bad)])


REFUSED_REQUESTS = {   # passed validation, then broke the engine for good
    "temperature=1e-40": (with_good(temperature=1e-40), "temperature"),
    "top_p=1e-300": (with_good(top_p=1e-300), "top_p"),
    "top_k=2.5": (with_good(top_k=2.5), "top_k"),
    "n=2.0": (with_good(n=2.0), r"\bn\b"),
    "n=True": (with_good(n=True), r"\bn\b"),
    "seed=2**70": (with_good(seed=2 ** 70), "seed"),
    "seed=-1": (with_good(seed=-1), "seed"),
    "seed=1.5": (with_good(seed=1.5), "seed"),
    "seed='7'": (with_good(seed="7"), "seed"),
    # 2 * 200 candidates per beam, from a vocabulary of 256
    "beam_width=200": (lambda llm: llm.beam_search([GOOD, ids(41, 4)], [
        BeamSearchParams(beam_width=2, max_tokens=2),
        BeamSearchParams(beam_width=200, max_tokens=2)]), "beam_width"),
}


@pytest.mark.parametrize("case", list(REFUSED_REQUESTS))
def test_request_that_would_break_the_engine_is_refused(case):
    """A request the engine cannot serve gets a ValueError naming its parameter; nothing queued."""
    call, match = REFUSED_REQUESTS[case]
    assert_refused(LLM("random:tiny", block_size=16, num_blocks=256), call, match)


REFUSED_ENGINES = {
    "max_num_batched_tokens=2.5": (dict(max_num_batched_tokens=2.5), "max_num_batched_tokens"),
    "seed=2**70": (dict(seed=2 ** 70), "seed"),
    "seed=1.5": (dict(seed=1.5), "seed"),
}


@pytest.mark.parametrize("case", list(REFUSED_ENGINES))
def test_engine_argument_that_would_break_the_engine_is_refused(case):
    """An LLM argument the engine cannot run with gets a ValueError naming it, before serving."""
    kwargs, match = REFUSED_ENGINES[case]
    with pytest.raises(ValueError, match=match):
        LLM("random:tiny", block_size=16, num_blocks=64, **kwargs).generate([GOOD], GREEDY)


STEP_FAILURES = {   # (which model call raises, how the requests were made)
    "generate-first-step": (1, "generate"),
    "generate-mid-decode": (3, "generate"),
    "beam_search-mid-decode": (3, "beam_search"),
}


@pytest.mark.parametrize("case", list(STEP_FAILURES))
def test_a_step_that_raises_removes_the_requests_of_its_call(case):
    """When a step raises, the call re-raises it and drops its requests; the engine serves on."""
    raise_on, kind = STEP_FAILURES[case]
    llm = LLM("random:tiny", block_size=4, num_blocks=64)
    prompts = [ids(50, 9), ids(51, 6)]
    with probed(llm, raise_on=raise_on), pytest.raises(RuntimeError, match="injected"):
        if kind == "generate":
            llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=6, n=2), GREEDY])
        else:
            llm.beam_search(prompts, BeamSearchParams(beam_width=2, max_tokens=6))
    assert not llm.scheduler.has_unfinished()
    assert_no_block_held(llm)   # every block free or cached, check_invariants passes
    assert good_tokens(llm) == good_tokens(LLM("random:tiny", block_size=4, num_blocks=64))
    assert_no_block_held(llm)


def test_a_failed_step_leaves_the_other_requests_exact():
    """A step that fails before its block copies are made leaves the requests it does not drop
    with the tokens of a run that never failed (they are recomputed, not served stale K/V)."""
    kwargs = dict(block_size=4, num_blocks=20, num_cpu_blocks=8, preemption_mode="swap",
                  max_num_batched_tokens=5)
    params = SamplingParams(temperature=0, max_tokens=6, n=2)
    other = list(range(40, 49))
    want = [c.token_ids for c in LLM("random:tiny", **kwargs).generate([other], params)[0].outputs]
    llm = LLM("random:tiny", **kwargs)
    [other_id] = llm.add_requests([other], params)
    start_copies = llm.copy_engine.start   # (async_copies, the default: the step's copies)
    calls = []

    def failing_start(llm, batch):   # the third step fails before its copies are made
        calls.append(list(llm.block_manager.copies))
        if len(calls) == 3:
            raise KeyboardInterrupt
        return start_copies(llm, batch)

    llm.copy_engine.start = failing_start
    with pytest.raises(KeyboardInterrupt):
        llm.generate([[5, 6, 7, 8, 9, 10, 11], [5, 6, 7, 8, 1, 2]], params)
    assert any(src.name == dst.name == "device" for src, _, dst, _ in calls[2])   # a copy-on-write was left undone
    llm.copy_engine.start = start_copies
    while llm.scheduler.has_unfinished():
        llm.step()
        llm.block_manager.check_invariants()
    assert [c.token_ids for c in llm.output(other_id).outputs] == want
    assert_no_block_held(llm)


# ----------------------------------------------------------------------------------------------
# The other errors at the API: ValueError, naming the parameter


REFUSED_CALLS = {
    "generate(None)": (lambda llm: llm.generate(None), "prompt"),
    "generate([None])": (lambda llm: llm.generate([None]), "prompt"),
    "tensor prompt": (lambda llm: llm.generate(torch.tensor(GOOD)), "prompt"),
    "temperature='0.5'": (lambda llm: llm.generate([GOOD], SamplingParams(temperature="0.5")),
                          "temperature"),
    "max_tokens=None": (lambda llm: llm.generate([GOOD], SamplingParams(max_tokens=None)),
                        "max_tokens"),
    "params=[]": (lambda llm: llm.generate([GOOD], params=[]), "params"),
    "True token id": (lambda llm: llm.generate([[True] + GOOD], GREEDY), "token id"),
    "length_penalty=nan": (lambda llm: llm.beam_search([GOOD], BeamSearchParams(
        beam_width=2, max_tokens=4, length_penalty=math.nan)), "length_penalty"),
    "step() when idle": (lambda llm: llm.step(), "step"),
}


@pytest.mark.parametrize("case", list(REFUSED_CALLS))
def test_bad_call_is_a_value_error_naming_the_parameter(case):
    """A malformed call gets a ValueError naming what was wrong, and changes nothing."""
    call, match = REFUSED_CALLS[case]
    assert_refused(LLM("random:tiny", block_size=16, num_blocks=64), call, match)


BAD_ENGINE_ARGUMENTS = {
    "block_size='16'": (dict(block_size="16"), "block_size"),
    "block_size=16.0": (dict(block_size=16.0), "block_size"),
    "num_blocks=10.5": (dict(num_blocks=10.5), "num_blocks"),
    "max_model_len=0": (dict(max_model_len=0), "max_model_len"),
    "async_copies=1": (dict(async_copies=1), "async_copies"),
    "tier_gbps={'gpu': 1}": (dict(tier_gbps={"gpu": 1}), "tier_gbps"),
    "tier_gbps={'host': 0}": (dict(tier_gbps={"host": 0}), "tier_gbps"),
    "tier_gbps={'disk': nan}": (dict(tier_gbps={"disk": float("nan")}), "tier_gbps"),
    "tier_gbps=16": (dict(tier_gbps=16), "tier_gbps"),
}


@pytest.mark.parametrize("case", list(BAD_ENGINE_ARGUMENTS))
def test_bad_engine_argument_is_a_value_error_naming_it(case):
    """A malformed LLM argument gets a ValueError naming it, not a TypeError or silence."""
    kwargs, match = BAD_ENGINE_ARGUMENTS[case]
    with pytest.raises(ValueError, match=match):
        LLM("random:tiny", **{"num_blocks": 64, **kwargs}).generate([GOOD], GREEDY)


# ----------------------------------------------------------------------------------------------
# The prefix cache finds a prefix computed twice in one step


def test_prefix_computed_by_two_requests_in_one_step_is_found_whole():
    """After P+X and P+Y ran together, P+Y again hits every full block but the last token's."""
    block_size = 4
    prefix, x, y = ids(60, 8), ids(61, 5), ids(62, 5)
    llm = LLM("random:tiny", block_size=block_size, num_blocks=64, enable_prefix_caching=True)
    params = SamplingParams(temperature=0, max_tokens=4)
    first = llm.generate([prefix + x, prefix + y], params)
    hits = llm.stats()["prefix_cache_hits"]
    again = llm.generate([prefix + y], params)
    hittable = (len(prefix + y) - 1) // block_size * block_size   # 12 of 13 tokens
    assert llm.stats()["prefix_cache_hits"] - hits == hittable
    assert again[0].outputs[0].token_ids == first[1].outputs[0].token_ids
    assert_no_block_held(llm)


# ----------------------------------------------------------------------------------------------
# config_from_hf refuses a model it cannot run exactly


SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=131072)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
UNSUPPORTED = {   # (config class, what it cannot run exactly, message)
    "llama3 rope scaling": (transformers.LlamaConfig, dict(rope_scaling=LLAMA3_ROPE), "rope"),
    "linear rope scaling": (transformers.LlamaConfig,
                            dict(rope_scaling={"rope_type": "linear", "factor": 2.0}), "rope"),
    "sliding window": (transformers.MistralConfig, dict(sliding_window=4096), "sliding"),
    "uneven K/V heads": (transformers.LlamaConfig, dict(num_key_value_heads=3), "num_kv_heads"),
}


@pytest.mark.parametrize("case", list(UNSUPPORTED))
def test_config_from_hf_refuses_what_it_cannot_run_exactly(case):
    """A plain config converts; the same config with rope scaling, a sliding window or K/V heads
    that do not divide its heads is refused."""
    config_class, feature, match = UNSUPPORTED[case]
    plain = {name: None for name in feature}   # the same model without the feature
    assert config_from_hf(config_class(**{**SMALL, **plain})).vocab_size == 256
    with pytest.raises(ValueError, match=match):
        config_from_hf(config_class(**{**SMALL, **feature}))


# ----------------------------------------------------------------------------------------------
# Beam search counts as generated only the tokens it keeps


def test_beam_search_counts_an_eos_candidate_only_if_it_is_returned():
    """Beams take beam_width tokens a round; an eos candidate counts only if it is returned."""
    llm = LLM("random:tiny", block_size=4, num_blocks=64)
    eos = frozenset(range(16))   # one token in 16 ends a beam: eos candidates every round
    llm.scheduler.eos_token_ids = eos
    params = BeamSearchParams(beam_width=3, max_tokens=8, length_penalty=0.5)
    out = llm.beam_search([ids(70, 6)], params)[0]
    # an eos is never a live beam's token: a returned sequence ending in one ended by eos
    eos_returned = sum(s.token_ids[-1] in eos for s in out.sequences)
    assert eos_returned >= 1
    assert llm.stats()["num_generated_tokens"] == 3 * 8 + eos_returned
    assert_no_block_held(llm)

"""The engine end to end on the CPU: greedy parity with transformers, prefix caching, copy-on-write,
preemption, bad input. Every run checks the block manager's invariants after every step."""
import pytest
import torch

from conftest import assert_no_block_held, checked, hf_greedy, running_seqs
from nanopaged import LLM, SamplingParams, ScheduledBatch

GREEDY = SamplingParams(temperature=0, max_tokens=32)
PROMPTS = [
    "Hi",
    "The capital of France is",
    "Write a haiku about the memory of an old computer:",
    "def quicksort(xs):\n    # sort a list of numbers in ascending order\n",
    "Paged attention splits the key-value cache into fixed-size blocks. Explain, in two sentences, why "
    "this reduces memory fragmentation compared to reserving a contiguous buffer per request:",
    "Once upon a time, in a small village at the edge of a great forest, there lived an old clockmaker "
    "who repaired every clock in the valley. One winter morning a stranger arrived with a clock that ran "
    "backwards, and asked the clockmaker to",
]


@pytest.fixture(scope="module")
def reference(default_hf):
    """Token ids of each prompt and transformers' greedy continuation of it."""
    hf, tokenizer = default_hf
    prompts = [tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
    assert len({len(p) for p in prompts}) == len(prompts), "prompts must have different lengths"
    return prompts, [hf_greedy(hf, p, GREEDY.max_tokens) for p in prompts]


@pytest.mark.parametrize("kwargs", [
    dict(block_size=16),
    dict(block_size=4),
    dict(block_size=16, enable_prefix_caching=False),
    dict(block_size=16, max_num_batched_tokens=16),   # every prompt but the shortest is chunked
    dict(block_size=4, num_blocks=30),                # too small for all at once: preempts and recomputes
], ids=["bs16", "bs4", "no-prefix-cache", "chunked-prefill", "preempt"])
def test_greedy_matches_transformers(reference, kwargs):
    """All six prompts in one call give exactly transformers' greedy tokens, one prompt at a time."""
    prompts, want = reference
    llm = checked(LLM(**{"num_blocks": 256, **kwargs}))
    outs = llm.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == want
    if "num_blocks" in kwargs:
        assert llm.stats()["num_preemptions"] > 0
    if "max_num_batched_tokens" in kwargs:   # the longest prompt took several steps to prefill
        assert llm.num_steps > GREEDY.max_tokens + max(len(p) for p in prompts) // 16
    assert_no_block_held(llm)


def test_greedy_matches_transformers_from_prefix_cache(reference):
    """A second pass over the same prompts reuses cached blocks and still gives transformers' tokens."""
    prompts, want = reference
    llm = checked(LLM(num_blocks=256))
    llm.generate(prompts, GREEDY)
    hits = llm.stats()["prefix_cache_hits"]
    outs = llm.generate(prompts, GREEDY)
    assert llm.stats()["prefix_cache_hits"] > hits
    assert [o.outputs[0].token_ids for o in outs] == want
    assert_no_block_held(llm)


# ----------------------------------------------------------------------------------------------
# Mechanisms on random:tiny (fast): prefix caching, copy-on-write, chunking, bad input


def tiny(**kwargs):
    return checked(LLM("random:tiny", **{"num_blocks": 64, **kwargs}))


def ids(seed, n):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_shared_prefix_computes_only_new_tokens():
    """A request sharing a 64-token prefix with an earlier one computes only its 10 new tokens."""
    prefix, params = ids(0, 64), SamplingParams(temperature=0, max_tokens=4)
    fresh = tiny(block_size=16)   # the same request with an empty cache: the cost without sharing
    fresh.generate([prefix + ids(2, 10)], params)
    cold = fresh.stats()
    llm = tiny(block_size=16)
    llm.generate([prefix + ids(1, 7)], params)
    before = llm.stats()
    out = llm.generate([prefix + ids(2, 10)], params)
    after = llm.stats()
    assert after["prefix_cache_hits"] - before["prefix_cache_hits"] == 64
    computed = after["num_prefill_tokens_computed"] - before["num_prefill_tokens_computed"]
    assert computed == cold["num_prefill_tokens_computed"] - 64 == 10
    assert out[0].outputs[0].token_ids == fresh.generate([prefix + ids(2, 10)], params)[0].outputs[0].token_ids
    assert_no_block_held(llm)


def test_fully_cached_prompt_computes_its_last_token():
    """A prompt found whole in the cache still computes the block holding its last token, and samples the same."""
    prompt, params = ids(3, 64), SamplingParams(temperature=0, max_tokens=6)
    llm = tiny(block_size=16)
    first = llm.generate([prompt], params)[0].outputs[0].token_ids
    before = llm.stats()
    second = llm.generate([prompt], params)[0].outputs[0].token_ids
    after = llm.stats()
    assert after["prefix_cache_hits"] - before["prefix_cache_hits"] == 48
    assert after["num_prefill_tokens_computed"] - before["num_prefill_tokens_computed"] == 16
    assert second == first
    assert_no_block_held(llm)


def test_n4_sampling_shares_prompt_blocks_and_copies_only_the_partial_block():
    """n=4 samples hold the prompt's full blocks once (ref_count 4); only the shared last block is copied, 3 times."""
    llm = tiny(block_size=16)
    prompt = ids(4, 40)   # 2 full blocks + a last block holding 8 tokens
    seen = []

    def watch(report):
        bm = llm.block_manager
        tables = [list(s.block_table) for s in running_seqs(llm)]
        seen.append((len(tables), [[bm.device.blocks[b].ref_count for b in t] for t in tables], tables,
                     bm.counts["num_cow_copies"]))

    llm.on_step.append(watch)
    out = llm.generate([prompt], SamplingParams(temperature=1.0, n=4, max_tokens=5, seed=1))[0]
    # after the prefill step the request forked: four tables, every block of the prompt held 4 times
    n_seqs, refs, tables, copies = seen[0]
    assert n_seqs == 4 and refs == [[4, 4, 4]] * 4 and copies == 0
    assert all(t == tables[0] for t in tables)
    # the first decode writes into the shared partial block: three writers copy it, the last writes in place
    n_seqs, refs, tables, copies = seen[1]
    assert copies == 3 and llm.stats()["num_cow_copies"] == 3
    assert [r[:2] for r in refs] == [[4, 4]] * 4 and all(r[2] == 1 for r in refs)
    assert len({t[2] for t in tables}) == 4 and all(t[:2] == tables[0][:2] for t in tables)
    assert len(out.outputs) == 4 and all(len(c.token_ids) == 5 for c in out.outputs)
    assert_no_block_held(llm)


def test_chunked_prefill_matches_whole_prefill():
    """A budget of 8 tokens per step splits prompts into chunks and still gives the same greedy tokens."""
    prompts, params = [ids(5, 37), ids(6, 3), ids(7, 20)], SamplingParams(temperature=0, max_tokens=8)
    want = [o.outputs[0].token_ids for o in tiny(block_size=4).generate(prompts, params)]
    llm = tiny(block_size=4, max_num_batched_tokens=8)
    sizes = []
    llm.on_step.append(lambda report: sizes.append(report.batch.num_tokens))
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == want
    assert max(sizes) == 8 and len(sizes) >= 60 // 8
    assert_no_block_held(llm)


def test_sampling_is_reproducible_with_a_seed():
    """The same seed gives the same samples; temperature > 0 with top-k and top-p stays in range."""
    params = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, max_tokens=10, n=2, seed=7)
    a = tiny().generate([ids(8, 12)], params)[0]
    b = tiny().generate([ids(8, 12)], params)[0]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert all(0 <= t < 256 for c in a.outputs for t in c.token_ids)


BAD = {   # the bad inputs the API must refuse: what to call and a word the message must contain
    "empty prompt": (lambda llm: llm.generate([[]]), "empty"),
    "token outside vocab": (lambda llm: llm.generate([[1, 2, 256]]), "vocabulary"),
    "beyond max_model_len": (lambda llm: llm.generate([ids(0, 60)], SamplingParams(max_tokens=10)), "max_model_len"),
    "max_tokens < 1": (lambda llm: SamplingParams(max_tokens=0), "max_tokens"),
    "n < 1": (lambda llm: SamplingParams(n=0), "n must"),
    "temperature < 0": (lambda llm: SamplingParams(temperature=-0.5), "temperature"),
    "top_p 0": (lambda llm: SamplingParams(top_p=0.0), "top_p"),
    "top_p > 1": (lambda llm: SamplingParams(top_p=1.5), "top_p"),
    "pool too small": (lambda llm: llm.generate([ids(0, 30)], SamplingParams(max_tokens=30, n=4)), "too small"),
    "block_size 12": (lambda llm: LLM("random:tiny", block_size=12), "power of two"),
    "swap without host pool": (lambda llm: LLM("random:tiny", preemption_mode="swap"), "host pool"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_input_raises_and_engine_keeps_serving(case):
    """Each bad input raises a ValueError naming the problem, changes nothing, and a good request still runs."""
    llm = tiny(block_size=4, num_blocks=24, max_model_len=64)
    good = SamplingParams(temperature=0, max_tokens=5)
    want = llm.generate([ids(9, 10)], good)[0].outputs[0].token_ids
    stats = llm.stats()
    call, word = BAD[case]
    with pytest.raises(ValueError, match=word):
        call(llm)
    with pytest.raises(ValueError, match=word):   # mixed with a good prompt in one call: nothing is queued
        if case in ("block_size 12", "swap without host pool") or "<" in case or "top_p" in case:
            call(llm)
        else:
            bad_prompt = {"empty prompt": [], "token outside vocab": [1, 2, 256]}.get(case, ids(0, 60))
            llm.generate([ids(9, 10), bad_prompt], SamplingParams(max_tokens=30 if case == "pool too small" else 10,
                                                                  n=4 if case == "pool too small" else 1))
    assert not llm.scheduler.waiting and not llm.scheduler.running and llm.stats() == stats
    assert llm.generate([ids(9, 10)], good)[0].outputs[0].token_ids == want
    assert_no_block_held(llm)


def test_a_batch_counts_its_tokens_as_entries_come_and_go():
    """A step's batch keeps the count of its tokens as it grows and as preemption takes entries
    back out: the count is the sum of its entries' new tokens, within the budget, every step."""
    llm = tiny(block_size=4, num_blocks=13, max_num_batched_tokens=16, preemption_mode="recompute")
    removed = []
    remove = ScheduledBatch.remove

    def counted_remove(batch, request):   # (how many entries a removal takes out)
        before = len(batch.entries)
        remove(batch, request)
        removed.append(before - len(batch.entries))

    counts = []
    llm.on_step.append(lambda report: counts.append(
        (report.batch.num_tokens, sum(e.num_new_tokens for e in report.batch.entries))))
    params = SamplingParams(temperature=0.8, n=2, max_tokens=12, ignore_eos=True, seed=3)
    try:
        ScheduledBatch.remove = counted_remove
        llm.generate([ids(i, 9) for i in range(4)], params)
    finally:
        ScheduledBatch.remove = remove
    assert llm.stats()["num_preemptions"] > 0 and any(removed)   # entries were taken back out
    assert all(n == total <= 16 for n, total in counts)
    assert_no_block_held(llm)

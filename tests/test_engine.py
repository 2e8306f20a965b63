"""The engine end to end on the CPU: greedy parity with transformers, prefix caching, copy-on-write,
preemption, bad input. Every run checks the block manager's invariants after every step."""
import pytest
import torch

from conftest import assert_no_block_held, checked, hf_greedy
from nanopaged import LLM, SamplingParams

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

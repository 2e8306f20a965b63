"""A fault leaves nothing poisoned or lost behind it: a NaN in a chunk that samples nothing is an
error before any of its blocks is registered; a Ctrl-C while a prefix is loaded up from the host
leaves it cached there; engines built one after another do not pile up; and the cost rule's time
per token is the model's compute, not the steps' waits for copies."""
import atexit
import gc
import os
import signal
import threading
import time
import weakref

import pytest

from conftest import assert_no_block_held, checked
from nanopaged import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def tokens(out):
    return out.outputs[0].token_ids


# ----------------------------------------------------------------------------------------------
# A NaN is never cached


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_a_nan_in_a_chunk_that_samples_nothing_is_an_error_and_nothing_it_wrote_is_found(
        kv_cache_dtype):
    """4 tokens a step, a 12-token prompt whose first 8 tokens embed as NaN for one call (then the
    model is itself again): the first chunk, which samples nothing, raises FloatingPointError
    naming the step and the request (an INT8 cache turns the NaN into zeros, so the last chunk's
    logits alone would pass), before any block is registered. Then the prompt, asked 3 times, and
    a prompt sharing its first block give a fresh engine's tokens."""
    prompt = list(range(100, 112))
    sharing = prompt[:4] + list(range(200, 208))
    knobs = dict(block_size=4, max_num_batched_tokens=4, kv_cache_dtype=kv_cache_dtype)
    fresh = LLM("random:tiny", num_blocks=64, **knobs)
    want = [tokens(o) for o in fresh.generate([prompt, sharing], GREEDY)]
    llm = checked(LLM("random:tiny", num_blocks=64, **knobs))
    # the model is shared by the engines built alike (load_model): put back in any case
    embedding = llm.model.embed_tokens.weight.data
    saved = embedding[prompt[:8]].clone()
    try:
        embedding[prompt[:8]] = float("nan")
        message = "step 1: requests 0: NaN/inf in their logits or hidden states"
        with pytest.raises(FloatingPointError, match=message):
            llm.generate([prompt], GREEDY)
    finally:
        embedding[prompt[:8]] = saved
    assert llm.num_steps == 0 and not llm.block_manager.device.hash_to_block_ids
    for _ in range(3):
        [out] = llm.generate([prompt], GREEDY)
        assert tokens(out) == want[0]
    [out] = llm.generate([sharing], GREEDY)
    assert tokens(out) == want[1] and out.cached_by_tier == {"device": 4}
    assert_no_block_held(llm)


def test_a_nan_in_a_later_chunk_leaves_the_earlier_chunks_computed_right():
    """The NaN in the prompt's last chunk only: the step that computes it raises; the blocks the
    earlier chunks computed (checked finite as they ran) are found again, and the prompt gives a
    fresh engine's tokens."""
    prompt = list(range(120, 132))
    knobs = dict(block_size=4, max_num_batched_tokens=4)
    [want] = LLM("random:tiny", num_blocks=64, **knobs).generate([prompt], GREEDY)
    llm = checked(LLM("random:tiny", num_blocks=64, **knobs))
    embedding = llm.model.embed_tokens.weight.data
    saved = embedding[prompt[8:]].clone()
    try:
        embedding[prompt[8:]] = float("nan")
        with pytest.raises(FloatingPointError, match="step 3: requests 0: "):
            llm.generate([prompt], GREEDY)
    finally:
        embedding[prompt[8:]] = saved
    [out] = llm.generate([prompt], GREEDY)
    assert tokens(out) == tokens(want) and out.cached_by_tier == {"device": 8}
    assert_no_block_held(llm)


# ----------------------------------------------------------------------------------------------
# A Ctrl-C during a load from the host loses no prefix


@pytest.fixture
def sigint_raises():
    """SIGINT raises KeyboardInterrupt, even under a runner started with it ignored."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


A = list(range(10, 22))   # 3 blocks of 4 tokens: the first 2 can be found


def a_on_the_host(async_copies=True):
    """An engine where prompt A ran, then a longer prompt took the whole device pool: A's blocks
    are written down to the host. No cost rule: every tier is worth loading from, however slow
    its link. Returns the engine and A's output."""
    llm = checked(LLM("random:tiny", block_size=4, num_blocks=6, num_cpu_blocks=8,
                      preemption_mode="recompute", async_copies=async_copies))
    llm.block_manager.cost = None
    [out] = llm.generate([A], GREEDY)
    llm.generate([list(range(40, 63))], SamplingParams(temperature=0, max_tokens=1))
    host = llm.block_manager.host
    on_host = sorted(host.blocks[i].token_ids for ids in host.hash_to_block_ids.values()
                     for i in ids)
    assert [tuple(A[:4]), tuple(A[4:8])] == on_host[:2]
    return llm, out


def assert_a_is_found_on_the_host(llm, want):
    """A, asked again, finds its 2 blocks on the host (not 'first seen'): a fresh engine's
    tokens, every block free or cached after."""
    llm.block_manager.check_invariants()
    [again] = llm.generate([A], GREEDY)
    assert again.cached_by_tier == {"host": 8}, again.computed_by_reason
    assert tokens(again) == tokens(want)
    assert_no_block_held(llm)


@pytest.mark.parametrize("async_copies", [True, False])
def test_a_ctrl_c_during_a_load_from_the_host_leaves_the_prefix_there(sigint_raises,
                                                                       async_copies):
    """Prompt A's blocks on the host, then A again, its load over a link of 4 s a block: a SIGINT
    0.5 s into the step's first copy is answered at once, and the undo leaves A's blocks cached on
    the host, where A, asked again, finds them."""
    llm, want = a_on_the_host(async_copies)
    # each copy over the host link now takes 4 s
    llm.copier.seconds["host"] = 4.0
    copy, sent = llm.copier.copy, []

    def first_copy_interrupted(*args):
        if not sent:
            sent.append(time.perf_counter() + 0.5)
            threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
        return copy(*args)

    llm.copier.copy = first_copy_interrupted
    with pytest.raises(KeyboardInterrupt):
        llm.generate([A], GREEDY)
    assert time.perf_counter() - sent[0] < 2
    llm.copier.copy = copy
    del llm.copier.seconds["host"]
    assert_a_is_found_on_the_host(llm, want)


def test_a_copy_that_fails_is_an_error_and_the_prefix_stays_where_it_was():
    """As above, but the step's first copy raises on the copy thread (a disk or device error): the
    step raises RuntimeError naming it; the copies from it on are not trusted (the one that failed
    and those after it, which are not made), their sources kept: A, asked again, finds its blocks
    on the host."""
    llm, want = a_on_the_host()
    copy = llm.copier.copy

    def failing(*args):
        llm.copier.copy = copy
        raise OSError("injected: the copy failed")

    llm.copier.copy = failing
    with pytest.raises(RuntimeError, match="a block copy failed: OSError"):
        llm.generate([A], GREEDY)
    assert_a_is_found_on_the_host(llm, want)


# ----------------------------------------------------------------------------------------------
# One engine alive at a time


def resident_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads /proc")
def test_engines_built_one_after_another_do_not_pile_up():
    """Ten engines built in a loop, each with a 64 MiB pool and a step hook that refers to it (a
    reference cycle, as tests/conftest.py's checked makes): once the next is built and the
    collector has run, the earlier ones are gone, their copy threads too; the process's memory
    stays flat; no exit hook is registered per engine."""
    # the imports' own exit hooks and threads first: an engine built and dropped
    LLM("random:tiny", block_size=4, num_blocks=8).generate([[1, 2, 3]], GREEDY)
    gc.collect()
    exit_hooks = atexit._ncallbacks()
    threads = threading.active_count()
    engines = []
    memory = []
    for _ in range(10):
        # 32768 blocks of 2 KiB (random:tiny, 4 tokens a block): 64 MiB
        llm = checked(LLM("random:tiny", block_size=4, num_blocks=32768))
        llm.generate([[1, 2, 3, 4, 5]], GREEDY)
        engines.append(weakref.ref(llm))
        gc.collect()
        memory.append(resident_mib())
    alive = [ref() is not None for ref in engines]
    assert alive == [False] * 9 + [True]
    assert memory[-1] - memory[1] < 64, memory
    assert atexit._ncallbacks() == exit_hooks
    # the copy threads of the engines gone end with them (as soon as they take the stop): the
    # live engine's alone is left
    deadline = time.perf_counter() + 5
    while threading.active_count() > threads + 1 and time.perf_counter() < deadline:
        time.sleep(0.01)
    assert threading.active_count() <= threads + 1


# ----------------------------------------------------------------------------------------------
# The cost rule measures compute


def test_the_cost_rule_times_the_model_not_the_waits_for_copies():
    """Swap preemption over a host link of 1 s a block: the steps wait seconds for swap-ins, yet
    the rule's time per token stays the model's (random:tiny's: a few milliseconds; under 50,
    whatever a busy machine adds, where the waits counted as compute put it near 180), and the
    slow link does not become worth loading from (that would take over 250 ms a token)."""
    prompts = [list(range(10 * i, 10 * i + 8)) for i in range(1, 4)]
    knobs = dict(block_size=4, num_blocks=8, num_cpu_blocks=16, preemption_mode="swap")
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    fast = LLM("random:tiny", **knobs)
    want = [tokens(o) for o in fast.generate(prompts, params)]
    # 1 s a block (random:tiny's blocks of 4 tokens: 2 KiB)
    gbps = fast.copier.bytes_per_block["host"] / 1e9
    llm = checked(LLM("random:tiny", tier_gbps={"host": gbps}, **knobs))
    assert [tokens(o) for o in llm.generate(prompts, params)] == want
    stats = llm.stats()
    assert stats["num_swapped_in_blocks"] > 0 and stats["copy_wait_seconds"] > 1
    cost = llm.block_manager.cost
    assert cost.seconds_per_token < 0.05, cost
    assert not cost.worth_loading(llm.block_manager.host)
    assert_no_block_held(llm)

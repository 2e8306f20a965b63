"""The first reading is closed: nanopaged.py, model.py and kernel.py cut at their banners ("reading
path ends here") are a plain engine that runs by itself. Each module is built here from the text
above its banner alone (nothing below is executed or imported: the plain modules import one
another), and the plain engine, on the full model's weights and its linear layer, is held to the
full engine: the same greedy tokens, prefix-cache hits, copy-on-write with n=4, preemption by
recompute in a small pool, every block free or cached at the end, the invariants holding. The
plain Triton launcher, interpreted, matches the plain reference."""
import os
import sys
import types

import pytest
import torch

import kernel
import model
import nanopaged

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def first_reading(name, plain):
    """A module built from name.py's text above its banner; plain: the plain modules built so far,
    which its imports get (under their names: `from kernel import ...`)."""
    with open(os.path.join(ROOT, f"{name}.py"), encoding="utf-8") as f:
        text = f.read()
    banner = text.index("reading path ends here")
    module = types.ModuleType(name)
    module.__file__ = f"{name}.py, first reading"
    saved = {n: sys.modules.get(n) for n in [*plain, name]}
    sys.modules.update(plain)
    sys.modules[name] = module   # (dataclasses look their module up)
    try:
        exec(compile(text[:banner], module.__file__, "exec"), module.__dict__)
    finally:
        for n, m in saved.items():
            if m is None:
                sys.modules.pop(n)
            else:
                sys.modules[n] = m
    return module


@pytest.fixture(scope="module")
def plain():
    """The three plain modules, by name."""
    modules = {}
    for name in ("kernel", "model", "nanopaged"):
        modules[name] = first_reading(name, modules)
    return types.SimpleNamespace(**modules)


def test_the_first_reading_defines_no_refinement(plain):
    """Cut at the banners, the full engine's names are gone: the plain classes run alone."""
    for name in ("LLM", "BlockManager", "SamplingParams", "BeamSearchParams", "EventLog", "View",
                 "PriorityScheduler", "Undo", "CopyEngine", "CostModel"):
        assert not hasattr(plain.nanopaged, name), name
    assert not hasattr(plain.kernel, "paged_attention") and not hasattr(plain.kernel, "quantize")
    assert not hasattr(plain.model, "load_model") and not hasattr(plain.model, "Linear")
    assert issubclass(nanopaged.LLM, nanopaged.Engine)
    assert issubclass(nanopaged.BlockManager, nanopaged.KVCacheManager)


KNOBS = dict(block_size=4, max_num_batched_tokens=64, async_copies=False)


def engines(plain, num_blocks, **knobs):
    """(plain engine, full engine): the same knobs, the same weights, the same linear layer."""
    full = nanopaged.LLM("random:tiny", num_blocks=num_blocks, **KNOBS, **knobs)
    weights = plain.model.Llama(full.model.config, linear=model.Linear)
    weights.load_state_dict(full.model.state_dict())
    args = plain.nanopaged.EngineArgs(num_blocks=num_blocks, **KNOBS, **knobs)
    return plain.nanopaged.Engine(weights.eval(), args), full


def assert_all_blocks_free_or_cached(engine):
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not bm.device.seqs
    nanopaged.check_block_manager(bm, "end")


PROMPTS = [[(7 * i + 3 * j) % 256 for j in range(9 + 3 * i)] for i in range(4)]


def tokens(outputs):
    return [[c.token_ids for c in out.outputs] for out in outputs]


def test_greedy_tokens_and_prefix_hits_equal_the_full_engines(plain):
    engine, full = engines(plain, num_blocks=64)
    greedy = dict(temperature=0, max_tokens=8, ignore_eos=True)
    first = engine.generate(PROMPTS, plain.nanopaged.Sampling(**greedy))
    assert tokens(first) == tokens(full.generate(PROMPTS, nanopaged.SamplingParams(**greedy)))
    # asked again, each prompt finds its full blocks but the last token's
    again = engine.generate(PROMPTS[:2], plain.nanopaged.Sampling(**greedy))
    assert tokens(again) == tokens(first[:2])
    assert [out.num_cached_tokens for out in again] == [8, 8]
    assert engine.block_manager.counts["prefix_cache_hits"] == 16
    assert_all_blocks_free_or_cached(engine)


def test_n4_samples_share_their_prompt_and_copy_on_write_as_the_full_engine(plain):
    engine, full = engines(plain, num_blocks=64)
    sampling = dict(temperature=0.8, n=4, max_tokens=6, ignore_eos=True, seed=3)
    # 13 tokens: its last block, shared by the four, holds one; three of them copy it to write
    prompt = [PROMPTS[1] + [5]]
    out = engine.generate(prompt, plain.nanopaged.Sampling(**sampling))
    assert tokens(out) == tokens(full.generate(prompt, nanopaged.SamplingParams(**sampling)))
    assert len(set(map(tuple, tokens(out)[0]))) > 1   # four samples, not one four times
    assert engine.block_manager.counts["num_cow_copies"] == 3 == full.stats()["num_cow_copies"]
    assert_all_blocks_free_or_cached(engine)


def test_a_small_pool_preempts_by_recompute_and_changes_no_token(plain):
    engine, roomy = engines(plain, num_blocks=14, preemption_mode="recompute")
    greedy = dict(temperature=0, max_tokens=12, ignore_eos=True)
    out = engine.generate(PROMPTS, plain.nanopaged.Sampling(**greedy))
    assert engine.scheduler.num_preemptions > 0
    full = nanopaged.LLM("random:tiny", num_blocks=256, **KNOBS)
    assert tokens(out) == tokens(full.generate(PROMPTS, nanopaged.SamplingParams(**greedy)))
    assert_all_blocks_free_or_cached(engine)


def test_the_plain_launcher_interpreted_matches_the_plain_reference(plain):
    """A float pool, one program per context (INT8 and flash-decoding's slices are the full
    launcher's, below the banner: constexpr branches of the same kernel that this one never
    takes)."""
    if plain.kernel.triton is None or os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs Triton's interpreter")
    case = kernel.random_case(0, 4, 2, 3, 16, ((1, 1), (13, 1), (9, 9), (22, 5)))
    out = plain.kernel.paged_attention_plain(*case)
    torch.testing.assert_close(out, plain.kernel.paged_attention_ref(*case), rtol=1e-4, atol=1e-4)

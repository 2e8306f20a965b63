"""The Triton kernel under TRITON_INTERPRET=1 (on the CPU) against the PyTorch reference, and the
engine's greedy output with the kernel against its output with the reference."""
import random

import pytest
import torch

from conftest import assert_no_block_held, checked
from kernel import (paged_attention_ref, paged_attention_ref_int8, paged_attention_triton, quantize,
                    random_case)
from nanopaged import LLM, SamplingParams


def mixed_batch(rng, block_size):
    """Decodes and prefill chunks on top of cached context; lengths rarely multiples of block_size."""
    ctx_q = []
    for _ in range(rng.randint(2, 5)):
        kind = rng.choice(["decode", "prefill", "chunk"])
        ctx = rng.randint(1, 6 * block_size + 5)
        q_len = 1 if kind == "decode" else ctx if kind == "prefill" else rng.randint(1, ctx)
        ctx_q.append((ctx, q_len))
    return tuple(ctx_q)


@pytest.mark.parametrize("kv_cache_dtype", ["float32", "int8"])
@pytest.mark.parametrize("num_kv_splits", [1, 3], ids=["whole-context", "split-context"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("block_size", [4, 8, 16])
def test_triton_matches_reference(block_size, group, head_dim, num_kv_splits, kv_cache_dtype):
    """Relative error under 1e-4 in float32 on a random mixed batch with shuffled block tables; no output left unwritten.
    INT8 caches (each row's scale after its values): the kernel dequantizes in registers, the reference what it gathers."""
    seed = block_size * 1000 + group * 100 + head_dim + num_kv_splits
    ctx_q = mixed_batch(random.Random(seed), block_size)
    case = random_case(seed, block_size=block_size, num_kv_heads=2, group=group, head_dim=head_dim, ctx_q=ctx_q)
    if kv_cache_dtype == "int8":
        case = (case[0], quantize(case[1]), quantize(case[2]), *case[3:])
    q = case[0]
    poisoned = torch.full_like(q, float("nan"))
    out = paged_attention_triton(*case, max_query_len=max(n for _, n in ctx_q), num_kv_splits=num_kv_splits, out=poisoned)
    ref = (paged_attention_ref_int8 if kv_cache_dtype == "int8" else paged_attention_ref)(*case)
    assert not out.isnan().any(), "the kernel left outputs unwritten"
    rel = ((out - ref).abs().max() / ref.abs().max()).item()
    assert rel < 1e-4, f"relative error {rel:.2e} for {ctx_q}"


def test_engine_greedy_with_triton_equals_reference(monkeypatch):
    """random:tiny generates the same greedy tokens with the Triton kernel (interpreted) as with the reference."""
    prompts = [torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (3, 11, 6)]
    params = SamplingParams(temperature=0, max_tokens=6)
    monkeypatch.setenv("NANOPAGED_ATTENTION", "torch")
    want = [o.outputs[0].token_ids for o in LLM("random:tiny", block_size=4, num_blocks=32).generate(prompts, params)]
    monkeypatch.setenv("NANOPAGED_ATTENTION", "triton")
    llm = checked(LLM("random:tiny", block_size=4, num_blocks=32))
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == want
    assert_no_block_held(llm)

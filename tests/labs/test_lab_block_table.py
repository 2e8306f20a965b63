"""
Lab block-table: the block table and the slot mapping (Engine._prepare's slot mapping in
nanopaged.py, paged_attention_ref's gather in kernel.py).

What the student writes: the slot of each new token (physical block * block_size + offset, the
physical block read from the sequence's block table), where the model writes its K/V; and the
gather that reads every context back through the block tables for attention.
What the tests pin, on random:tiny: the slots of a known table, a prefill's and a decode's; the
reference attention against dense attention over K/V gathered one position at a time; the paged
engine's greedy tokens against the dense model's (transformers', no cache pages at all).

    python tests/labs/labs.py grade block-table
"""
from collections import deque

import torch

from conftest import assert_no_block_held, checked, hf_greedy
from labs.labs import plural
from kernel import paged_attention_ref
from model import load_hf
from nanopaged import LLM, SamplingParams


def test_the_slot_mapping_of_a_known_block_table():
    """A 10-token prompt in blocks [5, 2, 7] (block_size 4) writes slots 20-23, 8-11, 28, 29;
    its first decode, position 10, slot 7 * 4 + 2 = 30."""
    llm = LLM("random:tiny", block_size=4, num_blocks=8, async_copies=False)
    bm = llm.block_manager
    bm.device.empty_block_ids = deque([5, 2, 7, 0, 1, 3, 4, 6])
    llm.add_requests([list(range(1, 11))], SamplingParams(max_tokens=2))
    batch = llm.scheduler.schedule()
    seq = batch.entries[0].seq
    assert seq.block_table == [5, 2, 7]
    model_batch, _ = llm._prepare(batch)
    want = [20, 21, 22, 23, 8, 9, 10, 11, 28, 29]
    got = model_batch.slot_mapping.tolist()
    for p, (g, w) in enumerate(zip(got, want)):
        assert g == w, (f"position {p}: logical block {p // 4}, physical block "
                        f"{seq.block_table[p // 4]}, offset {p % 4}: slot {w}, got {g}")
    assert len(got) == len(want), f"{plural(len(got), 'slot')} for {len(want)} new tokens"
    llm.scheduler.postprocess(batch, {seq: [1]})
    batch = llm.scheduler.schedule()
    model_batch, _ = llm._prepare(batch)
    assert model_batch.slot_mapping.tolist() == [30], (
        f"decode at position 10 (block 7, offset 2): slot 30, got {model_batch.slot_mapping}")
    llm.scheduler.postprocess(batch, {seq: [1]})
    assert_no_block_held(llm)


def dense_attention(q, k, v, scale):
    """q: (q_len, heads, dim), the last q_len of the ctx positions of k, v: (ctx, kv_heads, dim);
    causal, each query head reading K/V head head // group. Plain loops: the simple thing."""
    q_len, heads, _ = q.shape
    ctx, kv_heads, _ = k.shape
    out = torch.empty_like(q)
    for j in range(q_len):
        pos = ctx - q_len + j
        for h in range(heads):
            kv = h // (heads // kv_heads)
            weights = torch.softmax(k[:pos + 1, kv] @ q[j, h] * scale, 0)
            out[j, h] = weights @ v[:pos + 1, kv]
    return out


def test_reference_attention_reads_every_context_through_its_block_table():
    """Two decodes and a 3-token prefill chunk, their blocks scattered in the pool: the reference
    equals dense attention over each context gathered position by position."""
    torch.manual_seed(0)
    block_size, kv_heads, group, dim = 4, 2, 2, 8
    k_cache = torch.randn(16, block_size, kv_heads, dim)
    v_cache = torch.randn(16, block_size, kv_heads, dim)
    tables = [[9, 3], [14, 0, 7, 11], [5, 12, 2]]
    context_lens = [7, 13, 10]
    q_lens = [1, 1, 3]
    q = torch.randn(sum(q_lens), kv_heads * group, dim)
    width = max(map(len, tables))
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    query_start_loc = torch.tensor([0, 1, 2, 5], dtype=torch.int32)
    scale = dim ** -0.5
    out = paged_attention_ref(q, k_cache, v_cache, block_tables,
                              torch.tensor(context_lens, dtype=torch.int32), query_start_loc,
                              scale)
    for i, (table, ctx) in enumerate(zip(tables, context_lens)):
        # position p of sequence i: physical block table[p // block_size], offset p % block_size
        k = torch.stack([k_cache[table[p // block_size], p % block_size] for p in range(ctx)])
        v = torch.stack([v_cache[table[p // block_size], p % block_size] for p in range(ctx)])
        rows = slice(int(query_start_loc[i]), int(query_start_loc[i + 1]))
        want = dense_attention(q[rows], k, v, scale)
        error = (out[rows] - want).abs().max().item()
        assert error < 1e-5, (f"sequence {i} (block table {table}, {ctx} tokens): the reference "
                              f"differs from dense attention by {error:.3g}")


def test_paged_greedy_tokens_equal_the_dense_models():
    """Two prompts decoded together in 4-token blocks, their tables interleaved: random:tiny's
    greedy tokens equal transformers' own greedy generate, one prompt at a time."""
    prompts = [list(range(1, 11)), list(range(40, 47))]
    hf, _ = load_hf("random:tiny", 0)
    want = [hf_greedy(hf, p, 8) for p in prompts]
    llm = checked(LLM("random:tiny", block_size=4, num_blocks=16))
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8))
    for i, (out, w) in enumerate(zip(outs, want)):
        got = out.outputs[0].token_ids
        assert got == w, (f"prompt {i}: the paged engine's greedy tokens {got}, the dense "
                          f"model's {w}")
    assert_no_block_held(llm)


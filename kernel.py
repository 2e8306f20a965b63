"""
kernel.py: paged attention, the one operation that reads the KV cache through block tables.

What it teaches: attention does not need a sequence's keys and values to be contiguous. A block
table maps each sequence's logical blocks to physical blocks of one shared pool, and attention
walks that table. One function serves prefill chunks and decodes in the same batch:

    out = paged_attention(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale)

Sequence i's q_len new tokens q[qsl[i]:qsl[i+1]] are the last q_len of its context_lens[i]
tokens and attend causally to everything before them (q_len = 1 for a decode, a chunk for a
prefill), with grouped-query attention (num_heads a multiple of num_kv_heads).

Read it in order: the K/V write, the PyTorch reference (the oracle every faster version is held
to), then dispatch. `python kernel.py` checks the reference against plain attention on contiguous
tensors.
"""
import os

import torch

# ----------------------------------------------------------------------------------------------
# Writing new K/V into their slots


def store_kvcache(k, v, k_cache, v_cache, slot_mapping):
    """k, v: (num_tokens, kv_heads, head_dim); caches: (num_blocks, block_size, kv_heads, head_dim);
    slot_mapping: (num_tokens,) int64, slot = block_id * block_size + offset. One indexed copy each."""
    num_kv_heads, head_dim = k_cache.shape[-2:]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)


# ----------------------------------------------------------------------------------------------
# The reference: gather each sequence's context through its block table, then plain attention


def paged_attention_ref(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale):
    """q: (num_tokens, num_heads, head_dim); k_cache, v_cache: (num_blocks, block_size, kv_heads, head_dim);
    block_tables: (num_seqs, max_blocks_per_seq) int32; context_lens: (num_seqs,) int32;
    query_start_loc: (num_seqs + 1,) int32. Returns (num_tokens, num_heads, head_dim)."""
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    block_size = k_cache.shape[1]
    group = num_heads // num_kv_heads  # query heads that share one K/V head
    out = torch.empty_like(q)
    for i, (start, end, ctx) in enumerate(zip(query_start_loc[:-1].tolist(), query_start_loc[1:].tolist(),
                                              context_lens.tolist())):
        q_len = end - start
        blocks = block_tables[i, :(ctx + block_size - 1) // block_size].long()
        # the gather is where paging shows: logical block j of this sequence lives at physical blocks[j]
        k = k_cache[blocks].flatten(0, 1)[:ctx]                          # (ctx, kv_heads, head_dim)
        v = v_cache[blocks].flatten(0, 1)[:ctx]
        k = k.repeat_interleave(group, dim=1).transpose(0, 1).float()    # (heads, ctx, head_dim)
        v = v.repeat_interleave(group, dim=1).transpose(0, 1).float()
        qi = q[start:end].transpose(0, 1).float()                        # (heads, q_len, head_dim)
        scores = qi @ k.transpose(1, 2) * scale                          # (heads, q_len, ctx)
        # causal: new token j sits at position ctx - q_len + j and sees keys 0 .. that position
        q_pos = torch.arange(ctx - q_len, ctx, device=q.device)[:, None]
        scores.masked_fill_(torch.arange(ctx, device=q.device)[None, :] > q_pos, float("-inf"))
        out[start:end] = (scores.softmax(dim=-1) @ v).transpose(0, 1).to(q.dtype)
    return out


# ----------------------------------------------------------------------------------------------
# Dispatch: CPU tensors take the reference. NANOPAGED_ATTENTION=torch|triton forces one.


def paged_attention(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale):
    backend = os.environ.get("NANOPAGED_ATTENTION", "torch")
    if backend != "torch":
        raise ValueError(f"NANOPAGED_ATTENTION={backend!r}: this build has the 'torch' reference only")
    return paged_attention_ref(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale)


# ----------------------------------------------------------------------------------------------
# Check: the reference against plain attention on the same K/V laid out contiguously


def check(seed=0):
    """Random pool, shuffled block tables, mixed decodes and prefill chunks; returns the worst error."""
    g = torch.Generator().manual_seed(seed)
    num_blocks, block_size, num_kv_heads, group, head_dim = 64, 4, 2, 3, 16
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g)
    ctx_q = [(13, 1), (7, 7), (20, 5), (1, 1)]  # (context_len, new tokens): decode, prefill, chunk on cache, tiny
    perm = torch.randperm(num_blocks, generator=g)
    block_tables = torch.zeros(len(ctx_q), 8, dtype=torch.int32)
    for i in range(len(ctx_q)):
        block_tables[i] = perm[i * 8:(i + 1) * 8]
    qsl = torch.tensor([0] + [sum(n for _, n in ctx_q[:i + 1]) for i in range(len(ctx_q))], dtype=torch.int32)
    q = torch.randn(int(qsl[-1]), num_kv_heads * group, head_dim, generator=g)
    ctx = torch.tensor([c for c, _ in ctx_q], dtype=torch.int32)
    out = paged_attention_ref(q, k_cache, v_cache, block_tables, ctx, qsl, head_dim ** -0.5)
    worst = 0.0
    for i, (c, n) in enumerate(ctx_q):
        k = k_cache[block_tables[i].long()].flatten(0, 1)[:c].repeat_interleave(group, 1).transpose(0, 1)
        v = v_cache[block_tables[i].long()].flatten(0, 1)[:c].repeat_interleave(group, 1).transpose(0, 1)
        mask = torch.ones(n, c, dtype=torch.bool).tril(diagonal=c - n)
        want = torch.nn.functional.scaled_dot_product_attention(q[qsl[i]:qsl[i + 1]].transpose(0, 1), k, v,
                                                                attn_mask=mask).transpose(0, 1)
        worst = max(worst, (out[qsl[i]:qsl[i + 1]] - want).abs().max().item())
    return worst


if __name__ == "__main__":
    err = check()
    print(f"reference vs contiguous scaled_dot_product_attention: max abs error {err:.2e}")
    assert err < 1e-5

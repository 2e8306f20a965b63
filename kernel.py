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
# Check: paged attention against plain attention on the same K/V laid out contiguously


def random_case(seed=0, block_size=4, num_kv_heads=2, group=3, head_dim=16, ctx_q=((13, 1), (7, 7), (20, 5), (1, 1)),
                dtype=torch.float32, device="cpu"):
    """A random pool and a batch mixing decodes and prefill chunks. ctx_q: (context_len, new tokens) per
    sequence. Each sequence gets distinct blocks in shuffled order, so a wrong table lookup shows."""
    g = torch.Generator().manual_seed(seed)
    max_blocks = max((c + block_size - 1) // block_size for c, _ in ctx_q)
    num_blocks = len(ctx_q) * max_blocks + 3
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g)  # (num_blocks, block_size, kv_heads, head_dim)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g)
    perm = torch.randperm(num_blocks, generator=g)
    block_tables = perm[:len(ctx_q) * max_blocks].view(len(ctx_q), max_blocks).int()  # (num_seqs, max_blocks)
    qsl = torch.tensor([0] + [n for _, n in ctx_q], dtype=torch.int32).cumsum(0).int()   # (num_seqs + 1,)
    q = torch.randn(int(qsl[-1]), num_kv_heads * group, head_dim, generator=g)       # (num_tokens, heads, head_dim)
    context_lens = torch.tensor([c for c, _ in ctx_q], dtype=torch.int32)            # (num_seqs,)
    to = lambda x: x.to(device=device, dtype=dtype)
    return (to(q), to(k_cache), to(v_cache), block_tables.to(device), context_lens.to(device), qsl.to(device),
            head_dim ** -0.5)


def contiguous_attention(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale):
    """The same contract done the obvious way: copy each context out contiguously, then PyTorch's
    scaled_dot_product_attention with an explicit causal mask."""
    group = q.shape[1] // k_cache.shape[2]
    out = torch.empty_like(q)
    for i in range(len(context_lens)):
        c, s, e = int(context_lens[i]), int(query_start_loc[i]), int(query_start_loc[i + 1])
        k = torch.cat([k_cache[b] for b in block_tables[i].tolist()])[:c]   # (ctx, kv_heads, head_dim)
        v = torch.cat([v_cache[b] for b in block_tables[i].tolist()])[:c]
        mask = torch.ones(e - s, c, dtype=torch.bool, device=q.device).tril(diagonal=c - (e - s))
        out[s:e] = torch.nn.functional.scaled_dot_product_attention(
            q[s:e].transpose(0, 1), k.repeat_interleave(group, 1).transpose(0, 1),
            v.repeat_interleave(group, 1).transpose(0, 1), attn_mask=mask, scale=scale).transpose(0, 1)
    return out


if __name__ == "__main__":
    worst = 0.0
    for seed, (block_size, group, head_dim) in enumerate([(4, 3, 16), (8, 1, 64), (16, 4, 128), (1, 2, 32)]):
        case = random_case(seed, block_size=block_size, group=group, head_dim=head_dim)
        err = (paged_attention_ref(*case) - contiguous_attention(*case)).abs().max().item()
        print(f"block_size {block_size:2}  heads per kv head {group}  head_dim {head_dim:3}  max abs error {err:.2e}")
        worst = max(worst, err)
    assert worst < 1e-5, f"reference disagrees with contiguous attention: {worst:.2e}"
    print("reference matches contiguous scaled_dot_product_attention")

"""
kernel.py: paged attention, the one operation that reads the KV cache through block tables.

What it teaches: attention does not need a sequence's keys and values to be contiguous. A block
table maps each sequence's logical blocks to physical blocks of one shared pool, and attention
walks that table. One function serves prefill chunks and decodes in the same batch:

    out = paged_attention(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale)

Sequence i's q_len new tokens q[qsl[i]:qsl[i+1]] are the last q_len of its context_lens[i]
tokens and attend causally to everything before them (q_len = 1 for a decode, a chunk for a
prefill), with grouped-query attention (num_heads a multiple of num_kv_heads).

Read it in order, as a Triton tutorial: the K/V write; the PyTorch reference (the oracle every
faster version is held to); the Triton kernel, with a comment on every argument; its launcher
(and the flash-decoding switch, num_kv_splits); dispatch; the check; the benchmark.

    python kernel.py     checks the kernel against the reference over many shapes (on a CPU through
                         Triton's interpreter, in float32; on CUDA compiled, in bfloat16), and on
                         CUDA times decode against the bytes it must read and against contiguous
                         scaled_dot_product_attention
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
# The Triton kernel: one program per (sequence, KV head, tile of new tokens[, slice of context])
#
# Rows of a program are (new token, query head) pairs: the GROUP query heads that share one KV head
# are handled together, so every K/V tile is loaded once for the whole group (grouped-query
# attention saves bandwidth only if the kernel exploits it). The context is walked in tiles of
# BLOCK_N tokens; each token's physical slot comes from the block table, so any power-of-two
# block_size works. Softmax is online (running max m, running sum l), so no score matrix is stored.

if __name__ == "__main__" and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")   # `python kernel.py` on a CPU: Triton's interpreter

try:
    import triton
    import triton.language as tl
    jit = triton.jit
except ImportError:   # no Triton on this platform: the PyTorch reference serves every call
    triton, tl, jit = None, type("tl", (), {"constexpr": None}), (lambda fn: fn)


@jit
def paged_attention_kernel(
    out_ptr,            # (num_tokens, num_heads, head_dim) output, or (splits, num_tokens, num_heads, head_dim) float32 partials
    lse_ptr,            # (splits, num_tokens, num_heads) float32: log-sum-exp of each partial (split path only)
    q_ptr,              # (num_tokens, num_heads, head_dim) new tokens' queries, sequences back to back
    k_cache_ptr,        # (num_blocks, block_size, num_kv_heads, head_dim) this layer's K pool
    v_cache_ptr,        # (num_blocks, block_size, num_kv_heads, head_dim) this layer's V pool
    block_tables_ptr,   # (num_seqs, max_blocks_per_seq) int32 physical block ids
    context_lens_ptr,   # (num_seqs,) int32 tokens in each context, new ones included
    query_start_loc_ptr,  # (num_seqs + 1,) int32 sequence i's new tokens are rows [qsl[i], qsl[i+1]) of q
    scale,              # 1 / sqrt(head_dim)
    stride_qt, stride_qh,            # q strides per token and per head (head_dim is contiguous)
    stride_kb, stride_kt, stride_kh,  # cache strides per block, per slot, per KV head (same for V)
    stride_bt,                       # block table stride per sequence
    stride_ot, stride_oh, stride_os,  # output strides per token, per head, per split
    stride_lt, stride_ls,            # lse strides per token, per split (head is contiguous)
    NUM_SPLITS: tl.constexpr,        # 1: the whole context in one program; >1: flash-decoding
    GROUP: tl.constexpr,             # query heads per KV head
    GROUP_P: tl.constexpr,           # GROUP rounded up to a power of two
    BLOCK_M: tl.constexpr,           # new tokens per program (rows = BLOCK_M * GROUP_P)
    BLOCK_N: tl.constexpr,           # context tokens per tile
    BLOCK_SIZE: tl.constexpr,        # tokens per KV cache block
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,           # HEAD_DIM rounded up to a power of two
):
    seq, kv_head, tile_split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    tile, split = tile_split // NUM_SPLITS, tile_split % NUM_SPLITS
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    ctx = tl.load(context_lens_ptr + seq)
    if tile * BLOCK_M >= q_len:
        return   # this sequence has fewer new tokens than the grid allows for
    # 1. the rows: token t of this tile, query head h of this KV head's group
    rows = tl.arange(0, BLOCK_M * GROUP_P)
    t, h = tile * BLOCK_M + rows // GROUP_P, rows % GROUP_P
    row_ok = (t < q_len) & (h < GROUP)
    q_pos = ctx - q_len + t                  # each new token's position in its sequence
    d = tl.arange(0, BLOCK_D)
    q_offs = (q_start + t)[:, None] * stride_qt + (kv_head * GROUP + h)[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptr + q_offs, mask=row_ok[:, None] & (d[None, :] < HEAD_DIM), other=0.0)
    # 2. the context this program reads: causal, so nothing past this tile's last token; split evenly
    kv_end = tl.minimum(ctx, ctx - q_len + (tile + 1) * BLOCK_M)
    per_split = tl.cdiv(tl.cdiv(kv_end, BLOCK_N), NUM_SPLITS) * BLOCK_N
    kv_lo, kv_hi = split * per_split, tl.minimum(kv_end, (split + 1) * per_split)
    m = tl.full([BLOCK_M * GROUP_P], float("-inf"), tl.float32)   # running max of the scores
    l = tl.zeros([BLOCK_M * GROUP_P], tl.float32)                 # running sum of exp(score - m)
    acc = tl.zeros([BLOCK_M * GROUP_P, BLOCK_D], tl.float32)      # running sum of p * V
    for n in range(kv_lo, kv_hi, BLOCK_N):
        # 3. the block-table walk: token pos lives in block block_table[pos // BLOCK_SIZE] at slot pos % BLOCK_SIZE
        pos = n + tl.arange(0, BLOCK_N)
        pos_ok = pos < kv_hi
        block = tl.load(block_tables_ptr + seq * stride_bt + pos // BLOCK_SIZE, mask=pos_ok, other=0)
        kv_offs = block[:, None] * stride_kb + (pos % BLOCK_SIZE)[:, None] * stride_kt + kv_head * stride_kh + d[None, :]
        kv_mask = pos_ok[:, None] & (d[None, :] < HEAD_DIM)
        k = tl.load(k_cache_ptr + kv_offs, mask=kv_mask, other=0.0)   # (BLOCK_N, BLOCK_D), once for the group
        v = tl.load(v_cache_ptr + kv_offs, mask=kv_mask, other=0.0)
        # 4. scores, causal mask, online softmax
        s = tl.dot(q, tl.trans(k)) * scale                           # (rows, BLOCK_N) float32
        s = tl.where(pos_ok[None, :] & (pos[None, :] <= q_pos[:, None]), s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)       # a row with no key yet: keep zeros
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m - m_safe)
        l = l * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new
    # 5. normalise; the split path also writes the log-sum-exp so that partials can be merged
    l_safe = tl.where(l == 0.0, 1.0, l)
    out = acc / l_safe[:, None]
    out_offs = (q_start + t)[:, None] * stride_ot + (kv_head * GROUP + h)[:, None] * stride_oh + d[None, :]
    out_mask = row_ok[:, None] & (d[None, :] < HEAD_DIM)
    if NUM_SPLITS == 1:
        tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        tl.store(out_ptr + split * stride_os + out_offs, out, mask=out_mask)
        lse = tl.where(l == 0.0, float("-inf"), m + tl.log(l_safe))
        tl.store(lse_ptr + split * stride_ls + (q_start + t) * stride_lt + kv_head * GROUP + h, lse, mask=row_ok)


def next_pow2(n):
    return 1 << (int(n) - 1).bit_length()


def paged_attention_triton(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale,
                           max_query_len=None, num_kv_splits=1, out=None):
    """Launch the kernel. max_query_len: the most new tokens of one sequence (pass it to avoid a
    device-to-host read). num_kv_splits > 1 turns on flash-decoding: each (sequence, KV head) reads
    its context in that many slices at once, and the partial results are merged by log-sum-exp;
    it pays off when few sequences with long contexts leave most of the GPU idle. out: where to
    write (tests pass one filled with NaN, so that a value the kernel forgot shows)."""
    num_tokens, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = block_tables.shape[0]
    group = num_heads // num_kv_heads
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    # tl.dot wants at least 16 rows: decodes (1 token) fill them with the group's heads
    group_p = next_pow2(group)
    block_m = max(1, (16 if max_query_len == 1 else 64) // group_p)
    grid = (num_seqs, num_kv_heads, triton.cdiv(max_query_len, block_m) * num_kv_splits)
    out = torch.empty_like(q) if out is None else out
    if num_kv_splits == 1:
        partial, lse = out, out.new_empty(1, 1, 1, dtype=torch.float32)   # lse unused
    else:
        partial = torch.empty(num_kv_splits, num_tokens, num_heads, head_dim, dtype=torch.float32, device=q.device)
        lse = torch.empty(num_kv_splits, num_tokens, num_heads, dtype=torch.float32, device=q.device)
    paged_attention_kernel[grid](
        partial, lse, q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        partial.stride(-3), partial.stride(-2), partial.stride(0) if num_kv_splits > 1 else 0, lse.stride(1), lse.stride(0),
        NUM_SPLITS=num_kv_splits, GROUP=group, GROUP_P=group_p, BLOCK_M=block_m, BLOCK_N=64 if head_dim <= 64 else 32,
        BLOCK_SIZE=block_size, HEAD_DIM=head_dim, BLOCK_D=next_pow2(head_dim))
    if num_kv_splits > 1:   # merge: weight each slice's normalised output by its share of the total exp-sum
        w = torch.softmax(lse, dim=0).nan_to_num(0.0)                 # (splits, num_tokens, num_heads)
        out.copy_((w[..., None] * partial).sum(0))
    return out


# ----------------------------------------------------------------------------------------------
# Dispatch: CUDA tensors take the Triton kernel, CPU tensors the reference; NANOPAGED_ATTENTION=torch
# or =triton forces one (=triton on CPU tensors needs TRITON_INTERPRET=1: Triton's interpreter)


def num_kv_splits_for(num_seqs, num_kv_heads, max_context_len, num_sms):
    """The flash-decoding switch's heuristic: split a context only when (sequence, KV head) programs
    are too few to fill the GPU's num_sms and contexts are long (at least ~1k tokens per slice)."""
    programs = num_seqs * num_kv_heads
    if programs >= num_sms or max_context_len < 2048:
        return 1
    return max(1, min(16, max_context_len // 1024, (2 * num_sms) // programs))


def paged_attention(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale,
                    max_query_len=None, num_kv_splits=1):
    backend = os.environ.get("NANOPAGED_ATTENTION") or ("triton" if q.is_cuda else "torch")
    if backend == "torch":
        return paged_attention_ref(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale)
    if backend != "triton":
        raise ValueError(f"NANOPAGED_ATTENTION must be 'triton' or 'torch', got {backend!r}")
    if triton is None:
        raise RuntimeError("NANOPAGED_ATTENTION=triton, but Triton is not installed")
    return paged_attention_triton(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale,
                                  max_query_len, num_kv_splits)


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


# ----------------------------------------------------------------------------------------------
# Benchmark (CUDA): decode against the bytes it must read, and against contiguous attention


def bench_decode(batches=(1, 8, 64, 256), contexts=(512, 1024, 2048, 4096, 8192, 16384)):
    """Decode, 32 query heads on 8 KV heads, head_dim 128, block_size 16, bfloat16. A decode must read
    every K and V of its context once: bytes / time is the kernel's bandwidth, held against a plain
    device copy measured in the same run, and its time against scaled_dot_product_attention on the
    same K/V laid out contiguously (no paging)."""
    from triton.testing import do_bench
    num_heads, num_kv_heads, head_dim, block_size, dtype = 32, 8, 128, 16, torch.bfloat16
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    copy_gbps = 2 * x.numel() / do_bench(lambda: y.copy_(x)) / 1e6   # read + write, per millisecond -> GB/s
    del x, y
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for batch in batches:
        for ctx in contexts:
            blocks_per_seq = ctx // block_size
            k_cache = torch.randn(batch * blocks_per_seq, block_size, num_kv_heads, head_dim, dtype=dtype, device="cuda")
            v_cache = torch.randn_like(k_cache)
            block_tables = torch.randperm(batch * blocks_per_seq, device="cuda").view(batch, blocks_per_seq).int()
            q = torch.randn(batch, num_heads, head_dim, dtype=dtype, device="cuda")    # one new token each
            context_lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
            qsl = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
            splits = num_kv_splits_for(batch, num_kv_heads, ctx, num_sms)
            ms = do_bench(lambda: paged_attention_triton(q, k_cache, v_cache, block_tables, context_lens, qsl,
                                                         head_dim ** -0.5, max_query_len=1, num_kv_splits=splits))
            nbytes = 2 * batch * ctx * num_kv_heads * head_dim * dtype.itemsize + 2 * q.numel() * dtype.itemsize
            # the same K/V, contiguous per sequence: (batch, kv_heads, ctx, head_dim)
            k = k_cache[block_tables.long()].flatten(1, 2).transpose(1, 2).contiguous()
            v = v_cache[block_tables.long()].flatten(1, 2).transpose(1, 2).contiguous()
            sdpa_ms = do_bench(lambda: torch.nn.functional.scaled_dot_product_attention(
                q[:, :, None], k, v, scale=head_dim ** -0.5, enable_gqa=True))
            rows.append((batch, ctx, splits, ms, nbytes, nbytes / ms / 1e6, sdpa_ms))
            del k_cache, v_cache, k, v
    print(f"device copy bandwidth (measured): {copy_gbps:.0f} GB/s")
    print(f"{'batch':>5} {'context':>7} {'splits':>6} {'ms':>8} {'MB read':>8} {'GB/s':>7} {'of copy':>7} {'sdpa ms':>8} {'/ sdpa':>6}")
    for batch, ctx, splits, ms, nbytes, gbps, sdpa_ms in rows:
        print(f"{batch:5} {ctx:7} {splits:6} {ms:8.3f} {nbytes / 1e6:8.1f} {gbps:7.0f} {gbps / copy_gbps:7.0%} {sdpa_ms:8.3f} {ms / sdpa_ms:6.2f}")
    return rows, copy_gbps


if __name__ == "__main__":
    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    print(f"paged attention on {device} in {dtype} ({'compiled' if cuda else 'Triton interpreter'}) against the "
          f"PyTorch reference; relative error must stay under {tol}")
    print(f"{'block':>5} {'group':>5} {'head_dim':>8} {'splits':>6} {'ref vs sdpa':>11} {'triton vs ref':>13}")
    worst = 0.0
    for seed, (block_size, group, head_dim, splits) in enumerate(
            [(bs, g, hd, sp) for bs in (4, 8, 16) for g in (1, 3, 4) for hd in (64, 128) for sp in (1, 3)]):
        ctx_q = ((1, 1), (37, 1), (9, 9), (50, 13), (16 * block_size + 3, 7))
        case = random_case(seed, block_size, 2, group, head_dim, ctx_q, dtype=dtype, device=device)
        ref = paged_attention_ref(*case).float()
        base = contiguous_attention(*[c.float() if torch.is_tensor(c) and c.is_floating_point() else c for c in case])
        out = paged_attention_triton(*case, max_query_len=13, num_kv_splits=splits,
                                     out=torch.full_like(case[0], float("nan"))).float()
        err_ref = ((ref - base).abs().max() / base.abs().max()).item()
        err = ((out - ref).abs().max() / ref.abs().max()).item()
        worst = max(worst, err if err == err else float("inf"))   # NaN (an unwritten output) fails too
        print(f"{block_size:5} {group:5} {head_dim:8} {splits:6} {err_ref:11.1e} {err:13.1e}")
    assert worst < tol, f"the Triton kernel disagrees with the reference: {worst:.2e}"
    print(f"all match (worst relative error {worst:.1e})")
    if cuda:
        rows, copy_gbps = bench_decode()
        b64 = [r for r in rows if r[0] == 64 and r[1] == 4096][0]
        print(f"batch 64, context 4096: {b64[5] / copy_gbps:.0%} of copy bandwidth (target 70%), "
              f"{b64[3] / b64[6]:.2f} x sdpa time (target at most 1.3)")

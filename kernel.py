"""
kernel.py: paged attention, the one operation that reads the KV cache through block tables.

What it teaches: attention does not need a sequence's keys and values to be contiguous. A block
table maps each sequence's logical blocks to physical blocks of one shared pool, and attention
walks that table. One function serves prefill chunks and decodes in the same batch:

    out = paged_attention(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale)

Sequence i's q_len new tokens, q[qsl[i]:qsl[i+1]] with qsl = query_start_loc, are the last q_len of its
context_lens[i] tokens and attend causally to everything before them (q_len = 1 for a decode, a chunk for
a prefill), with grouped-query attention (num_heads a multiple of num_kv_heads).

Read it in order, as a Triton tutorial: the K/V write; the PyTorch reference (the oracle every
faster version is held to); the Triton kernel, with a comment on every argument; its launcher (and
the flash-decoding switch, num_kv_splits); dispatch; the check; the benchmark.

    python kernel.py    checks the kernel against the reference over 36 shapes (CPU: interpreted, float32;
                        CUDA: compiled, bfloat16); on CUDA it times decode against copy bandwidth and contiguous SDPA
"""
import os

import torch
import torch.nn.functional as F

# ----------------------------------------------------------------------------------------------
# Writing new K/V into their slots

def store_kvcache(k, v, k_cache, v_cache, slot_mapping):
    """k, v: (num_tokens, kv_heads, head_dim); caches: (num_blocks, block_size, kv_heads, head_dim);
    slot_mapping: (num_tokens,) int64, slot = block_id * block_size + offset. One indexed copy each."""
    k_cache.view(-1, *k_cache.shape[-2:]).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, *v_cache.shape[-2:]).index_copy_(0, slot_mapping, v)

# ----------------------------------------------------------------------------------------------
# The reference: gather each sequence's context through its block table, then plain attention

def paged_attention_ref(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale):
    """q and the result: (num_tokens, num_heads, head_dim); caches: (num_blocks, block_size, kv_heads, head_dim);
    block_tables: (num_seqs, max_blocks_per_seq), context_lens: (num_seqs,), query_start_loc: (num_seqs + 1,)."""
    block_size, group = k_cache.shape[1], q.shape[1] // k_cache.shape[2]   # group: query heads per K/V head
    out, qsl = torch.empty_like(q), query_start_loc.tolist()
    for i, (start, end, ctx) in enumerate(zip(qsl[:-1], qsl[1:], context_lens.tolist())):
        q_len, blocks = end - start, block_tables[i, :(ctx + block_size - 1) // block_size].long()
        # the gather is where paging shows: logical block j of this sequence lives at physical blocks[j]
        k, v = (c[blocks].flatten(0, 1)[:ctx] for c in (k_cache, v_cache))              # (ctx, kv_heads, head_dim)
        k, v = (x.repeat_interleave(group, 1).transpose(0, 1).float() for x in (k, v))  # (heads, ctx, head_dim)
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
    out_ptr,      # (num_tokens, num_heads, head_dim) output, or float32 partials with a splits dim in front
    lse_ptr,      # (splits, num_tokens, num_heads) float32: log-sum-exp of each partial (split path only)
    q_ptr,        # (num_tokens, num_heads, head_dim) new tokens' queries, sequences back to back
    k_cache_ptr, v_cache_ptr,  # (num_blocks, block_size, num_kv_heads, head_dim) this layer's K and V pools
    block_tables_ptr,     # (num_seqs, max_blocks_per_seq) int32 physical block ids
    context_lens_ptr,     # (num_seqs,) int32 tokens in each context, new ones included
    query_start_loc_ptr,  # (num_seqs + 1,) int32 sequence i's new tokens are rows [qsl[i], qsl[i+1]) of q
    scale,                # 1 / sqrt(head_dim)
    stride_qt, stride_qh, stride_bt,  # q strides per token, per head (head_dim is contiguous); block table's per seq
    stride_kb, stride_kt, stride_kh,  # cache strides per block, per slot, per KV head (same for V)
    stride_ot, stride_oh, stride_os, stride_lt, stride_ls,  # output per token, head, split; lse per token, split
    NUM_SPLITS: tl.constexpr,         # 1: the whole context in one program; >1: flash-decoding
    GROUP: tl.constexpr, GROUP_P: tl.constexpr,        # query heads per KV head, rounded up to a power of 2
    BLOCK_M: tl.constexpr,            # new tokens per program (rows = BLOCK_M * GROUP_P)
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,   # context tokens per tile; tokens per KV cache block
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,     # head_dim, rounded up to a power of 2
):
    seq, kv_head, tile_split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    tile, split = tile_split // NUM_SPLITS, tile_split % NUM_SPLITS
    q_start, ctx = tl.load(query_start_loc_ptr + seq), tl.load(context_lens_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if tile * BLOCK_M >= q_len:
        return   # this sequence has fewer new tokens than the grid allows for
    # 1. the rows: token t of this tile, query head h of this KV head's group
    rows, d = tl.arange(0, BLOCK_M * GROUP_P), tl.arange(0, BLOCK_D)
    t, h = tile * BLOCK_M + rows // GROUP_P, rows % GROUP_P
    row_ok = (t < q_len) & (h < GROUP)
    q_pos = ctx - q_len + t                  # each new token's position in its sequence
    q_offs = (q_start + t)[:, None] * stride_qt + (kv_head * GROUP + h)[:, None] * stride_qh + d[None, :]
    row_mask = row_ok[:, None] & (d[None, :] < HEAD_DIM)
    q = tl.load(q_ptr + q_offs, mask=row_mask, other=0.0)
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
        p, alpha = tl.exp(s - m_safe[:, None]), tl.exp(m - m_safe)
        l, m = l * alpha + tl.sum(p, 1), m_new
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    # 5. normalise; the split path also writes the log-sum-exp so that partials can be merged
    l_safe = tl.where(l == 0.0, 1.0, l)
    out = acc / l_safe[:, None]
    out_offs = (q_start + t)[:, None] * stride_ot + (kv_head * GROUP + h)[:, None] * stride_oh + d[None, :]
    if NUM_SPLITS == 1:
        tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=row_mask)
    else:
        tl.store(out_ptr + split * stride_os + out_offs, out, mask=row_mask)
        lse = tl.where(l == 0.0, float("-inf"), m + tl.log(l_safe))
        tl.store(lse_ptr + split * stride_ls + (q_start + t) * stride_lt + kv_head * GROUP + h, lse, mask=row_ok)

def next_pow2(n):
    return 1 << (int(n) - 1).bit_length()

def paged_attention_triton(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale,
                           max_query_len=None, num_kv_splits=1, out=None):
    """Launch the kernel. max_query_len: the most new tokens of one sequence (pass it to avoid a device-to-host
    read). num_kv_splits > 1 turns on flash-decoding: each (sequence, KV head) reads its context in that many
    slices at once, merged by log-sum-exp (see num_kv_splits_for). out: where to write (NaNs in tests: gaps show)."""
    (num_tokens, num_heads, head_dim), (block_size, num_kv_heads) = q.shape, k_cache.shape[1:3]
    max_query_len = int(query_start_loc.diff().max()) if max_query_len is None else max_query_len
    # tl.dot wants at least 16 rows: decodes (1 token) fill them with the group's heads
    group, group_p = num_heads // num_kv_heads, next_pow2(num_heads // num_kv_heads)
    block_m = max(1, (16 if max_query_len == 1 else 64) // group_p)
    grid = (block_tables.shape[0], num_kv_heads, triton.cdiv(max_query_len, block_m) * num_kv_splits)
    out = torch.empty_like(q) if out is None else out
    partial, lse = out, out.new_empty(1, 1, 1, dtype=torch.float32)   # one split: straight into out, no lse
    if num_kv_splits > 1:
        partial = q.new_empty(num_kv_splits, *q.shape, dtype=torch.float32)   # (splits, num_tokens, heads, head_dim)
        lse = q.new_empty(num_kv_splits, num_tokens, num_heads, dtype=torch.float32)   # (splits, num_tokens, heads)
    paged_attention_kernel[grid](
        partial, lse, q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale,
        *q.stride()[:2], block_tables.stride(0), *k_cache.stride()[:3],
        *partial.stride()[-3:-1], partial.stride(0) if num_kv_splits > 1 else 0, lse.stride(1), lse.stride(0),
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
    few_and_long = programs < num_sms and max_context_len >= 2048
    return min(16, max_context_len // 1024, (2 * num_sms) // programs) if few_and_long else 1

def paged_attention(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale,
                    max_query_len=None, num_kv_splits=1):
    args = (q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale)
    backend = os.environ.get("NANOPAGED_ATTENTION") or ("triton" if q.is_cuda else "torch")
    if backend == "torch":
        return paged_attention_ref(*args)
    if backend != "triton":
        raise ValueError(f"NANOPAGED_ATTENTION must be 'triton' or 'torch', got {backend!r}")
    if triton is None:
        raise RuntimeError("NANOPAGED_ATTENTION=triton, but Triton is not installed")
    return paged_attention_triton(*args, max_query_len, num_kv_splits)

# ----------------------------------------------------------------------------------------------
# Check: a random pool and batch, the kernel against the reference

def random_case(seed=0, block_size=4, num_kv_heads=2, group=3, head_dim=16, ctx_q=((13, 1), (7, 7), (20, 5), (1, 1)),
                dtype=torch.float32, device="cpu"):
    """A random pool and a batch mixing decodes and prefill chunks. ctx_q: (context_len, new tokens) per
    sequence. Each sequence gets distinct blocks in shuffled order, so a wrong table lookup shows."""
    g = torch.Generator().manual_seed(seed)
    num_seqs, max_blocks = len(ctx_q), max((c + block_size - 1) // block_size for c, _ in ctx_q)
    shape = (num_seqs * max_blocks + 3, block_size, num_kv_heads, head_dim)   # 3 blocks more than the tables use
    k_cache, v_cache = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    block_tables = torch.randperm(shape[0], generator=g)[:num_seqs * max_blocks].view(num_seqs, max_blocks).int()
    qsl = torch.tensor([0] + [n for _, n in ctx_q], dtype=torch.int32).cumsum(0).int()   # (num_seqs + 1,)
    q = torch.randn(int(qsl[-1]), num_kv_heads * group, head_dim, generator=g)       # (num_tokens, heads, head_dim)
    context_lens = torch.tensor([c for c, _ in ctx_q], dtype=torch.int32)            # (num_seqs,)
    return (*(x.to(device, dtype) for x in (q, k_cache, v_cache)),
            *(x.to(device) for x in (block_tables, context_lens, qsl)), head_dim ** -0.5)

# ----------------------------------------------------------------------------------------------
# Benchmark (CUDA): decode against the bytes it must read, and against contiguous attention

def bench_decode(batches=(1, 8, 64, 256), contexts=(512, 1024, 2048, 4096, 8192, 16384)):
    """Decode, 32 query heads on 8 KV heads, head_dim 128, block_size 16, bfloat16. A decode must read every K and
    V of its context once: bytes / time is the kernel's bandwidth, held against a plain device copy measured in the
    same run, and its time against scaled_dot_product_attention on the same K/V laid out contiguously."""
    from triton.testing import do_bench
    num_heads, num_kv_heads, head_dim, block_size, dtype = 32, 8, 128, 16, torch.bfloat16
    scale, bf16, i32 = head_dim ** -0.5, dict(dtype=dtype, device="cuda"), dict(dtype=torch.int32, device="cuda")
    x, y = (torch.empty(1 << 30, dtype=torch.uint8, device="cuda") for _ in "xy")
    copy_gbps = 2 * x.numel() / do_bench(lambda: y.copy_(x)) / 1e6   # read + write, per millisecond -> GB/s
    del x, y
    num_sms, rows = torch.cuda.get_device_properties(0).multi_processor_count, []
    print(f"device copy bandwidth (measured): {copy_gbps:.0f} GB/s")
    print("batch context splits       ms  MB read    GB/s of copy  sdpa ms / sdpa")
    for batch, ctx in [(b, c) for b in batches for c in contexts]:
        k_cache, v_cache = torch.randn(2, batch * ctx // block_size, block_size, num_kv_heads, head_dim, **bf16)
        block_tables = torch.randperm(len(k_cache), device="cuda").view(batch, -1).int()  # (batch, ctx / block_size)
        q = torch.randn(batch, num_heads, head_dim, **bf16)    # one new token each
        context_lens, qsl = torch.full((batch,), ctx, **i32), torch.arange(batch + 1, **i32)
        splits = num_kv_splits_for(batch, num_kv_heads, ctx, num_sms)
        ms = do_bench(lambda: paged_attention_triton(q, k_cache, v_cache, block_tables, context_lens, qsl, scale,
                                                     max_query_len=1, num_kv_splits=splits))
        nbytes = 2 * batch * ctx * num_kv_heads * head_dim * dtype.itemsize + 2 * q.numel() * dtype.itemsize
        # the same K/V, contiguous per sequence: (batch, kv_heads, ctx, head_dim)
        k, v = (c[block_tables.long()].flatten(1, 2).transpose(1, 2).contiguous() for c in (k_cache, v_cache))
        sdpa_ms = do_bench(lambda: F.scaled_dot_product_attention(q[:, :, None], k, v, scale=scale, enable_gqa=True))
        rows.append((batch, ctx, splits, ms, nbytes, nbytes / ms / 1e6, sdpa_ms))
        print(f"{batch:5} {ctx:7} {splits:6} {ms:8.3f} {nbytes / 1e6:8.1f} {rows[-1][5]:7.0f} "
              f"{rows[-1][5] / copy_gbps:7.0%} {sdpa_ms:8.3f} {ms / sdpa_ms:6.2f}")
        del k_cache, v_cache, k, v
    return rows, copy_gbps

if __name__ == "__main__":
    cuda = torch.cuda.is_available()
    device, dtype, tol = ("cuda", torch.bfloat16, 2e-2) if cuda else ("cpu", torch.float32, 1e-4)
    print(f"paged attention on {device} in {dtype} ({'compiled' if cuda else 'Triton interpreter'}) against the "
          f"PyTorch reference; relative error must stay under {tol}")
    print(f"{'block':>5} {'group':>5} {'head_dim':>8} {'splits':>6} {'triton vs ref':>13}")
    worst, shapes = 0.0, [(b, g, d, s) for b in (4, 8, 16) for g in (1, 3, 4) for d in (64, 128) for s in (1, 3)]
    for seed, (block_size, group, head_dim, splits) in enumerate(shapes):
        ctx_q = ((1, 1), (37, 1), (9, 9), (50, 13), (16 * block_size + 3, 7))
        case = random_case(seed, block_size, 2, group, head_dim, ctx_q, dtype=dtype, device=device)
        ref = paged_attention_ref(*case).float()
        out = paged_attention_triton(*case, max_query_len=13, num_kv_splits=splits,
                                     out=torch.full_like(case[0], float("nan"))).float()   # NaN: a gap shows
        err = ((out - ref).abs().max() / ref.abs().max()).item()
        worst = max(worst, err if err == err else float("inf"))   # NaN (an unwritten output) fails too
        print(f"{block_size:5} {group:5} {head_dim:8} {splits:6} {err:13.1e}")
    assert worst < tol, f"the Triton kernel disagrees with the reference: {worst:.2e}"
    print(f"all match (worst relative error {worst:.1e})")
    if cuda:
        rows, copy_gbps = bench_decode()
        b64 = [r for r in rows if r[0] == 64 and r[1] == 4096][0]
        print(f"batch 64, context 4096: {b64[5] / copy_gbps:.0%} of copy bandwidth (target 70%), "
              f"{b64[3] / b64[6]:.2f} x sdpa time (target at most 1.3)")

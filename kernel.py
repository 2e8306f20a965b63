"""
kernel.py: paged attention, the one operation that reads the KV cache through block tables.

What it teaches: attention does not need a sequence's keys and values to be contiguous. A block
table maps each sequence's logical blocks to physical blocks of one shared pool, and attention
walks that table. One function serves prefill chunks and decodes in the same batch:

    out = paged_attention(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale)

Sequence i's q_len new tokens, q[qsl[i]:qsl[i+1]] (qsl = query_start_loc), are the last of its
context_lens[i] tokens and attend causally to all before them (q_len 1: a decode; more: a prefill
chunk), with grouped-query attention. Read it in order, as a Triton tutorial: the K/V write; the
PyTorch reference (the CPU path and the kernel's oracle); the Triton kernel; its launcher; dispatch,
where the reading path ends. Below the banner, for a second reading: the INT8 cache
(kv_cache_dtype="int8": quantize and dequantize, a float32 scale after each row); the backend
check (which path serves a call, and what NANOPAGED_ATTENTION may force); flash-decoding's
split choice (num_kv_splits_for, from the GPU's multiprocessor count); random_case, the random
batches the check and the tests run; the decode benchmark; the check (`__main__`).

    python kernel.py    checks the kernel against the reference over 36 shapes (CPU: interpreted,
                        float32; CUDA: compiled, bfloat16, then times decode against copy and SDPA)
"""
import functools
import os

import torch
import torch.nn.functional as F

# ----------------------------------------------------------------------------------------------
# Writing new K/V into their slots

def store_kvcache(k, v, k_cache, v_cache, slot_mapping):
    """k, v: (num_tokens, kv_heads, head_dim); caches: (num_blocks, block_size, kv_heads, head_dim);
    slot_mapping: (num_tokens,) int64, slot = block_id * block_size + offset. An INT8 cache
    (kv_cache_dtype="int8", below the banner) stores each row quantized, its scale after it."""
    if k_cache.dtype == torch.int8:
        k, v = quantize(k), quantize(v)
    k_cache.view(-1, *k_cache.shape[-2:]).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, *v_cache.shape[-2:]).index_copy_(0, slot_mapping, v)

# ----------------------------------------------------------------------------------------------
# The reference, and the CPU path: gather every context through its block table, then attention
# in plain PyTorch: one call for all the step's decodes, one for each prefill chunk

def paged_attention_ref(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale):
    """Shapes: see paged_attention_kernel. The decodes go in one batch, each prefill chunk alone:
    padded to the longest chunk, a decode's one query or a short chunk would multiply its work."""
    num_kv_heads, head_dim = k_cache.shape[2], q.shape[2]   # (INT8 rows: their scales follow)
    group = q.shape[1] // num_kv_heads                                  # query heads per K/V head
    out = torch.empty_like(q)
    groups = plan(block_tables, context_lens, query_start_loc, k_cache.shape[1], group)
    for ids, rows, mask in groups:
        # 1. the gather is where paging shows: ids are the group's block tables, flattened, so
        #    logical block j of its i-th sequence is physical block ids[i * blocks + j]; each
        #    context comes out in order, whole blocks (the mask hides the slots past its end),
        #    padded to the longest. k, v: (seqs, ctx, kv_heads, dim)
        k = k_cache.flatten(1).index_select(0, ids).view(len(rows), -1, *k_cache.shape[2:])
        v = v_cache.flatten(1).index_select(0, ids).view(len(rows), -1, *v_cache.shape[2:])
        if k.dtype == torch.int8:   # kv_cache_dtype="int8": what was gathered, back to floats
            k, v = dequantize(k, q.dtype), dequantize(v, q.dtype)
        # 2. grouped-query attention as the kernel does it: the query heads that share a K/V
        #    head are more rows of one attention over that head's K and V.
        #    qg: (seqs, kv_heads, q_len, group, dim)
        qg = q[rows].view(*rows.shape, num_kv_heads, group, head_dim).transpose(1, 2)
        # o: (seqs, kv_heads, q_len * group, dim)
        o = F.scaled_dot_product_attention(qg.flatten(2, 3), k.transpose(1, 2), v.transpose(1, 2),
                                           attn_mask=mask, scale=scale)
        o = o.view(len(rows), num_kv_heads, -1, group, head_dim).transpose(1, 2)
        # 3. back to the batch's flat order
        out.index_copy_(0, rows.flatten(), o.reshape(-1, *q.shape[1:]))
    return out

# tensors hash by identity: every layer of a step passes the same three, and the first computes
# the plan for all (the cache holds them, so no later step's tensors can take their identities)
@functools.lru_cache(maxsize=1)
def plan(block_tables, context_lens, query_start_loc, block_size, group):
    """The step's groups of sequences, the same in every layer: [(block ids to gather, the rows of
    their new tokens in q, causal mask)], one group for all decodes, one for each prefill chunk.
    group: query heads per K/V head, each a row of the mask (as of the attention's queries)."""
    q_lens = query_start_loc.diff()                                     # (num_seqs,)
    decodes, chunks = (q_lens == 1).nonzero().flatten(), (q_lens > 1).nonzero()
    groups = []
    # (seqs,) the group's sequences, q_len new tokens each (filter: no decodes, no group for them)
    for members in filter(len, [decodes, *chunks]):
        q_len, ctx = int(q_lens[members[0]]), context_lens[members]
        tables = block_tables[members, :(int(ctx.max()) + block_size - 1) // block_size]
        # each sequence's new tokens: rows qsl[i] .. qsl[i] + q_len - 1 of q
        j = torch.arange(q_len, device=ctx.device)
        rows = query_start_loc[members, None] + j                # (seqs, q_len)
        # causal: row j sits at position ctx - q_len + j and sees keys 0 .. that position
        q_pos = ctx[:, None] - q_len + j                         # (seqs, q_len)
        keys = torch.arange(tables.shape[1] * block_size, device=ctx.device)
        mask = (keys <= q_pos[..., None]).repeat_interleave(group, 1)   # (seqs, q_len * group, ctx)
        # block ids: (seqs * blocks,); mask: (seqs, 1, q_len * group, ctx), one for all K/V heads
        groups.append((tables.flatten().long(), rows, mask[:, None]))
    return groups

# ----------------------------------------------------------------------------------------------
# The Triton kernel: one program per (sequence, KV head, tile of new tokens[, slice of context])
# Rows of a program are (new token, query head) pairs: the GROUP query heads that share one KV
# head are handled together, so every K/V tile is loaded once for the whole group (grouped-query
# attention saves bandwidth only if the kernel exploits it). The context is walked in tiles of
# BLOCK_N tokens; each token's physical slot comes from the block table, so any power-of-two
# block_size works. Softmax is online (running max m, running sum l): no score matrix is stored.

if __name__ == "__main__" and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")   # `python kernel.py` on a CPU: interpreted
try:
    import triton
    import triton.language as tl
    jit = triton.jit
except ImportError:   # no Triton on this platform: the PyTorch reference serves every call
    triton = None
    tl = type("tl", (), {"constexpr": None})
    jit = lambda fn: fn   # noqa: E731

@jit
def paged_attention_kernel(
    out_ptr,              # (num_tokens, num_heads, head_dim) output, or (splits, ...) partials
    lse_ptr,              # (splits, num_tokens, num_heads) float32 log-sum-exp of each partial
    q_ptr,                # (num_tokens, num_heads, head_dim) new tokens' queries, back to back
    k_cache_ptr, v_cache_ptr,   # (num_blocks, block_size, num_kv_heads, head_dim): K, V pools
    k_scale_ptr, v_scale_ptr,   # QUANTIZED: the float32 view of each pool, at a row's scale
    block_tables_ptr,     # (num_seqs, max_blocks_per_seq) int32 physical block ids
    context_lens_ptr,     # (num_seqs,) int32 tokens in each context, new ones included
    query_start_loc_ptr,  # (num_seqs + 1,) int32: sequence i's new tokens are rows qsl[i]..
    scale,                # 1 / sqrt(head_dim)
    stride_qt, stride_qh, stride_bt,   # q per token, per head (dim contiguous); table per seq
    stride_kb, stride_kt, stride_kh,   # cache strides per block, per slot, per KV head (V: same)
    stride_ot, stride_oh, stride_os, stride_lt, stride_ls,   # out per token, head, split; lse
    NUM_SPLITS: tl.constexpr,       # 1: the whole context in one program; >1: flash-decoding
    QUANTIZED: tl.constexpr,        # INT8 pools: rows of head_dim int8, then a float32 scale
    GROUP: tl.constexpr,            # query heads per KV head
    GROUP_PADDED: tl.constexpr,     # GROUP rounded up to a power of 2 (tl.arange needs one)
    BLOCK_M: tl.constexpr,          # new tokens per program (rows = BLOCK_M * GROUP_PADDED)
    BLOCK_N: tl.constexpr,          # context tokens per tile
    BLOCK_SIZE: tl.constexpr,       # tokens per KV cache block
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,   # head_dim; rounded up to a power of 2
):
    # (a first reading skips NUM_SPLITS: flash-decoding, several programs per context, merged after)
    seq, kv_head = tl.program_id(0), tl.program_id(1)
    tile, split = tl.program_id(2) // NUM_SPLITS, tl.program_id(2) % NUM_SPLITS
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    ctx = tl.load(context_lens_ptr + seq)
    if tile * BLOCK_M >= q_len:
        return   # this sequence has fewer new tokens than the grid allows for
    # 1. the rows: token t of this tile, query head h of this KV head's group
    rows = tl.arange(0, BLOCK_M * GROUP_PADDED)
    d = tl.arange(0, BLOCK_D)
    t = tile * BLOCK_M + rows // GROUP_PADDED
    h = rows % GROUP_PADDED
    row_ok = (t < q_len) & (h < GROUP)
    q_pos = ctx - q_len + t                  # each new token's position in its sequence
    head = kv_head * GROUP + h
    q_offs = (q_start + t)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :]
    row_mask = row_ok[:, None] & (d[None, :] < HEAD_DIM)
    q = tl.load(q_ptr + q_offs, mask=row_mask, other=0.0)
    # 2. the context this program reads: causal, so nothing past the tile's last token; in slices
    kv_end = tl.minimum(ctx, ctx - q_len + (tile + 1) * BLOCK_M)
    per_split = tl.cdiv(tl.cdiv(kv_end, BLOCK_N), NUM_SPLITS) * BLOCK_N
    kv_lo, kv_hi = split * per_split, tl.minimum(kv_end, (split + 1) * per_split)
    m = tl.full([BLOCK_M * GROUP_PADDED], float("-inf"), tl.float32)   # running max of scores
    l = tl.zeros([BLOCK_M * GROUP_PADDED], tl.float32)                 # running sum of exp(s - m)
    acc = tl.zeros([BLOCK_M * GROUP_PADDED, BLOCK_D], tl.float32)      # running sum of p * V
    for n in range(kv_lo, kv_hi, BLOCK_N):
        # 3. the block-table walk: token pos lives in block_table[pos // BLOCK_SIZE], at slot
        #    pos % BLOCK_SIZE of that block
        pos = n + tl.arange(0, BLOCK_N)
        pos_ok = pos < kv_hi
        block_ptrs = block_tables_ptr + seq * stride_bt + pos // BLOCK_SIZE
        # (int64: a pool's offsets pass 2**31 elements, as the benchmark's largest, 17 GB, does)
        block = tl.load(block_ptrs, mask=pos_ok, other=0).to(tl.int64)
        slot = block[:, None] * stride_kb + (pos % BLOCK_SIZE)[:, None] * stride_kt
        kv_offs = slot + kv_head * stride_kh + d[None, :]
        kv_mask = pos_ok[:, None] & (d[None, :] < HEAD_DIM)
        k = tl.load(k_cache_ptr + kv_offs, mask=kv_mask, other=0.0)   # (BLOCK_N, BLOCK_D), once
        v = tl.load(v_cache_ptr + kv_offs, mask=kv_mask, other=0.0)   # for the whole group
        if QUANTIZED:   # dequantized in registers: each row's scale, 4 bytes after its values
            scales = (slot + kv_head * stride_kh) // 4               # (BLOCK_N, 1) float32 index
            k = (k * tl.load(k_scale_ptr + scales, mask=pos_ok[:, None], other=0.0)).to(q.dtype)
            v = (v * tl.load(v_scale_ptr + scales, mask=pos_ok[:, None], other=0.0)).to(q.dtype)
        # 4. scores, causal mask, online softmax
        s = tl.dot(q, tl.trans(k)) * scale                           # (rows, BLOCK_N) float32
        s = tl.where(pos_ok[None, :] & (pos[None, :] <= q_pos[:, None]), s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)       # a row with no key yet: zeros
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m - m_safe)
        l = l * alpha + tl.sum(p, 1)
        m = m_new
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    # 5. normalise; the split path also writes the log-sum-exp so that partials can be merged
    l_safe = tl.where(l == 0.0, 1.0, l)
    out = acc / l_safe[:, None]
    out_offs = (q_start + t)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
    if NUM_SPLITS == 1:
        tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=row_mask)
    else:
        tl.store(out_ptr + split * stride_os + out_offs, out, mask=row_mask)
        lse = tl.where(l == 0.0, float("-inf"), m + tl.log(l_safe))
        tl.store(lse_ptr + split * stride_ls + (q_start + t) * stride_lt + head, lse, mask=row_ok)

def paged_attention_triton(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale,
                           max_query_len=None, num_kv_splits=1, out=None):
    """Launch the kernel. max_query_len: the most new tokens of a sequence (given, it saves a
    device-to-host read). num_kv_splits > 1: flash-decoding, each context read in that many slices
    at once, merged by log-sum-exp. out: where to write (NaN in tests: unwritten rows show)."""
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1:3]
    max_query_len = max_query_len or int(query_start_loc.diff().max())
    # tl.dot wants at least 16 rows: decodes (1 token) fill them with the group's heads
    group = num_heads // num_kv_heads
    group_padded = triton.next_power_of_2(group)
    block_m = max(1, (16 if max_query_len == 1 else 64) // group_padded)
    grid = (len(block_tables), num_kv_heads, triton.cdiv(max_query_len, block_m) * num_kv_splits)
    out = torch.empty_like(q) if out is None else out
    quantized = k_cache.dtype == torch.int8   # kv_cache_dtype="int8": the float32 scale of each
    k_scale, v_scale = (c.view(torch.float32)[..., head_dim // 4] if quantized else c   # row,
                        for c in (k_cache, v_cache))   # after its values (the kernel: a pointer)
    # flash-decoding's partials, (splits, num_tokens, heads, head_dim) float32, and their
    # log-sum-exps, (splits, num_tokens, heads); one split writes into out and leaves lse unread
    lse = q.new_empty(num_kv_splits, num_tokens, num_heads, dtype=torch.float32)
    partial = out if num_kv_splits == 1 else lse.new_empty(*lse.shape, head_dim)
    paged_attention_kernel[grid](
        partial, lse, q, k_cache, v_cache, k_scale, v_scale,
        block_tables, context_lens, query_start_loc, scale,
        q.stride(0), q.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        # (one split: partial is out, whose stride per split the kernel never reads)
        partial.stride(-3), partial.stride(-2), partial.stride(0), lse.stride(1), lse.stride(0),
        NUM_SPLITS=num_kv_splits, QUANTIZED=quantized, GROUP=group, GROUP_PADDED=group_padded,
        BLOCK_M=block_m, BLOCK_N=64 if head_dim <= 64 else 32, BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim))
    if num_kv_splits > 1:   # merge: weight each slice's output by its share of the total exp-sum
        w = torch.softmax(lse, dim=0).nan_to_num(0.0)          # (splits, num_tokens, num_heads)
        out.copy_((w[..., None] * partial).sum(0))
    return out

# ----------------------------------------------------------------------------------------------
# Dispatch: CUDA tensors take the Triton kernel, CPU tensors the reference; NANOPAGED_ATTENTION=
# torch or =triton forces one (=triton on CPU tensors needs TRITON_INTERPRET=1, the interpreter)

def paged_attention(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale,
                    max_query_len=None, max_context_len=None):
    """max_query_len, max_context_len: the batch's longest query and context, known to the
    caller; given, they spare the kernel a device-to-host read (and choose num_kv_splits)."""
    args = (q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale)
    if backend(q) == "torch":
        return paged_attention_ref(*args)
    splits = num_kv_splits_for(q, k_cache, block_tables, context_lens, max_context_len)
    return paged_attention_triton(*args, max_query_len, splits)

# ==============================================================================================
# reading path ends here; below, a second reading: INT8, the backend, flash-decoding, check, bench
# ==============================================================================================

# ----------------------------------------------------------------------------------------------
# kv_cache_dtype="int8": symmetric INT8 with a scale per token and KV head. A cache row holds the
# head_dim int8 values, then in 4 bytes the row's float32 scale: a block's scales are in its own
# slice of the cache, so that every copy (copy-on-write, swap, write-down, load) moves them too.

FLOAT32_MAX = torch.finfo(torch.float32).max


def quantize(x):
    """(..., head_dim) floats -> (..., head_dim + 4) int8: round(x / scale), then scale's bytes,
    scale = max |x| / 127 over the row's finite values (symmetric: 0 stays 0; -127 .. 127). An
    inf saturates to +-127, a NaN becomes 0: the row's finite values stay finite."""
    x = x.float()
    finite = torch.where(x.isfinite(), x, 0.0)
    # at most float32's largest / 128: 127 * scale, the largest value dequantized, stays finite
    scale = (finite.abs().amax(-1, keepdim=True) / 127).clamp(1e-30 / 127, FLOAT32_MAX / 128)
    values = (x / scale).nan_to_num(0.0).clamp(-127, 127).round()   # (..., head_dim)
    # the row: its values as int8, then the 4 bytes of its float32 scale
    return torch.cat((values.to(torch.int8), scale.view(torch.int8)), -1)

def dequantize(x, dtype):
    """(..., head_dim + 4) int8 -> (..., head_dim) in dtype: values times their row's scale."""
    return (x[..., :-4] * x[..., -4:].view(torch.float32)).to(dtype)

# ----------------------------------------------------------------------------------------------
# Which path serves a call, and how many slices flash-decoding reads each context in

def backend(q):   # "torch" or "triton": NANOPAGED_ATTENTION, or the tensors' device
    name = os.environ.get("NANOPAGED_ATTENTION") or ("triton" if q.is_cuda else "torch")
    if name not in ("triton", "torch"):
        raise ValueError(f"NANOPAGED_ATTENTION must be 'triton' or 'torch', got {name!r}")
    if name == "triton" and triton is None:
        raise RuntimeError("NANOPAGED_ATTENTION=triton, but Triton is not installed")
    if name == "triton" and not q.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("NANOPAGED_ATTENTION=triton on CPU tensors needs TRITON_INTERPRET=1")
    return name

def num_kv_splits_for(q, k_cache, block_tables, context_lens, max_context_len=None):
    """The flash-decoding switch (CUDA; elsewhere 1): split a context only when (sequence, KV
    head) programs are too few to fill the GPU's streaming multiprocessors and contexts are long
    (at least ~1k tokens per slice)."""
    max_context_len = max_context_len or int(context_lens.max())
    programs = len(block_tables) * k_cache.shape[2]   # (sequence, KV head) pairs
    # (the GPU is asked last: only for a long context, the one case where splitting can pay)
    if not q.is_cuda or max_context_len < 2048 or programs >= num_sms(q.device):
        return 1
    return min(16, max_context_len // 1024, (2 * num_sms(q.device)) // programs)

@functools.cache   # asked every layer of a long-context step: the driver only once per device
def num_sms(device):
    """The GPU's streaming multiprocessors: how many programs it runs at once."""
    return torch.cuda.get_device_properties(device).multi_processor_count

# ----------------------------------------------------------------------------------------------
# Random cases: a pool and a batch, for the check below, the benchmark and the tests

def random_case(seed=0, block_size=4, num_kv_heads=2, group=3, head_dim=16,
                ctx_q=((13, 1), (7, 7), (20, 5), (1, 1)), dtype=torch.float32, device="cpu"):
    """A random pool and a batch mixing decodes and prefill chunks, ctx_q: (context_len, new tokens)
    per sequence. Distinct blocks per sequence, shuffled, so that a wrong table lookup shows."""
    # made on the device, in its dtype: the benchmark's largest pool is 17 GB of bfloat16
    g, num_seqs = torch.Generator(device).manual_seed(seed), len(ctx_q)
    floats = dict(generator=g, dtype=dtype, device=device)
    max_blocks = max((c + block_size - 1) // block_size for c, _ in ctx_q)
    # (num_blocks, block_size, kv_heads, head_dim), 3 blocks more than the tables use
    shape = (num_seqs * max_blocks + 3, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = torch.randn(2, *shape, **floats)
    block_tables = torch.randperm(shape[0], generator=g, device=device)[:-3]
    block_tables = block_tables.view(num_seqs, max_blocks).int()              # (num_seqs, blocks)
    qsl = torch.tensor([0] + [n for _, n in ctx_q], device=device).cumsum(0).int()   # (seqs + 1,)
    q = torch.randn(int(qsl[-1]), num_kv_heads * group, head_dim, **floats)   # (T, heads, dim)
    context_lens = torch.tensor([c for c, _ in ctx_q], dtype=torch.int32, device=device)
    return q, k_cache, v_cache, block_tables, context_lens, qsl, head_dim ** -0.5

# ----------------------------------------------------------------------------------------------
# Benchmark (CUDA): decode against the bytes it must read, and against contiguous attention

def bench_decode(batches=(1, 8, 64, 256), contexts=(512, 1024, 2048, 4096, 8192, 16384)):
    """Decode reads its K/V once: bytes / time is its bandwidth, set against a device copy's.
    Returns {(batch, context): (that share of copy bandwidth, time over SDPA's)}."""
    from triton.testing import do_bench
    x = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    copy_gbps = 2 * x.numel() / do_bench(lambda: x.clone()) / 1e6   # read + write: GB/s
    del x
    shares = {}
    print(f"device copy bandwidth (measured): {copy_gbps:.0f} GB/s")
    print("batch context splits       ms  MB read    GB/s of copy  sdpa ms / sdpa")
    for batch, ctx in [(b, c) for b in batches for c in contexts]:
        # one new token each of batch sequences: 32 query heads on 8 KV heads of 128, blocks of
        # 16 tokens, each sequence's shuffled (random_case: decodes only)
        case = random_case(0, 16, 8, 4, 128, ((ctx, 1),) * batch, torch.bfloat16, "cuda")
        q, k_cache, v_cache, block_tables, context_lens, _, scale = case
        splits = num_kv_splits_for(q, k_cache, block_tables, context_lens, ctx)
        ms = do_bench(lambda: paged_attention_triton(*case, max_query_len=1, num_kv_splits=splits))
        # K and V of every context token (kv_heads * head_dim each), q read and out written
        nbytes = (2 * batch * ctx * k_cache[0, 0].numel() + 2 * q.numel()) * q.element_size()
        # the same K/V, contiguous per sequence: (batch, kv_heads, ctx, head_dim)
        k, v = (c[block_tables.long()].flatten(1, 2).transpose(1, 2).contiguous()
                for c in (k_cache, v_cache))
        sdpa_ms = do_bench(lambda: F.scaled_dot_product_attention(q[:, :, None], k, v,
                                                                  scale=scale, enable_gqa=True))
        gbps = nbytes / ms / 1e6
        shares[batch, ctx] = (gbps / copy_gbps, ms / sdpa_ms)
        print(f"{batch:5} {ctx:7} {splits:6} {ms:8.3f} {nbytes / 1e6:8.1f} {gbps:7.0f} "
              f"{gbps / copy_gbps:7.0%} {sdpa_ms:8.3f} {ms / sdpa_ms:6.2f}")
        del case, k_cache, v_cache, k, v   # freed before the next, larger pool is made
    return shares

# ----------------------------------------------------------------------------------------------
# The check (`python kernel.py`): the kernel against the reference on 36 shapes; on CUDA, then
# the benchmark

if __name__ == "__main__":
    cuda = torch.cuda.is_available()
    device, dtype, tol, how = (("cuda", torch.bfloat16, 2e-2, "compiled") if cuda else
                               ("cpu", torch.float32, 1e-4, "Triton interpreter"))
    print(f"paged attention on {device} in {dtype} ({how}) against the reference: error < {tol}")
    print(f"{'block':>5} {'group':>5} {'head_dim':>8} {'splits':>6} {'triton vs ref':>13}")
    worst = 0.0
    grid = [(b, g, d, s) for b in (4, 8, 16) for g in (1, 3, 4) for d in (64, 128) for s in (1, 3)]
    for seed, (block_size, group, head_dim, splits) in enumerate(grid):
        ctx_q = ((1, 1), (37, 1), (9, 9), (50, 13), (16 * block_size + 3, 7))
        case = random_case(seed, block_size, 2, group, head_dim, ctx_q, dtype=dtype, device=device)
        ref = paged_attention_ref(*case).float()
        poisoned = torch.full_like(case[0], float("nan"))   # an unwritten output stays NaN
        out = paged_attention_triton(*case, max_query_len=13, num_kv_splits=splits, out=poisoned)
        err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
        worst = max(worst, err if err == err else float("inf"))   # NaN fails too
        print(f"{block_size:5} {group:5} {head_dim:8} {splits:6} {err:13.1e}")
    assert worst < tol, f"the Triton kernel disagrees with the reference: {worst:.2e}"
    print(f"all match (worst relative error {worst:.1e})")
    if cuda:
        share, vs_sdpa = bench_decode()[64, 4096]
        print(f"batch 64, context 4096: {share:.0%} of copy bandwidth (target 70%), "
              f"{vs_sdpa:.2f} x sdpa time (target at most 1.3)")

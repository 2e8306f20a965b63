"""
kernel.py: paged attention, the one operation that reads the KV cache through block tables.

What it teaches: attention does not need a sequence's keys and values to be contiguous. A block
table maps each sequence's logical blocks to physical blocks of one shared pool, and attention
walks that table. One function serves prefill chunks and decodes in the same batch:

    out = paged_attention(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale)

Sequence i's q_len new tokens, q[qsl[i]:qsl[i+1]] (qsl = query_start_loc), are the last of its
context_lens[i] tokens and attend causally to all before them (q_len 1: a decode; more: a prefill
chunk), with grouped-query attention. Read it in order, as a Triton tutorial: the K/V write; the
PyTorch reference (the CPU path and the kernel's oracle) and its plan of the step (made once a
step by the model, for all its layers); the Triton kernel; the plain launcher (a float pool, each
context read by one program), where the reading path ends: the kernel's INT8 and flash-decoding
branches are constexprs that launcher never takes. Below the banner, for a second reading: the
full launcher and dispatch (paged_attention: any pool, flash-decoding's slices, the path that
NANOPAGED_ATTENTION may force); the launcher's refinements (an INT8 pool's scales, the slices'
partial outputs and their merge); the INT8 cache (kv_cache_dtype="int8": quantize and
dequantize, a float32 scale after each row; its K/V write and its reference); the backend check;
flash-decoding's split choice (num_kv_splits_for, from the GPU's multiprocessor count);
random_case, the random batches the check and the tests run; the decode benchmark; the check
(`__main__`).

    python kernel.py    checks the kernel against the reference over 36 shapes (CPU: interpreted,
                        float32; CUDA: compiled, bfloat16, then times decode against copy and SDPA)
"""
import functools
import itertools
import os
import types

import torch
import torch.nn.functional as F

# ----------------------------------------------------------------------------------------------
# Writing new K/V into their slots

def store_kvcache(k, v, k_cache, v_cache, slot_mapping):
    """k, v: (num_tokens, kv_heads, head_dim); caches: (num_blocks, block_size, kv_heads, head_dim);
    slot_mapping: (num_tokens,) int64, slot = block_id * block_size + offset. (An INT8 cache:
    store_kvcache_int8, below the banner.)"""
    for cache, new in ((k_cache, k), (v_cache, v)):
        cache.view(-1, *cache.shape[-2:]).index_copy_(0, slot_mapping, new)

# ----------------------------------------------------------------------------------------------
# The reference, and the CPU path: gather every context through its block table, then attention
# in plain PyTorch: one call for all the step's decodes, one for each prefill chunk

def paged_attention_ref(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale,
                        plan=None):
    """Shapes: see paged_attention_kernel. plan: make_plan's groups for this step, which the model
    makes once for all its layers (None: made here). The decodes go in one batch, each prefill
    chunk alone: padded to the longest chunk, a decode's one query or a short chunk would multiply
    its work. (An INT8 pool: paged_attention_ref_int8, below the banner.)"""
    num_kv_heads = k_cache.shape[2]
    # no plan given: made here, from the block size and the query heads per K/V head
    if plan is None:
        plan = make_plan(block_tables, context_lens, query_start_loc,
                         k_cache.shape[1], q.shape[1] // num_kv_heads)
    out = torch.empty_like(q)
    for ids, rows, mask in plan:
        # 1. the gather is where paging shows: ids are the group's block tables, flattened, so
        #    logical block j of its i-th sequence is physical block ids[i * blocks + j]; each
        #    context comes out in order, whole blocks (the mask hides the slots past its end),
        #    padded to the longest. k, v: (seqs, kv_heads, ctx, dim)
        # lab block-table: below, the gather through the block tables
        k, v = (cache.index_select(0, ids).view(len(rows), -1, *cache.shape[2:]).transpose(1, 2)
                for cache in (k_cache, v_cache))
        # 2. grouped-query attention as the kernel does it: the query heads that share a K/V
        #    head are more rows of one attention over that head's K and V
        #    qg: (seqs, kv_heads, q_len, group, dim)
        qg = q[rows].unflatten(2, (num_kv_heads, -1)).transpose(1, 2)
        o = F.scaled_dot_product_attention(
            qg.flatten(2, 3),   # (seqs, kv_heads, q_len * group, dim)
            k,
            v,
            attn_mask=mask,
            scale=scale)
        # 3. back to the batch's flat order: (seqs, q_len, heads, dim) into q's rows
        out[rows] = o.view_as(qg).transpose(1, 2).flatten(2, 3)
    return out


def make_plan(block_tables, context_lens, query_start_loc, block_size, group):
    """The step's groups of sequences, the same in every layer: [(block ids to gather, the rows of
    their new tokens in q, causal mask)], one group for all decodes, one for each prefill chunk.
    group: query heads per K/V head, each a row of the mask (as of the attention's queries).
    The model makes it once a step, from that step's tables, and hands it to every layer."""
    q_lens = query_start_loc.diff()   # (num_seqs,)
    decodes = (q_lens == 1).nonzero().flatten()
    chunks = (q_lens > 1).nonzero()
    groups = []
    # members: the group's sequences, q_len new tokens each (filter: no decodes, no group for them)
    for members in filter(len, [decodes, *chunks]):
        q_len = int(q_lens[members[0]])
        ctx = context_lens[members]   # (seqs,)
        num_blocks = (int(ctx.max()) + block_size - 1) // block_size
        # each sequence's new tokens: rows qsl[i] .. qsl[i] + q_len - 1 of q
        j = torch.arange(q_len, device=ctx.device)
        rows = query_start_loc[members, None] + j   # (seqs, q_len)
        # causal: row j sits at position ctx - q_len + j and sees keys 0 .. that position
        q_pos = ctx[:, None] - q_len + j   # (seqs, q_len)
        keys = torch.arange(num_blocks * block_size, device=ctx.device)
        # one row for each query head of a K/V head: (seqs, q_len * group, ctx)
        mask = (keys <= q_pos[..., None]).repeat_interleave(group, 1)
        # block ids: (seqs * blocks,); mask: (seqs, 1, q_len * group, ctx), one for all K/V heads
        groups.append((block_tables[members, :num_blocks].flatten(),
                       rows,
                       mask[:, None]))
    return groups

# ----------------------------------------------------------------------------------------------
# The Triton kernel: one program per (sequence, KV head, tile of new tokens[, slice of context])
# Rows of a program are (new token, query head) pairs: the GROUP query heads that share one KV
# head are handled together, so every K/V tile is loaded once for the whole group (grouped-query
# attention saves bandwidth only if the kernel exploits it). The context is walked in tiles of
# BLOCK_N tokens; each token's physical slot comes from the block table, so any power-of-two
# block_size works. Softmax is online (running max m, running sum l): no score matrix is stored.

# `python kernel.py` on a CPU runs the kernel in Triton's interpreter
if __name__ == "__main__" and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
try:
    import triton
    import triton.language as tl
    jit = triton.jit
except ImportError:
    # no Triton on this platform: the PyTorch reference serves every call (tl.constexpr: what
    # the kernel's signature reads as it is defined)
    triton = None
    tl = types.SimpleNamespace(constexpr=None)
    jit = lambda fn: fn   # noqa: E731


# The arguments: each pointer's tensor, with its shape. Sequence i's new tokens are rows
# qsl[i] .. qsl[i + 1] - 1 of q and out (qsl = query_start_loc). A launch with NUM_SPLITS > 1
# (flash-decoding, below the banner) writes float32 partial outputs, one per slice of the
# context, and each one's log-sum-exp; one split writes the output itself and leaves lse alone.
# An INT8 pool (QUANTIZED: rows of head_dim int8, then a float32 scale) comes with a float32 view
# of itself at each row's scale (below the banner); a float pool, with itself, never read.
@jit
def paged_attention_kernel(
    out_ptr,              # (num_tokens, num_heads, head_dim), or (splits, ...) float32
    lse_ptr,              # (splits, num_tokens, num_heads) float32
    q_ptr,                # (num_tokens, num_heads, head_dim)
    k_cache_ptr,          # (num_blocks, block_size, num_kv_heads, head_dim)
    v_cache_ptr,          # (num_blocks, block_size, num_kv_heads, head_dim)
    k_scale_ptr,          # QUANTIZED: float32 scales
    v_scale_ptr,          # QUANTIZED: float32 scales
    block_tables_ptr,     # (num_seqs, max_blocks_per_seq) int32
    context_lens_ptr,     # (num_seqs,) int32, new tokens included
    query_start_loc_ptr,  # (num_seqs + 1,) int32
    scale,                # 1 / sqrt(head_dim)
    stride_qt, stride_qh,               # q per token, per head
    stride_bt,                          # block table per sequence
    stride_kb, stride_kt, stride_kh,    # K, V per block, slot, KV head
    stride_ot, stride_oh, stride_os,    # out per token, head, split
    stride_lt, stride_ls,               # lse per token, split
    NUM_SPLITS: tl.constexpr,       # 1: the whole context in one program
    QUANTIZED: tl.constexpr,        # INT8 pools
    GROUP: tl.constexpr,            # query heads per KV head
    GROUP_PADDED: tl.constexpr,     # GROUP up to a power of 2 (for tl.arange)
    BLOCK_M: tl.constexpr,          # new tokens per program
    BLOCK_N: tl.constexpr,          # context tokens per tile
    BLOCK_SIZE: tl.constexpr,       # tokens per KV cache block
    HEAD_DIM: tl.constexpr,         # head_dim
    BLOCK_D: tl.constexpr,          # head_dim up to a power of 2
):
    # (a first reading skips NUM_SPLITS: flash-decoding, several programs per context)
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    tile = tl.program_id(2) // NUM_SPLITS
    split = tl.program_id(2) % NUM_SPLITS
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    ctx = tl.load(context_lens_ptr + seq)
    # this sequence has fewer new tokens than the grid allows for
    if tile * BLOCK_M >= q_len:
        return
    # 1. the rows (BLOCK_M * GROUP_PADDED): token t of this tile, query head h of this KV head's
    #    group; token is the row of q and out, q_pos the new token's position in its sequence
    rows = tl.arange(0, BLOCK_M * GROUP_PADDED)
    d = tl.arange(0, BLOCK_D)[None, :]   # (1, BLOCK_D)
    t = tile * BLOCK_M + rows // GROUP_PADDED
    h = rows % GROUP_PADDED
    row_ok = (t < q_len) & (h < GROUP)
    token = q_start + t
    q_pos = ctx - q_len + t
    head = kv_head * GROUP + h
    d_ok = d < HEAD_DIM
    row_mask = row_ok[:, None] & d_ok
    q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + d,
                mask=row_mask, other=0.0)
    # 2. the context this program reads: causal, so nothing past the tile's last token; in slices
    kv_end = tl.minimum(ctx, ctx - q_len + (tile + 1) * BLOCK_M)
    per_split = tl.cdiv(tl.cdiv(kv_end, BLOCK_N), NUM_SPLITS) * BLOCK_N
    kv_lo = split * per_split
    kv_hi = tl.minimum(kv_end, kv_lo + per_split)
    # a row's running max of the scores, its running sum of exp(s - m), and of p * V
    m = tl.full([BLOCK_M * GROUP_PADDED], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M * GROUP_PADDED], tl.float32)
    acc = tl.zeros([BLOCK_M * GROUP_PADDED, BLOCK_D], tl.float32)
    for n in range(kv_lo, kv_hi, BLOCK_N):
        # 3. the block-table walk: token pos lives in block_table[pos // BLOCK_SIZE], at slot
        #    pos % BLOCK_SIZE of that block; kv_row is where this KV head's row starts there.
        #    (int64: a pool's offsets pass 2**31 elements, as the benchmark's largest, 17 GB, does)
        pos = n + tl.arange(0, BLOCK_N)
        pos_ok = pos < kv_hi
        block = tl.load(block_tables_ptr + seq * stride_bt + pos // BLOCK_SIZE,
                        mask=pos_ok, other=0).to(tl.int64)
        slot = (pos % BLOCK_SIZE)[:, None]
        kv_row = block[:, None] * stride_kb + slot * stride_kt + kv_head * stride_kh
        kv_mask = pos_ok[:, None] & d_ok
        # (BLOCK_N, BLOCK_D) each, loaded once for the whole group
        k = tl.load(k_cache_ptr + kv_row + d, mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + kv_row + d, mask=kv_mask, other=0.0)
        # INT8, dequantized in registers: each row's scale is 4 bytes after its values
        if QUANTIZED:
            scales = kv_row // 4   # (BLOCK_N, 1) float32 index
            k = (k * tl.load(k_scale_ptr + scales,
                             mask=pos_ok[:, None], other=0.0)).to(q.dtype)
            v = (v * tl.load(v_scale_ptr + scales,
                             mask=pos_ok[:, None], other=0.0)).to(q.dtype)
        # 4. scores, causal mask, online softmax (a row with no key yet: m_safe 0, zeros)
        s = tl.dot(q, tl.trans(k)) * scale   # (rows, BLOCK_N) float32
        s = tl.where(pos_ok[None, :] & (pos[None, :] <= q_pos[:, None]), s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m - m_safe)
        l = l * alpha + tl.sum(p, 1)
        m = m_new
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    # 5. normalise, then store (one split: split is 0, out_ptr the output); a split also writes
    #    its log-sum-exp, so that the partials can be merged (-inf where the slice had no key:
    #    m is still -inf there)
    l_safe = tl.where(l == 0.0, 1.0, l)
    out_offs = split * stride_os + token[:, None] * stride_ot + head[:, None] * stride_oh + d
    tl.store(out_ptr + out_offs, (acc / l_safe[:, None]).to(out_ptr.dtype.element_ty),
             mask=row_mask)
    if NUM_SPLITS > 1:
        tl.store(lse_ptr + split * stride_ls + token * stride_lt + head, m + tl.log(l_safe),
                 mask=row_ok)


def paged_attention_plain(q, k_cache, v_cache, block_tables, context_lens, query_start_loc,
                          scale, max_query_len=None):
    """The kernel on a float pool, each context read whole by one program (the full launcher,
    paged_attention_triton, is below the banner: INT8 pools, flash-decoding's slices)."""
    out = torch.empty_like(q)
    # lse, the scales: pointers that one split of a float pool never reads
    launch(out, out, q, k_cache, v_cache, k_cache, v_cache, block_tables, context_lens,
           query_start_loc, scale, max_query_len)
    return out


def launch(out, lse, q, k_cache, v_cache, k_scales, v_scales, block_tables, context_lens,
           query_start_loc, scale, max_query_len=None, num_kv_splits=1):
    """The kernel on its grid. out: where it writes (with num_kv_splits > 1, each slice's partial
    output, and lse each one's log-sum-exp); k_scales, v_scales: an INT8 pool's float32 scales.
    max_query_len: the most new tokens of a sequence (given, it saves a device-to-host read)."""
    head_dim = q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1:3]
    max_query_len = max_query_len or int(query_start_loc.diff().max())
    # tl.dot wants at least 16 rows: decodes (1 token) fill them with the group's heads
    group = q.shape[1] // num_kv_heads
    group_padded = triton.next_power_of_2(group)
    block_m = max(1, (16 if max_query_len == 1 else 64) // group_padded)
    # one program per (sequence, KV head, tile of new tokens[, slice of context])
    grid = (len(block_tables),
            num_kv_heads,
            triton.cdiv(max_query_len, block_m) * num_kv_splits)
    paged_attention_kernel[grid](
        out, lse, q, k_cache, v_cache, k_scales, v_scales,
        block_tables, context_lens, query_start_loc, scale,
        # q's first two strides (token, head), the pool's first three (block, slot, KV head)
        *q.stride()[:2],
        block_tables.stride(0),
        *k_cache.stride()[:3],
        out.stride(-3), out.stride(-2), out.stride(0),
        lse.stride(-2), lse.stride(0),
        NUM_SPLITS=num_kv_splits,
        QUANTIZED=k_cache.dtype == torch.int8,
        GROUP=group,
        GROUP_PADDED=group_padded,
        BLOCK_M=block_m,
        BLOCK_N=64 if head_dim <= 64 else 32,
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim))

# ==============================================================================================
# reading path ends here; below, a second reading: the launcher's refinements, INT8, the backend,
# flash-decoding, check, bench
# ==============================================================================================

# ----------------------------------------------------------------------------------------------
# The full launcher, and dispatch: CUDA tensors take the Triton kernel, CPU tensors the
# reference; NANOPAGED_ATTENTION=torch or =triton forces one (=triton on CPU tensors needs
# TRITON_INTERPRET=1, the interpreter); an INT8 pool and flash-decoding's slices served on both

def paged_attention_triton(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale,
                           max_query_len=None, num_kv_splits=1, out=None):
    """Launch the kernel on any pool. num_kv_splits > 1: flash-decoding, each context read in that
    many slices at once, merged by log-sum-exp. out: where to write (NaN in tests: unwritten rows
    show)."""
    out = torch.empty_like(q) if out is None else out
    partial, lse = split_buffers(out, num_kv_splits)
    launch(partial, lse, q, k_cache, v_cache, row_scales(k_cache), row_scales(v_cache),
           block_tables, context_lens, query_start_loc, scale, max_query_len, num_kv_splits)
    merge_splits(out, partial, lse)
    return out


def paged_attention(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale,
                    max_query_len=None, max_context_len=None, plan=None):
    """max_query_len, max_context_len: the batch's longest query and context, known to the
    caller; given, they spare the kernel a device-to-host read (and choose num_kv_splits).
    plan: for the reference, make_plan's groups of this step (None: the reference makes them)."""
    args = (q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale)
    if backend(q) == "triton":
        return paged_attention_triton(
            *args, max_query_len,
            num_kv_splits_for(q, k_cache, block_tables, context_lens, max_context_len))
    if k_cache.dtype == torch.int8:
        return paged_attention_ref_int8(*args)
    return paged_attention_ref(*args, plan)

# ----------------------------------------------------------------------------------------------
# The launcher's refinements: an INT8 pool's scales; flash-decoding's partial outputs, each a
# slice of the context's, and their merge by log-sum-exp

def row_scales(cache):
    """What the kernel's k_scale_ptr or v_scale_ptr points at. An INT8 pool: a float32 view of it,
    at each row's last 4 bytes, the row's scale (the kernel indexes it in float32 units). Any other
    pool: the pool itself, never read (QUANTIZED is False)."""
    if cache.dtype == torch.int8:
        return cache.view(torch.float32)[..., -1]
    return cache


def split_buffers(out, num_kv_splits):
    """(partial, lse): each slice's output, (splits, num_tokens, num_heads, head_dim) float32, and
    its log-sum-exp, (splits, num_tokens, num_heads) float32. One split: partial is out itself,
    and the kernel leaves lse unread."""
    lse = out.new_empty(num_kv_splits, *out.shape[:2], dtype=torch.float32)
    if num_kv_splits == 1:
        return out, lse
    return lse.new_empty(*lse.shape, out.shape[2]), lse


def merge_splits(out, partial, lse):
    """Into out, each slice's output weighted by its share of the total exp-sum (a softmax of the
    log-sum-exps; an empty slice's weight is 0). One split: nothing to do, the kernel wrote out."""
    if len(lse) > 1:
        w = torch.softmax(lse, dim=0).nan_to_num(0.0)   # (splits, num_tokens, num_heads)
        out.copy_((w[..., None] * partial).sum(0))

# ----------------------------------------------------------------------------------------------
# kv_cache_dtype="int8": symmetric INT8 with a scale per token and KV head. A cache row holds the
# head_dim int8 values, then in 4 bytes the row's float32 scale: a block's scales are in its own
# slice of the cache, so that every copy (copy-on-write, swap, write-down, load) moves them too.

def quantize(x):
    """(..., head_dim) floats -> (..., head_dim + 4) int8: round(x / scale), then scale's bytes,
    scale = max |x| / 127 over the row's finite values (symmetric: 0 stays 0; -127 .. 127). An
    inf saturates to +-127, a NaN becomes 0: the row's finite values stay finite."""
    x = x.float()
    finite = torch.where(x.isfinite(), x, 0.0)
    # at most float32's largest / 128: 127 * scale, the largest value dequantized, stays finite
    scale = finite.abs().amax(-1, keepdim=True) / 127
    scale = scale.clamp(1e-30 / 127, torch.finfo(torch.float32).max / 128)
    values = (x / scale).nan_to_num(0.0).clamp(-127, 127).round()   # (..., head_dim)
    # the row: its values as int8, then the 4 bytes of its float32 scale
    return torch.cat((values.to(torch.int8), scale.view(torch.int8)), -1)


def dequantize(x, dtype):
    """(..., head_dim + 4) int8 -> (..., head_dim) in dtype: values times their row's scale."""
    return (x[..., :-4] * x[..., -4:].view(torch.float32)).to(dtype)


def store_kvcache_int8(k, v, k_cache, v_cache, slot_mapping):
    """store_kvcache into any pool: an INT8 one's rows quantized, each scale after its row."""
    if k_cache.dtype == torch.int8:
        k, v = quantize(k), quantize(v)
    store_kvcache(k, v, k_cache, v_cache, slot_mapping)


def paged_attention_ref_int8(q, k_cache, v_cache, block_tables, context_lens, query_start_loc,
                             scale):
    """The reference on an INT8 pool: the blocks the step reads, dequantized into a pool of their
    own, read through the tables renumbered into it (the step's plan names the old numbers: the
    reference makes its own)."""
    # used: (blocks read,) sorted; tables: block_tables' shape, each id's place in used
    used, tables = block_tables.unique(return_inverse=True)
    # k, v: (blocks read, block_size, kv_heads, head_dim) in q's dtype
    k, v = (dequantize(cache[used], q.dtype) for cache in (k_cache, v_cache))
    return paged_attention_ref(q, k, v, tables.int(), context_lens, query_start_loc, scale)

# ----------------------------------------------------------------------------------------------
# Which path serves a call, and how many slices flash-decoding reads each context in

def backend(q):
    """Which path serves q: "torch" or "triton" (NANOPAGED_ATTENTION, or else q's device)."""
    name = os.environ.get("NANOPAGED_ATTENTION") or ("triton" if q.is_cuda else "torch")
    if name not in ("triton", "torch"):
        raise ValueError(f"NANOPAGED_ATTENTION must be 'triton' or 'torch', got {name!r}")
    if name == "triton" and triton is None:
        raise RuntimeError("NANOPAGED_ATTENTION=triton, but Triton is not installed")
    if name == "triton" and not q.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("NANOPAGED_ATTENTION=triton on CPU tensors needs TRITON_INTERPRET=1")
    return name


def num_kv_splits_for(q, k_cache, block_tables, context_lens, max_context_len):
    """The flash-decoding switch (CUDA; elsewhere 1): split a context only when (sequence, KV
    head) programs are too few to fill the GPU's streaming multiprocessors and contexts are long
    (at least ~1k tokens per slice)."""
    max_context_len = max_context_len or int(context_lens.max())
    programs = len(block_tables) * k_cache.shape[2]   # (sequence, KV head) pairs
    # the GPU is asked last: only for a long context, the one case where splitting can pay
    if not q.is_cuda or max_context_len < 2048 or programs >= num_sms(q.device):
        return 1
    return min(16, max_context_len // 1024, 2 * num_sms(q.device) // programs)


# asked every layer of a long-context step: the driver only once per device
@functools.cache
def num_sms(device):
    """The GPU's streaming multiprocessors: how many programs it runs at once."""
    return torch.cuda.get_device_properties(device).multi_processor_count

# ----------------------------------------------------------------------------------------------
# Random cases: a pool and a batch, for the check below, the benchmark and the tests

def random_case(seed, block_size, num_kv_heads, group, head_dim, ctx_q,
                dtype=torch.float32, device="cpu"):
    """A random pool and a batch mixing decodes and prefill chunks, ctx_q: (context_len, new tokens)
    per sequence, e.g. ((13, 1), (7, 7), (20, 5)): a decode, a whole prompt, a chunk on cached
    context. Distinct blocks per sequence, shuffled, so that a wrong table lookup shows."""
    # made on the device, in its dtype: the benchmark's largest pool is 17 GB of bfloat16
    g = torch.Generator(device).manual_seed(seed)
    floats = dict(generator=g, dtype=dtype, device=device)
    num_seqs = len(ctx_q)
    contexts, q_lens = zip(*ctx_q)
    max_blocks = (max(contexts) + block_size - 1) // block_size
    # (num_blocks, block_size, kv_heads, head_dim), 3 blocks more than the tables use
    shape = (num_seqs * max_blocks + 3, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = torch.randn(2, *shape, **floats)
    block_tables = torch.randperm(shape[0], generator=g, device=device)[:-3]
    block_tables = block_tables.view(num_seqs, max_blocks).int()   # (num_seqs, blocks)
    # (num_seqs + 1,): sequence i's new tokens are rows qsl[i] .. qsl[i + 1] - 1 of q
    qsl = torch.tensor([0, *q_lens], device=device).cumsum(0).int()
    # (num_tokens, heads, head_dim)
    q = torch.randn(int(qsl[-1]), num_kv_heads * group, head_dim, **floats)
    context_lens = torch.tensor(contexts, dtype=torch.int32, device=device)
    return q, k_cache, v_cache, block_tables, context_lens, qsl, head_dim ** -0.5

# ----------------------------------------------------------------------------------------------
# Benchmark (CUDA): decode against the bytes it must read, and against contiguous attention

def bench_decode():
    """Decode reads its K/V once: bytes / time is its bandwidth, set against a device copy's.
    Returns {(batch, context): (that share of copy bandwidth, time over SDPA's)}, for batches of
    1 to 256 sequences and contexts of 512 to 16384 tokens (whole blocks of 16)."""
    from triton.testing import do_bench
    x = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    copy_gbps = 2 * x.nbytes / do_bench(x.clone) / 1e6   # read + write: GB/s
    del x
    shares = {}
    print(f"device copy bandwidth (measured): {copy_gbps:.0f} GB/s")
    print("batch context splits       ms  MB read    GB/s of copy  sdpa ms / sdpa")
    for batch, ctx in itertools.product((1, 8, 64, 256),
                                        (512, 1024, 2048, 4096, 8192, 16384)):
        # one new token each of batch sequences: 32 query heads on 8 KV heads of 128, blocks of
        # 16 tokens, each sequence's shuffled (random_case: decodes only)
        case = random_case(0, 16, 8, 4, 128, ((ctx, 1),) * batch, torch.bfloat16, "cuda")
        q, k_cache, v_cache, block_tables, context_lens, _, scale = case
        splits = num_kv_splits_for(q, k_cache, block_tables, context_lens, ctx)
        ms = do_bench(lambda: paged_attention_triton(*case,
                                                     max_query_len=1,
                                                     num_kv_splits=splits))
        # the same K/V, contiguous per sequence: (batch, kv_heads, ctx, head_dim)
        k, v = (c[block_tables.long()].flatten(1, 2).transpose(1, 2).contiguous()
                for c in (k_cache, v_cache))
        # what decode must move: K and V of every context token (as many bytes as these
        # contiguous copies hold), q read and out written
        nbytes = k.nbytes + v.nbytes + 2 * q.nbytes
        sdpa_ms = do_bench(lambda: F.scaled_dot_product_attention(q[:, :, None], k, v,
                                                                  scale=scale,
                                                                  enable_gqa=True))
        gbps = nbytes / ms / 1e6
        shares[batch, ctx] = (gbps / copy_gbps, ms / sdpa_ms)
        print(f"{batch:5} {ctx:7} {splits:6} {ms:8.3f} {nbytes / 1e6:8.1f} {gbps:7.0f} "
              f"{gbps / copy_gbps:7.0%} {sdpa_ms:8.3f} {ms / sdpa_ms:6.2f}")
        # freed before the next, larger pool is made
        del case, k_cache, v_cache, k, v
    return shares

# ----------------------------------------------------------------------------------------------
# The check (`python kernel.py`): the kernel against the reference on 36 shapes; on CUDA, then
# the benchmark

if __name__ == "__main__":
    cuda = torch.cuda.is_available()
    device, dtype, tol, how = (
        ("cuda", torch.bfloat16, 2e-2, "compiled") if cuda else
        ("cpu", torch.float32, 1e-4, "Triton interpreter"))
    print(f"paged attention on {device} in {dtype} ({how}) against the reference: error < {tol}")
    print(f"{'block':>5} {'group':>5} {'head_dim':>8} {'splits':>6} {'triton vs ref':>13}")
    worst = 0.0
    # block size, group, head_dim, splits
    grid = itertools.product((4, 8, 16), (1, 3, 4), (64, 128), (1, 3))
    for seed, (block_size, group, head_dim, splits) in enumerate(grid):
        # decodes, a whole prompt, chunks on cached context (one over 16 blocks)
        case = random_case(seed, block_size, 2, group, head_dim,
                           ((1, 1), (37, 1), (9, 9), (50, 13), (16 * block_size + 3, 7)),
                           dtype, device)
        ref = paged_attention_ref(*case).float()
        # into NaNs: an unwritten output stays NaN
        out = paged_attention_triton(*case,
                                     num_kv_splits=splits,
                                     out=torch.full_like(case[0], float("nan")))
        err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
        # a NaN fails too
        worst = max(worst, err if err == err else float("inf"))
        print(f"{block_size:5} {group:5} {head_dim:8} {splits:6} {err:13.1e}")
    assert worst < tol, f"the Triton kernel disagrees with the reference: {worst:.2e}"
    print(f"all match (worst relative error {worst:.1e})")
    if cuda:
        share, vs_sdpa = bench_decode()[64, 4096]
        print(f"batch 64, context 4096: {share:.0%} of copy bandwidth (target 70%), "
              f"{vs_sdpa:.2f} x sdpa time (target at most 1.3)")

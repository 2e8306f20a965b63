"""kernel.py: the paged reference against contiguous attention, and the K/V write."""
import pytest
import torch
import torch.nn.functional as F

from kernel import paged_attention, random_case, store_kvcache


def contiguous_attention(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale):
    """The reference's contract done the obvious way: copy each context out contiguously, then SDPA with a causal mask."""
    group, out = q.shape[1] // k_cache.shape[2], torch.empty_like(q)
    for i in range(len(context_lens)):
        c, s, e = int(context_lens[i]), int(query_start_loc[i]), int(query_start_loc[i + 1])
        k, v = (torch.cat([x[b] for b in block_tables[i].tolist()])[:c].repeat_interleave(group, 1).transpose(0, 1)
                for x in (k_cache, v_cache))   # (heads, ctx, head_dim)
        mask = torch.ones(e - s, c, dtype=torch.bool, device=q.device).tril(diagonal=c - (e - s))
        out[s:e] = F.scaled_dot_product_attention(q[s:e].transpose(0, 1), k, v, attn_mask=mask,
                                                  scale=scale).transpose(0, 1)
    return out


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("head_dim", [16, 64])
def test_reference_matches_contiguous_attention(block_size, group, head_dim):
    """Varlen queries over shuffled paged context equal plain causal attention on contiguous K/V (GQA included)."""
    ctx_q = ((1, 1), (37, 1), (9, 9), (50, 13), (16, 4))   # decodes, a whole prompt, chunks on cached context
    case = random_case(block_size + group + head_dim, block_size, 2, group, head_dim, ctx_q)
    torch.testing.assert_close(paged_attention(*case), contiguous_attention(*case), rtol=1e-5, atol=1e-5)


def test_store_kvcache_writes_exactly_the_given_slots():
    """Each token's K/V land at slot = block_id * block_size + offset, and nothing else changes."""
    k_cache, v_cache = torch.zeros(6, 4, 2, 8), torch.zeros(6, 4, 2, 8)   # (num_blocks, block_size, kv_heads, head_dim)
    k, v = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    slots = torch.tensor([5 * 4 + 3, 0 * 4 + 0, 2 * 4 + 1])
    store_kvcache(k, v, k_cache, v_cache, slots)
    for t, (b, o) in enumerate([(5, 3), (0, 0), (2, 1)]):
        assert torch.equal(k_cache[b, o], k[t]) and torch.equal(v_cache[b, o], v[t])
    assert int((k_cache != 0).any(-1).any(-1).sum()) == 3

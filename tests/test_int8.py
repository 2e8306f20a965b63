"""kv_cache_dtype="int8": the quantizer against round-to-nearest, the kernel (interpreted) and the
reference on INT8 caches, the kernel compiled for sm_80 and sm_90 here, and the engine under
pressure against a roomy run with the same dtypes; INT8 tiers below a model-dtype device."""
import subprocess
import sys

import pytest
import torch

from conftest import assert_no_block_held, checked
from kernel import dequantize, paged_attention_ref, paged_attention_ref_int8, quantize, random_case
from kernel import store_kvcache_int8
from nanopaged import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def prompts(n, length=30):
    return [[(7 * t + 13 * i) % 250 + 1 for t in range(length + 3 * i)] for i in range(n)]


def test_quantize_is_round_to_nearest_with_a_float32_scale_per_row():
    """Each row: head_dim int8 values round(x / s), s = max|x| / 127 in float32, in the 4 bytes
    after them; a row of zeros stays zeros; dequantized, each value is within s / 2 of x."""
    x = torch.randn(3, 5, 2, 16) * torch.logspace(-3, 3, 5)[None, :, None, None]
    x[1, 2, 0] = 0.0
    q = quantize(x)
    assert q.dtype == torch.int8 and q.shape == (3, 5, 2, 20)
    scale = x.abs().amax(-1, keepdim=True) / 127
    want = torch.where(scale > 0, x / scale, 0.0).round()
    assert torch.equal(q[..., :16].float(), want)
    assert torch.equal(q[..., 16:].contiguous().view(torch.float32), scale.clamp(min=1e-30 / 127))
    assert q[..., :16].abs().max() == 127 and not q[1, 2, 0, :16].any()
    back = dequantize(q, torch.float32)
    assert back.shape == x.shape and ((back - x).abs() <= scale / 2 * (1 + 1e-6)).all()
    assert not back[1, 2, 0].any()


def test_quantize_keeps_finite_values_finite():
    """A row's scale comes from its finite values: an inf saturates to the largest code (+-127),
    a NaN becomes 0, and the finite values come back as in any row (within s / 2); float32's
    largest value comes back finite (scale at most its 1/128), within 1% of itself."""
    inf, nan, largest = float("inf"), float("nan"), torch.finfo(torch.float32).max
    x = torch.tensor([[1.0, inf, -2.0, 3.0], [1.0, -inf, nan, -3.0], [largest, -largest, 1, 0]])
    q = quantize(x)
    back = dequantize(q, torch.float32)
    assert back.isfinite().all()
    assert q[0, 1] == 127 and q[1, 1] == -127 and q[1, 2] == 0
    finite = x.isfinite()
    s = 3.0 / 127   # rows 0 and 1: their finite values' max |x| is 3
    assert ((back[:2] - x[:2]).abs()[finite[:2]] <= s / 2 * (1 + 1e-6)).all()
    assert torch.allclose(back[2, :2], x[2, :2], rtol=0.01)


def test_store_kvcache_int8_quantizes_into_exactly_the_given_slots():
    k, v = torch.randn(2, 3, 2, 16)
    k_cache, v_cache = torch.zeros(2, 4, 4, 2, 20, dtype=torch.int8)   # 4 blocks of 4 slots
    slots = torch.tensor([5, 14, 3])
    store_kvcache_int8(k, v, k_cache, v_cache, slots)
    for cache, x in ((k_cache, k), (v_cache, v)):
        flat = cache.view(16, 2, 20)
        assert torch.equal(flat[slots], quantize(x))
        others = [i for i in range(16) if i not in slots.tolist()]
        assert not flat[others].any()


@pytest.mark.parametrize("head_dim", [16, 64])
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("block_size", [4, 16])
def test_the_reference_on_int8_caches_is_attention_over_their_dequantized_values(block_size, group,
                                                                               head_dim):
    """The INT8 reference dequantizes the blocks it reads: exactly attention over the dequantized
    caches, and close to attention over the float caches they came from (INT8 costs accuracy, not
    much).
    The Triton kernel is held to it on INT8 caches in test_triton.py."""
    ctx_q = ((1, 1), (37, 1), (9, 9), (50, 13), (3 * block_size + 3, 7))
    q, k, v, *rest = random_case(block_size + group + head_dim, block_size, 2, group, head_dim,
                                 ctx_q)
    k8, v8 = quantize(k), quantize(v)
    ref = paged_attention_ref_int8(q, k8, v8, *rest)
    assert torch.equal(ref, paged_attention_ref(q, dequantize(k8, q.dtype), dequantize(v8, q.dtype),
                                                *rest))
    exact = paged_attention_ref(q, k, v, *rest)
    assert 0 < ((ref - exact).abs().max() / exact.abs().max()).item() < 0.05


COMPILE = """
import inspect, sys, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import kernel
arch, quantized = int(sys.argv[1]), sys.argv[2] == "int8"
names = list(inspect.signature(kernel.paged_attention_kernel.fn).parameters)
kv = "*i8" if quantized else "*bf16"
pointers = dict(out_ptr="*bf16", lse_ptr="*fp32", q_ptr="*bf16", k_cache_ptr=kv, v_cache_ptr=kv,
                k_scale_ptr="*fp32" if quantized else kv, v_scale_ptr="*fp32" if quantized else kv,
                block_tables_ptr="*i32", context_lens_ptr="*i32", query_start_loc_ptr="*i32",
                scale="fp32")
const = dict(NUM_SPLITS=1, QUANTIZED=quantized, GROUP=3, GROUP_PADDED=4, BLOCK_M=4, BLOCK_N=64,
             BLOCK_SIZE=16, HEAD_DIM=64, BLOCK_D=64)
signature = {n: pointers.get(n, "constexpr" if n in const else "i32") for n in names}
constexprs = {(names.index(n),): v for n, v in const.items()}
compiled = triton.compile(ASTSource(kernel.paged_attention_kernel, signature, constexprs),
                          target=GPUTarget("cuda", arch, 32))
print(len(compiled.asm["cubin"]))
"""


@pytest.mark.parametrize("arch", [80, 90])
def test_the_int8_kernel_compiles_to_a_cubin_for_sm80_and_sm90(arch):
    """triton.compile for a GPU target needs no GPU: the INT8 variant (bfloat16 queries, as on
    CUDA) builds a cubin for an A100 (sm_80) and an H100 (sm_90), beside the model-dtype one."""
    sizes = {}
    for kind in ("int8", "bf16"):
        run = subprocess.run([sys.executable, "-c", COMPILE, str(arch), kind], capture_output=True,
                             text=True, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": "."},
                             timeout=300)
        assert run.returncode == 0, run.stderr[-2000:]
        sizes[kind] = int(run.stdout.split()[-1])
    assert sizes["int8"] > 0 and sizes["bf16"] > 0 and sizes["int8"] != sizes["bf16"]


@pytest.mark.parametrize("pressure", ["swap", "recompute", "tiers"])
def test_int8_under_pressure_gives_the_tokens_of_a_roomy_int8_run(pressure):
    """INT8 everywhere: a swap, a recompute or a trip down the tiers and back copies a block with
    its scales, so the tokens are those of a run with room for everything."""
    want = [o.outputs[0].token_ids for o in
            LLM("random:tiny", block_size=4, num_blocks=96, kv_cache_dtype="int8")
            .generate(prompts(4), GREEDY)]
    pools = {"swap": dict(num_blocks=24, num_cpu_blocks=48, preemption_mode="swap"),
             "recompute": dict(num_blocks=24, preemption_mode="recompute"),
             "tiers": dict(num_blocks=24, num_cpu_blocks=8, num_disk_blocks=64)}[pressure]
    llm = checked(LLM("random:tiny", block_size=4, kv_cache_dtype="int8", **pools))
    for turn in range(2):   # the second time round, the prompts are found in the tiers
        assert [o.outputs[0].token_ids for o in llm.generate(prompts(4), GREEDY)] == want
    s = llm.stats()
    assert s["num_preemptions"] > 0 if pressure != "tiers" else s["num_loaded_blocks"] > 0
    assert all(c.dtype == torch.int8 for c in llm.kv_caches.values())
    assert_no_block_held(llm)


def test_int8_tiers_below_a_float_device_store_and_load_each_block_quantized():
    """offload_kv_cache_dtype="int8": host and disk hold INT8, the device float32. A block written
    down is the device's K/V quantized; loaded back it is that, dequantized; its bytes over each
    link are the INT8 block's."""
    llm = checked(LLM("random:tiny", block_size=4, num_blocks=16, num_cpu_blocks=4,
                      num_disk_blocks=32, offload_kv_cache_dtype="int8", async_copies=False))
    caches, sizes = llm.kv_caches, llm.copier.bytes_per_block
    assert caches["device"].dtype == torch.float32
    assert caches["host"].dtype == caches["disk"].dtype == torch.int8
    assert sizes["device"] == 2 * 2 * 4 * 2 * 16 * 4 and sizes["host"] == sizes["disk"] == 2 * 2 * 4 * 2 * 20
    writes, loads = [], []
    copy = llm.copier.copy

    def watched(src_tier, src, dst_tier, dst):
        before = caches[src_tier.name][:, :, src].clone()
        copy(src_tier, src, dst_tier, dst)
        after = caches[dst_tier.name][:, :, dst].clone()
        (writes if src_tier.name == "device" else loads).append((src_tier.name, before, after))

    llm.copier.copy = watched
    for turn in range(2):
        llm.generate(prompts(4), GREEDY)
    assert writes and any(name != "device" for name, _, _ in loads)
    for name, before, after in writes:
        assert torch.equal(after, quantize(before))
    for name, before, after in loads:
        if name != "device" and after.dtype == torch.float32:
            assert torch.equal(after, dequantize(before, torch.float32))
    s = llm.stats()
    moved = s["host_bytes_moved"] + s["disk_bytes_moved"]
    assert s["num_loaded_blocks"] > 0 and moved % sizes["host"] == 0
    assert_no_block_held(llm)


def test_int8_holds_more_blocks_in_the_same_memory():
    """The default pool (1 GiB on a CPU): INT8 holds 3.2x the blocks of float32 at head_dim 16
    (16 bytes and a 4-byte scale a row, against 64); at SmolLM2's 64, 3.76x (bench.py)."""
    num_blocks = {d: LLM("random:tiny", kv_cache_dtype=d).block_manager.num_blocks
                  for d in ("auto", "int8")}
    assert num_blocks["auto"] == 2**30 // (2 * 2 * 16 * 2 * 16 * 4)   # K, V; layers; block_size
    assert num_blocks["int8"] == 2**30 // (2 * 2 * 16 * 2 * 20)


@pytest.mark.parametrize("name", ["kv_cache_dtype", "offload_kv_cache_dtype"])
@pytest.mark.parametrize("value", ["fp8", "int4", None, torch.int8])
def test_a_bad_kv_cache_dtype_is_a_value_error_before_the_model_loads(monkeypatch, name, value):
    import nanopaged
    monkeypatch.setattr(nanopaged, "load_model", lambda *a: pytest.fail("the model loaded"))
    with pytest.raises(ValueError, match=name):
        LLM("random:tiny", **{name: value})

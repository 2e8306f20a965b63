"""GPU readiness without a GPU: the Triton kernel, compiled here for an A100 (sm_80) and an H100 or
H200 (sm_90) at the launch configurations the engine can choose, fits each GPU's shared memory.

What it teaches: compiling for a GPU needs no GPU. triton.compile runs the whole pipeline on the CPU
(Triton IR, GPU IR, LLVM IR, PTX, then ptxas to a cubin), and the compiled kernel's metadata says
how much shared memory one program needs (`metadata.shared`, in bytes). A GPU refuses to launch a
kernel that needs more than it has per block (Triton raises OutOfResources when it loads one);
this test sees that first. It also sees what the interpreted tests (tests/test_triton.py) cannot:
they run in float32 (the interpreter's tl.dot multiplies bfloat16's bit patterns: Triton issue
11584), so a dtype mismatch that only bfloat16 or float16 meets, such as tl.dot on two dtypes,
passes them; the compiler refuses it.

Which configurations: the launcher, paged_attention_triton, picks the kernel's constexprs, so the
test asks it: the kernel is swapped for a recorder, the launcher is called on small CPU tensors,
and each recorded call is specialized as JITFunction.run would specialize it on a GPU (dtypes,
16-byte alignment of pointers and integers, integers equal to 1) and compiled with the launcher's
options (none given: 4 warps, 3 pipeline stages). The shared memory a program needs is set by its
tiles and their dtypes (712 compiles at five tile combinations, over every group and block size,
KV heads 1-8, splits 1, 2, 16 and max_query_len 2-300, gave one number per combination and GPU);
every tile-and-dtype combination is compiled, 48 per GPU:

    q dtype (float32, bfloat16, float16) x cache dtype (the model's, int8) x decode (BLOCK_M * 16
    rows) or prefill (64 rows) x head_dim (64: BLOCK_N 64, 128: BLOCK_N 32) x one split or several
    (partials in float32)

and the rest rides along, rotated so that each value meets many tile combinations: group 1 .. 8
(each once in every dtype pair, starting one later per pair), block_size 1, 2, .. 64 (in turn),
splits 2 or 16 (by dtype pair), KV heads 1, 2, 4, 8 (by dtype pair: INT8 rows of head_dim + 4
bytes are 16-byte aligned only for some). test_the_cases_cover_every_value checks that.

    python tests/test_compile.py --arch 90      compiles the 48 for sm_90 and prints each one's
                                                shared memory against the limit (the tests run it;
                                                the largest, 98432 bytes: float32 prefill, 128)
    python tests/test_compile.py --arch 90 --variant no-dequant-cast     a broken kernel, refused

Read in order: the GPUs' limits; the configurations; one compile; the broken variants; the tests;
the command line.
"""
import argparse
import ast
import importlib.util
import inspect
import itertools
import json
import os
import subprocess
import sys
import tempfile

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)   # (as a script, tests/ is first on the path, not the repository)

import kernel  # noqa: E402

triton = pytest.importorskip("triton")   # (no Triton on this platform: nothing to compile)
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.runtime.jit import create_function_from_signature  # noqa: E402

# ----------------------------------------------------------------------------------------------
# The GPUs: the shared memory one block may use (the opt-in maximum, which Triton asks for when a
# kernel needs over 48 KB: cudaDevAttrMaxSharedMemoryPerBlockOptin)

SHARED_MEMORY_LIMIT = {
    80: 166912,   # A100: 163 KB of the SM's 164 KB
    90: 232448,   # H100, H200: 227 KB of the SM's 228 KB
}
NUM_WARPS = 4   # the launcher passes no num_warps: Triton's default

# ----------------------------------------------------------------------------------------------
# The configurations: the launcher's own choices, recorded

Q_DTYPES = (torch.float32, torch.bfloat16, torch.float16)   # LLM(dtype=...); bfloat16 on CUDA
BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64)


def launch_cases():
    """The 48 cases, one per tile-and-dtype combination, each a dict of what the engine sets:
    q dtype, int8 cache or not, max_query_len, head_dim, num_kv_splits, group, block_size and
    num_kv_heads (the last four rotated as the module docstring says)."""
    cases = []
    dtype_pairs = itertools.product(Q_DTYPES, (False, True))
    tiles = list(itertools.product((1, 16), (64, 128), (False, True)))   # 8 per dtype pair
    for pair, (dtype, int8) in enumerate(dtype_pairs):
        for j, (max_query_len, head_dim, split) in enumerate(tiles):
            i = pair * len(tiles) + j
            cases.append(dict(dtype=dtype, int8=int8, max_query_len=max_query_len,
                              head_dim=head_dim, num_kv_splits=(2, 16)[pair % 2] if split else 1,
                              group=1 + (j + pair) % 8, block_size=BLOCK_SIZES[i % 7],
                              num_kv_heads=(1, 2, 4, 8)[pair % 4]))
    return cases


class Recorder:
    """Stands in for paged_attention_kernel: `[grid](*args, **kwargs)` keeps the call."""

    def __init__(self):
        self.calls = []   # (args, kwargs) of each launch

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((args, kwargs))


def record_launch(case):
    """The launcher's kernel call for a case: (args, kwargs), on small CPU tensors. Two sequences:
    the longest new-token count max_query_len, and a decode."""
    ctx_q = ((3 * case["block_size"] + 37, case["max_query_len"]), (11, 1))
    q, k_cache, v_cache, *rest = kernel.random_case(0, case["block_size"], case["num_kv_heads"],
                                                    case["group"], case["head_dim"], ctx_q,
                                                    case["dtype"])
    if case["int8"]:
        k_cache, v_cache = kernel.quantize(k_cache), kernel.quantize(v_cache)
    recorder = Recorder()
    real = kernel.paged_attention_kernel
    kernel.paged_attention_kernel = recorder
    try:
        kernel.paged_attention_triton(q, k_cache, v_cache, *rest,
                                      max_query_len=case["max_query_len"],
                                      num_kv_splits=case["num_kv_splits"])
    finally:
        kernel.paged_attention_kernel = real
    [call] = recorder.calls
    return call

# ----------------------------------------------------------------------------------------------
# One compile: the recorded call specialized as a launch on the GPU would be, then compiled


def compile_call(fn, args, kwargs, arch):
    """Compile fn (a JITFunction) for sm_<arch> as fn[grid](*args, **kwargs) would on that GPU.
    Returns what the test reads: the constexprs, shared memory (bytes), warps, the cubin's size,
    and the compiler's error (None if it built)."""
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)   # needs no driver: the target is given
    # JITFunction.run's own two steps: bind and specialize the arguments, then pack them
    bind = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = bind(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization,
                                                          options)
    names = [p.name for p in fn.params]
    named = {names[path[0]]: value for path, value in constexprs.items()}   # (keys: (index,))
    record = dict(arch=arch, constexprs=named, signature=signature, shared=None, num_warps=None,
                  cubin_bytes=0, error=None)
    try:
        compiled = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target,
                                  options=options.__dict__)
    except Exception as e:   # the compiler's refusal is the finding: kept, not raised
        message = str(e).strip().splitlines()[-1]   # (the last line: those above quote the source)
        record["error"] = f"{type(e).__name__}: {message}"
        return record
    record.update(shared=compiled.metadata.shared, num_warps=compiled.metadata.num_warps,
                  cubin_bytes=len(compiled.asm.get("cubin", b"")))
    return record

# ----------------------------------------------------------------------------------------------
# Broken variants: kernels that cannot run on the GPU, to show the check sees them
# (each is the real kernel's source with one edit, or the real kernel with one constexpr changed)

# no-dequant-cast: tl.dot(q, k) with q in bfloat16 or float16 and k dequantized to float32, which
# the compiler refuses; in float32, the one dtype the interpreted tests run, q and k agree and the
# kernel is right, so they pass it
DEQUANT_CAST = ".to(q.dtype)\n            v = (v * tl.load"
VARIANTS = {
    "real": "the kernel as kernel.py has it",
    "no-dequant-cast": "K dequantized to float32 and left so (no .to(q.dtype))",
    "wide-tile": "BLOCK_N 8 times the launcher's (256 for head_dim 128): K and V tiles too big",
}


def kernel_variant(name, folder):
    """The JITFunction of a variant (wide-tile: the real one; its tile is changed at the call)."""
    if name != "no-dequant-cast":
        return kernel.paged_attention_kernel
    source = inspect.getsource(kernel.paged_attention_kernel.fn)
    assert source.count(DEQUANT_CAST) == 1, "kernel.py's K dequantization is not where it was"
    source = source.replace(DEQUANT_CAST, "\n            v = (v * tl.load")
    path = os.path.join(folder, "broken_kernel.py")
    with open(path, "w") as f:   # Triton reads a kernel's source from its file
        f.write("import triton\nimport triton.language as tl\njit = triton.jit\n\n\n" + source)
    spec = importlib.util.spec_from_file_location("broken_kernel", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.paged_attention_kernel


def compile_cases(arch, variant="real", cases=None):
    """Every case compiled for sm_<arch>: a list of records (compile_call's, with the case)."""
    records = []
    with tempfile.TemporaryDirectory() as folder:
        fn = kernel_variant(variant, folder)
        for case in launch_cases() if cases is None else cases:
            args, kwargs = record_launch(case)
            if variant == "wide-tile":
                kwargs = dict(kwargs, BLOCK_N=8 * kwargs["BLOCK_N"])
            record = compile_call(fn, args, kwargs, arch)
            record["case"] = dict(case, dtype=str(case["dtype"]).removeprefix("torch."))
            records.append(record)
    return records


def matches(case, rule):
    """Does the case have KEY=VALUE (dtype by name: dtype=bfloat16; others as Python: int8=True)?"""
    key, value = rule.split("=")
    if key == "dtype":
        return case["dtype"] == getattr(torch, value)
    return case[key] == ast.literal_eval(value)


def describe(case):
    """A case in one line, as the table prints it."""
    return (f"{str(case['dtype']).removeprefix('torch.')} {'int8' if case['int8'] else 'model'} "
            f"max_query_len={case['max_query_len']} head_dim={case['head_dim']} "
            f"splits={case['num_kv_splits']} group={case['group']} block={case['block_size']} "
            f"kv_heads={case['num_kv_heads']}")


def fits(record):
    """The check: built, and its shared memory within the GPU's limit per block."""
    return record["error"] is None and record["shared"] <= SHARED_MEMORY_LIMIT[record["arch"]]


def misfits(records):
    """A line for each record that does not fit: its case, and its error or shared memory."""
    return [f"{describe(r['case'])}: {r['error'] or r['shared']}" for r in records if not fits(r)]

# ----------------------------------------------------------------------------------------------
# The tests: each compiles in a subprocess, because this one runs Triton interpreted (conftest sets
# TRITON_INTERPRET=1, and an interpreted kernel is no JITFunction)


def start_script(arch, variant, folder, where=()):
    """This file as a script for one GPU, started (the cases matching every KEY=VALUE of where):
    the process, and the JSON file it writes its records to."""
    path = folder / f"compile-{arch}-{variant}.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    command = [sys.executable, __file__, "--arch", str(arch), "--variant", variant,
               "--json", str(path)]
    for rule in where:
        command += ["--where", rule]
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    return process, path


def finish_script(process, path):
    """The records of a started script, once it has ended."""
    _, stderr = process.communicate(timeout=600)
    assert process.returncode == 0, stderr[-3000:]
    return json.loads(path.read_text())


def run_script(arch, variant, folder, where=()):
    """start_script, then finish_script: the records."""
    return finish_script(*start_script(arch, variant, folder, where))


@pytest.fixture(scope="module")
def real_records(tmp_path_factory):
    """{arch: records} of the real kernel: both GPUs compiled at once, in two processes (about
    a minute each on a CPU core; Triton's cache in ~/.triton makes a second run seconds)."""
    folder = tmp_path_factory.mktemp("compile")
    started = {arch: start_script(arch, "real", folder) for arch in SHARED_MEMORY_LIMIT}
    return {arch: finish_script(*run) for arch, run in started.items()}


def test_the_cases_cover_every_value():
    """The 48 cases hold every tile-and-dtype combination once, and every group 1-8, block size
    1-64, split count (1, 2, 16) and KV head count (1, 2, 4, 8) the rotation promises."""
    cases = launch_cases()
    tiles = {(c["dtype"], c["int8"], c["max_query_len"] > 1, c["head_dim"], c["num_kv_splits"] > 1)
             for c in cases}
    assert len(cases) == len(tiles) == 3 * 2 * 2 * 2 * 2
    assert {c["group"] for c in cases} == set(range(1, 9))
    assert {c["block_size"] for c in cases} == set(BLOCK_SIZES)
    assert {c["num_kv_splits"] for c in cases} == {1, 2, 16}
    assert {c["num_kv_heads"] for c in cases} == {1, 2, 4, 8}
    # each group in decodes and prefills, at both head_dims, split and not
    for key in ("max_query_len", "head_dim"):
        values = {c[key] for c in cases}
        assert {(c["group"], c[key]) for c in cases} == set(itertools.product(range(1, 9), values))
    assert len({(c["group"], c["num_kv_splits"] > 1) for c in cases}) == 16


@pytest.mark.parametrize("arch", [80, 90])
def test_every_launch_configuration_compiles_and_fits_shared_memory(arch, real_records):
    """At each of the 48 cases, the launcher's constexprs compile to a cubin for sm_<arch> with 4
    warps, and the program's shared memory is within the GPU's limit per block."""
    records = real_records[arch]
    assert len(records) == len(launch_cases())
    bad = misfits(records)
    assert not bad, (f"{len(bad)} do not build or pass sm_{arch}'s {SHARED_MEMORY_LIMIT[arch]} "
                     "bytes per block:\n" + "\n".join(bad))
    assert all(r["cubin_bytes"] > 0 and r["num_warps"] == NUM_WARPS for r in records)
    # the launcher's tiles, as the docstring says: 16 or 64 rows, BLOCK_N by head_dim
    for r in records:
        c, k = r["case"], r["constexprs"]
        assert k["BLOCK_M"] * k["GROUP_PADDED"] == (16 if c["max_query_len"] == 1 else 64)
        assert (k["BLOCK_N"], k["BLOCK_D"]) == ((64, 64) if c["head_dim"] == 64 else (32, 128))


def test_a_tile_over_the_limit_is_flagged(tmp_path):
    """The real kernel with BLOCK_N 8 times the launcher's (256), at the bfloat16 prefill with
    head_dim 128, builds but needs more than sm_90's shared memory: the check flags it."""
    records = run_script(90, "wide-tile", tmp_path, ["dtype=bfloat16", "int8=False",
                                                     "max_query_len=16", "head_dim=128",
                                                     "num_kv_splits=1"])
    [r] = records
    assert r["constexprs"]["BLOCK_N"] == 8 * 32 and r["error"] is None
    assert r["shared"] > SHARED_MEMORY_LIMIT[90], r["shared"]
    assert misfits(records) == [f"{describe(r['case'])}: {r['shared']}"]


def test_a_dtype_error_the_interpreted_tests_pass_is_refused(tmp_path, monkeypatch):
    """Without the cast after K's dequantization, the interpreted kernel matches the reference on
    an INT8 cache in float32, as tests/test_triton.py checks it; compiled for sm_90, the bfloat16
    and float16 INT8 cases are refused (tl.dot of two dtypes) and the check flags exactly them."""
    broken = kernel_variant("no-dequant-cast", str(tmp_path))
    monkeypatch.setattr(kernel, "paged_attention_kernel", broken)
    q, k_cache, v_cache, *rest = kernel.random_case(1, 4, 2, 3, 64, ((13, 1), (20, 5)))
    case = (q, kernel.quantize(k_cache), kernel.quantize(v_cache), *rest)
    out = kernel.paged_attention_triton(*case, max_query_len=5)
    ref = kernel.paged_attention_ref_int8(*case)
    assert ((out - ref).abs().max() / ref.abs().max()).item() < 1e-4
    monkeypatch.undo()

    records = run_script(90, "no-dequant-cast", tmp_path, ["int8=True", "max_query_len=1",
                                                           "head_dim=64"])
    assert len(records) == 3 * 2   # q dtypes x split or not
    for r in records:
        refused = r["case"]["dtype"] != "float32"
        assert (r["error"] is not None) == refused, (r["case"], r["error"])
        if refused:
            assert "Both operands must be same dtype" in r["error"]
    assert len(misfits(records)) == 4   # bfloat16 and float16, split and not

# ----------------------------------------------------------------------------------------------
# The command line: compile, print a table, write the records as JSON


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, choices=sorted(SHARED_MEMORY_LIMIT), required=True,
                        help="80: A100; 90: H100, H200")
    parser.add_argument("--variant", choices=sorted(VARIANTS), default="real",
                        help="; ".join(f"{k}: {v}" for k, v in VARIANTS.items()))
    parser.add_argument("--where", action="append", default=[], metavar="KEY=VALUE",
                        help="only the cases with this value: int8=True, dtype=float16, ...")
    parser.add_argument("--json", help="write the records here")
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("unset TRITON_INTERPRET: an interpreted kernel cannot be compiled")
    cases = [c for c in launch_cases() if all(matches(c, rule) for rule in args.where)]
    records = compile_cases(args.arch, args.variant, cases)
    limit = SHARED_MEMORY_LIMIT[args.arch]
    print(f"sm_{args.arch}, variant {args.variant}: shared memory per program, limit {limit} bytes")
    print(f"{'q dtype':>8} {'cache':>5} {'max_q':>5} {'dim':>4} {'splits':>6} {'group':>5} "
          f"{'block':>5} {'kv':>3} {'shared':>7} {'fits':>5}")
    for r in records:
        c = r["case"]
        print(f"{c['dtype']:>8} {'int8' if c['int8'] else 'model':>5} {c['max_query_len']:5} "
              f"{c['head_dim']:4} {c['num_kv_splits']:6} {c['group']:5} {c['block_size']:5} "
              f"{c['num_kv_heads']:3} {r['shared'] or 0:7} {str(fits(r)):>5}"
              + (f"  {r['error'][:80]}" if r["error"] else ""))
    print(f"{sum(map(fits, records))} of {len(records)} fit; largest shared memory: "
          f"{max((r['shared'] or 0) for r in records)} bytes")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()

"""
bench.py: the claims of paging, measured on this machine beside baselines, in six experiments
(memory, throughput, prefix, kv_dtype, priority, multiturn): a table and a conclusion.

    python bench.py                    every experiment, the default model
    python bench.py --quick            smaller workloads, a few minutes (what fresh-check runs)
    python bench.py --only prefix      one experiment; --json FILE writes every figure
"""
import json
import platform
import random
import time
import timeit
from statistics import fmean as mean

import torch
from rich.console import Console
from rich.table import Column, Table
from transformers import ContinuousBatchingConfig, GenerationConfig

import nanopaged
from model import load_hf
from nanopaged import LLM, SamplingParams, run_arrivals

console = Console(highlight=False)
results = {}   # experiment -> its figures, for --json

def report(name, title, columns, rows, conclusion):
    """Print an experiment's table and conclusion; keep its figures for --json."""
    figures = [Column(c, justify="right") for c in columns[1:]]   # the first column names a row
    t = Table(columns[0], *figures, title=f"{name}: {title}", title_justify="left")
    for row in rows:
        t.add_row(*[f"{x:.2f}" if isinstance(x, float) else str(x) for x in row])
    console.print(t, conclusion + "\n", style="bold")
    results[name] = {"columns": columns, "rows": rows, "conclusion": conclusion}

# ----------------------------------------------------------------------------------------------
# Workloads: prompts cut from a text (nanopaged.py's own source), or random ids for random weights

def corpus(llm):
    if llm.tokenizer is None:   # random weights: random token ids, the same every run
        return random.Random(0).choices(range(llm.model.config.vocab_size), k=20000)
    with open(nanopaged.__file__, encoding="utf-8") as f:
        return llm.tokenizer.encode(f.read(), add_special_tokens=False)

def mixed_workload(llm, num_requests, seed=0, sample_every=0):
    """Prompts of 16-256 tokens, greedy outputs of 8-128 (eos off: every engine makes as many);
    sample_every: every so many, n=2 samples instead."""
    rng = random.Random(seed)
    text = corpus(llm)
    prompts, params = [], []
    for i in range(num_requests):
        n = rng.randint(16, 256)
        start = rng.randrange(len(text) - n)
        prompts.append(text[start:start + n])
        sample = sample_every and i % sample_every == 0
        params.append(SamplingParams(temperature=0.8 if sample else 0, n=2 if sample else 1,
                                     max_tokens=rng.randint(8, 128), ignore_eos=True, seed=i))
    return prompts, params

def engine(args, **kwargs):   # an LLM on the command line's model, device and kv_cache_dtype
    return LLM(args.model, device=args.device, **{"kv_cache_dtype": args.kv_cache_dtype, **kwargs})

def timed(f, *args):   # (f(*args), the seconds it took)
    t0 = time.perf_counter()
    return f(*args), time.perf_counter() - t0

def gemm_rate(device, dtype):   # FLOP/s, the machine's best: the fastest of 5 matmuls of 2048²
    a = torch.randn(2048, 2048, device=device, dtype=dtype)
    return 2 * 2048 ** 3 / min(timeit.repeat(lambda: (a @ a)[0, 0].item(), number=1, repeat=5))

def run(llm, prompts, params):
    """Requests through the engine: (each output's token ids, seconds, the pool after each step)."""
    seen = []

    def watch(step):
        seen.append(dict(step.stats, used_blocks=llm.block_manager.num_used_blocks(),
                         running_requests=len(llm.scheduler.running)))

    llm.on_step.append(watch)
    outs, seconds = timed(llm.generate, prompts, params)
    llm.on_step.remove(watch)   # watch refers to llm: left in, the engine would never be freed
    return [[c.token_ids for c in o.outputs] for o in outs], seconds, seen

@torch.inference_mode()
def hf_generate(hf, prompts, params, size):
    """transformers' generate on static batches of size: left-padded, each to its longest output."""
    for i in range(0, len(prompts), size):
        batch, lengths = prompts[i:i + size], [p.max_tokens for p in params[i:i + size]]
        width = max(map(len, batch))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch], device=hf.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch]).to(hf.device)
        out = hf.generate(ids, attention_mask=mask, max_new_tokens=max(lengths), do_sample=False,
                          pad_token_id=0, eos_token_id=None)
        yield from (row[width:width + n].tolist() for row, n in zip(out, lengths))

@torch.inference_mode()
def hf_continuous(hf, prompts, params, num_blocks):
    """transformers' continuous batching as generate_batch runs it, each request to its length."""
    cb = ContinuousBatchingConfig(page_size=16, num_blocks=num_blocks, max_batch_tokens=2048,
                                  auto_switch_to_flash=False)   # nanopaged's budget; load_hf's sdpa
    greedy = GenerationConfig(do_sample=False, eos_token_id=-1)   # eos -1: none, run to length
    with hf.continuous_batching_context_manager(greedy, continuous_batching_config=cb) as manager:
        ids = [manager.add_request(p, max_new_tokens=q.max_tokens) for p, q in zip(prompts, params)]
        done = {r.request_id: r.generated_tokens for _, r in zip(ids, manager)}   # as they end
    return [done[i] for i in ids]

# ----------------------------------------------------------------------------------------------
# The experiments

def memory(args):
    """Occupancy, waste and requests that fit a KV budget: paged (block sizes 8, 16, 32) against
    a block of max_model_len per request, on the mixed workload (every fourth request n=2).
    Random tiny weights: the accounting is the same."""
    max_model_len = 1024
    slots = args.num_requests // 4 * max_model_len   # the budget: a quarter of the requests
    rows = []
    for size in (8, 16, 32, max_model_len):
        llm = LLM("random:tiny", block_size=size, max_model_len=max_model_len,
                  num_blocks=slots // size)
        _, _, seen = run(llm, *mixed_workload(llm, args.num_requests, sample_every=4))
        wasted = [s["used_blocks"] * size * (1 - s["token_occupancy_perc"]) for s in seen]
        rows.append(["contiguous" if size == max_model_len else "paged", size,
                     mean(s["token_occupancy_perc"] for s in seen), round(mean(wasted)),
                     max(s["running_requests"] for s in seen)])
    report("memory", f"{args.num_requests} requests, a KV budget of {slots} token slots",
           ["layout", "block_size", "token occupancy", "slots wasted", "requests at once"], rows,
           f"At block_size 16, {rows[1][2]:.0%} of the reserved slots hold tokens, against "
           f"{rows[-1][2]:.0%} when each request reserves max_model_len ({max_model_len}) up "
           f"front: {rows[1][4] / rows[-1][4]:.1f}x as many requests run at once in the budget.")

def throughput(args):
    """The same greedy requests (eos off) through nanopaged and three transformers baselines."""
    # room for every request at once: mixed_workload's prompts and outputs at their longest
    num_blocks = args.num_requests * (256 + 128) // 16
    llm = engine(args, num_blocks=num_blocks)
    prompts, params = mixed_workload(llm, args.num_requests)
    ours, seconds, _ = run(llm, prompts, params)
    # the matmul floor: the workload's linear layers (2 FLOPs a weight a token computed; the
    # vocabulary's for each token sampled) at the machine's best GEMM rate
    s, num_tokens = llm.stats(), sum(p.max_tokens for p in params)
    computed = s["num_prefill_tokens_computed"] + num_tokens - len(prompts)   # (not the last)
    weights = sum(p.numel() for p in llm.model.layers.parameters() if p.dim() == 2)   # linears'
    flops = 2 * (weights * computed + llm.model.lm_head.weight.numel() * num_tokens)
    floor = flops / gemm_rate(llm.device, llm.dtype)
    hf = load_hf(args.model, llm.seed)[0].to(llm.device)   # the weights nanopaged runs
    rows = [("nanopaged", seconds, num_tokens / seconds, 1.0, 1.0, floor / seconds)]
    for name, generate, arg in (("batch 1", hf_generate, 1), ("batch 8", hf_generate, 8),
                                ("continuous batching", hf_continuous, num_blocks)):
        theirs, hf_seconds = timed(lambda: list(generate(hf, prompts, params, arg)))
        rows.append((f"transformers, {name}", hf_seconds, num_tokens / hf_seconds,
                     hf_seconds / seconds, mean(t == o[0] for t, o in zip(theirs, ours)),
                     floor / hf_seconds))
    report("throughput", f"{len(prompts)} mixed requests, {llm.device}, {llm.dtype}",
           ["engine", "seconds", "output tokens/s", "nanopaged's speedup", "same greedy tokens",
            "of the matmul floor"], rows,
           f"nanopaged is {rows[3][3]:.1f}x as fast as transformers' continuous batching, "
           f"{rows[2][3]:.1f}x static batches of 8, {rows[1][3]:.1f}x one at a time; it runs at "
           f"{rows[0][5]:.0%} of the matmul floor ({flops / 1e12:.2f} TFLOP of linear layers at "
           f"{flops / floor / 1e9:.0f} GFLOP/s, this machine's best).")

def prefix(args):
    """A system prompt of 400 tokens (25 full blocks) before each 12-token question; a request
    arrives every other step. TTFT: from add_requests to the first token."""
    rows = []
    for caching in (True, False):
        # 412 + 16 tokens: 27 blocks a request, room for all
        llm = engine(args, enable_prefix_caching=caching, num_blocks=args.num_requests * 27)
        text = corpus(llm)
        prompts = [text[:400] + text[1000 + 37 * i:1012 + 37 * i] for i in range(args.num_requests)]
        params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        request_ids = run_arrivals(llm, [(2 * i, [p], params) for i, p in enumerate(prompts)])
        s = llm.stats()
        rows.append((f"caching {'on' if caching else 'off'}", s["num_prefill_tokens_computed"],
                     s["prefix_cache_hit_rate"], mean(llm.output(r).ttft for r in request_ids)))
    report("prefix", f"{len(prompts)} requests of 412 tokens sharing 400, one every other step",
           ["prefix caching", "prefill tokens computed", "hit rate", "mean ttft (s)"], rows,
           f"With prefix caching the engine computes {1 - rows[0][1] / rows[1][1]:.0%} fewer "
           f"prompt tokens and the first token comes {rows[1][3] / rows[0][3]:.1f}x sooner.")

def kv_dtype(args):
    """The KV cache in the model's dtype and in INT8 (kv_cache_dtype): bytes per block; 32 prompts
    (--quick: 8) in the memory of a quarter of their blocks in the model's dtype: requests at
    once, tokens/s; accuracy against the model's dtype (32 greedy tokens, eos off): the first
    token's top-1 agreement and mean KL divergence, the outputs identical, the mean position where
    the others first differ."""
    llm = engine(args, kv_cache_dtype="auto", num_blocks=1)
    text, rng = corpus(llm), random.Random(3)
    starts = rng.sample(range(len(text) - 256), args.num_requests)
    prompts = [text[i:i + rng.randint(32, 256)] for i in starts]
    greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    need = sum(nanopaged.max_blocks_needed(llm, len(p), greedy) for p in prompts)
    memory = need // 4 * llm.links.bytes_per_block["device"]   # a quarter of the blocks, in bytes
    rows, want = [], None
    for dtype in ("auto", "int8"):
        bytes_per_block = engine(args, kv_cache_dtype=dtype, num_blocks=1).links.bytes_per_block
        llm = engine(args, kv_cache_dtype=dtype, num_blocks=memory // bytes_per_block["device"])
        outs, seconds, seen = run(llm, prompts, [greedy] * len(prompts))
        first = []   # each prompt's first-token log-probs, as the model hands its logits on
        with llm.model.register_forward_hook(lambda m, a, out: first.append(out.log_softmax(-1))):
            for prompt in prompts:   # (a step each: one row of logits each)
                llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1))
        first = torch.cat(first)   # (the hook is removed as the with block ends)
        want = want or (first, outs)
        differ = [next(i for i, (a, b) in enumerate(zip(o[0], w[0])) if a != b)
                  for o, w in zip(outs, want[1]) if o != w]
        rows.append((dtype if dtype == "int8" else str(llm.dtype)[6:],
                     bytes_per_block["device"], max(s["running_requests"] for s in seen),
                     greedy.max_tokens * len(prompts) / seconds,   # (eos off: all of them)
                     (first.argmax(-1) == want[0].argmax(-1)).float().mean().item(),
                     f"{(want[0].exp() * (want[0] - first)).sum(-1).mean().item():.4f}",
                     mean(o == w for o, w in zip(outs, want[1])), mean(differ or [float("nan")])))
    report("kv_dtype", f"{len(prompts)} prompts, {memory / 2**20:.0f} MiB of KV cache",
           ["kv_cache_dtype", "bytes/block", "at once", "tokens/s", "top-1", "KL", "identical",
            "differ at"], rows,
           f"INT8 stores {rows[0][1] / rows[1][1]:.2f}x the blocks in the same memory, runs "
           f"{rows[1][2] / rows[0][2]:.1f}x the requests at once at {rows[1][3] / rows[0][3]:.2f}x "
           f"the tokens/s; {rows[1][6]:.0%} of its greedy outputs are identical.")

def priority(args):
    """Short interactive requests (16-32 tokens, 8 out), one every other step, among long batch
    requests queued at once (128-256 tokens, 64 out), twice as many as the pool holds, so that it
    preempts: first come first served; by priority (interactive 0, batch 1); and with aging. The
    interactive requests' TTFT; the longest a batch request waited for its first token."""
    num_batch, num_interactive = (6, 8) if args.quick else (12, 24)
    text, rng = corpus(engine(args, num_blocks=1)), random.Random(5)
    starts = rng.sample(range(len(text) - 256), num_batch + num_interactive)
    prompts = [text[i:i + rng.randint(*(128, 256) if k < num_batch else (16, 32))]
               for k, i in enumerate(starts)]
    long, short = (SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (64, 8))
    policies = {"fcfs": {}, "priority": dict(scheduling_policy="priority"),
                "priority, aging 4": dict(scheduling_policy="priority", priority_aging_steps=4)}
    rows, want = [], None
    for name, policy in policies.items():
        llm = engine(args, num_blocks=num_batch // 2 * (256 + 64) // 16, **policy)
        # the batch requests at step 0 (priority 1; under fcfs all are 0), then the interactive
        arrivals = [(0, prompts[:num_batch], long, [int(bool(policy))] * num_batch)]
        arrivals += [(2 * i, [p], short, [0]) for i, p in enumerate(prompts[num_batch:])]
        outs, seconds = timed(lambda: [llm.output(r) for r in run_arrivals(llm, arrivals)])
        ttft = sorted(o.ttft for o in outs[num_batch:])
        tokens = [o.outputs[0].token_ids for o in outs]
        want = want or tokens
        rows.append((name, mean(ttft), ttft[int(0.9 * len(ttft))],
                     max(o.ttft for o in outs[:num_batch]), llm.num_generated_tokens / seconds,
                     mean(t == w for t, w in zip(tokens, want))))
    report("priority", f"{num_interactive} interactive requests among {num_batch} batch requests",
           ["policy", "ttft mean", "ttft p90", "batch: longest ttft", "tokens/s", "same tokens"],
           rows, f"By priority the interactive requests' first token comes "
           f"{rows[0][1] / rows[1][1]:.1f}x sooner than first come first served ("
           f"{rows[0][1] / rows[2][1]:.1f}x with aging, which brings the batch requests' longest "
           f"wait from {rows[1][3]:.2f} to {rows[2][3]:.2f} s).")

def multiturn(args):
    """Chats, each turn the whole history and a new 64-token message (16 tokens back), one request
    at a time, the chats in turn, in a device pool of two histories; the tiers below it; then slow
    links, emulated (tier_gbps), with copies that block, then in the background, written ahead.
    On a CPU the device is host memory too, and the disk file may sit in the page cache: unslowed,
    both links are memory copies."""
    num_chats, num_turns = (4, 4) if args.quick else (8, 6)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    num_blocks = 2 * (num_turns * 80 + 15) // 16   # two chats' last turns
    quarter = num_chats * num_blocks // 8   # host blocks for a quarter of the chats
    tiers = dict(num_cpu_blocks=quarter, num_disk_blocks=4 * num_blocks)
    sizes = engine(args, num_blocks=1, offload_kv_cache_dtype="int8").links.bytes_per_block
    int8_more = sizes["device"] / sizes["host"]   # INT8 host blocks in a model-dtype one's bytes
    configs = {"device only": {}, "+ host": dict(num_cpu_blocks=num_chats * num_blocks),
               "+ 1/4 host": dict(num_cpu_blocks=quarter),
               "+ 1/4 host in INT8": dict(num_cpu_blocks=int(quarter * int8_more),
                                          offload_kv_cache_dtype="int8"),
               "+ 1/4 host, disk": tiers,
               "slow links: blocking": dict(tiers, async_copies=False),
               "slow links: write-ahead": tiers}   # async_copies (the default) writes ahead
    engine(args, num_blocks=num_blocks).generate([[1] * 64])  # warm-up
    rows, want, gbps = [], None, None
    for name, pools in configs.items():
        slow = dict(tier_gbps=gbps) if name.startswith("slow") else {}
        llm = engine(args, num_blocks=num_blocks, **pools, **slow)
        text, chats, ttft = corpus(llm), [[] for _ in range(num_chats)], []
        t0 = time.perf_counter()
        for i in range(num_turns * num_chats):   # a chat's new message, then the reply
            start = 997 * i % (len(text) - 64)
            chats[i % num_chats] += text[start:start + 64]
            out = llm.generate([chats[i % num_chats]], params)[0]
            chats[i % num_chats] += out.outputs[0].token_ids
            ttft.append(out.ttft)
        seconds = time.perf_counter() - t0
        s = llm.stats()
        # links beside a GPU: a block over PCIe in 4 tokens' compute, over NVMe in 12 (recompute:
        # 16), scaled to this machine: the device-only run's seconds a token computed
        per_token = seconds / (s["num_prefill_tokens_computed"] + s["num_generated_tokens"])
        gbps = gbps or {t: llm.links.bytes_per_block["device"] / (k * per_token) / 1e9
                        for t, k in (("host", 4), ("disk", 12))}
        below = [s[f"{t}_prefix_cache_hits"] for t in ("host", "disk")]   # tokens found below
        hits = [s["prefix_cache_hits"] - sum(below), *below]
        rates = " ".join(f"{h / s['prefix_cache_queries']:.0%}" for h in hits)
        want = want or chats
        rows.append((name, s["num_prefill_tokens_computed"], rates, mean(ttft),
                     sorted(ttft)[int(0.9 * len(ttft))], s["num_generated_tokens"] / seconds,
                     s["copy_wait_seconds"], chats == want))
    r = {row[0]: row for row in rows}
    report("multiturn", f"{num_chats} chats of {num_turns} turns, {num_blocks} device blocks",
           ["tiers", "prefill computed", "hits: device host disk", "ttft mean", "ttft p90",
            "tokens/s", "waited (s)", "same"], rows,
           f"With a host tier {1 - r['+ host'][1] / rows[0][1]:.0%} fewer prompt tokens are "
           f"computed and the first token comes {rows[0][3] / r['+ host'][3]:.1f}x sooner, "
           f"{1 - r['+ 1/4 host in INT8'][1] / rows[0][1]:.0%} with a quarter of its memory in "
           f"INT8. Over links emulated (tier_gbps) as PCIe and NVMe beside a GPU (host "
           f"{gbps['host']:.3g}, disk {gbps['disk']:.3g} GB/s), copies in the background, written "
           f"ahead, bring the first token {r['slow links: blocking'][3] / rows[-1][3]:.1f}x "
           f"sooner, with {rows[-1][5] / r['slow links: blocking'][5]:.1f}x the tokens/s.")

EXPERIMENTS = {f.__name__: f for f in (memory, throughput, prefix, kv_dtype, priority, multiturn)}

if __name__ == "__main__":
    p = nanopaged.ArgumentParser(description="nanopaged benchmark: the claims of paging, measured")
    p.add_argument("--quick", action="store_true", help="smaller workloads (a few minutes)")
    p.add_argument("--only", choices=EXPERIMENTS, help="run one experiment")
    p.add_argument("--json", help="write every figure to this file")
    p.add_argument("--model", help="None: SmolLM2-135M-Instruct; a directory; random:<preset>")
    p.add_argument("--device", help="cpu or cuda (default: cuda if available)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8"],
                   help="the KV cache's dtype in every experiment (kv_dtype compares both)")
    args = p.parse_args()
    if args.json is not None and not nanopaged.writable(args.json):
        p.error(f"--json {args.json!r}: not a file this program can write (a folder? no such one?)")
    try:   # a bad --model or --device: one line, before any experiment (which reuse the model)
        engine(args, num_blocks=1)
    except ValueError as e:
        p.error(str(e))
    args.num_requests = 8 if args.quick else 32
    machine = f"{platform.machine()}, {torch.get_num_threads()} threads, {args.device or 'default'}"
    console.print(f"nanopaged bench: {args.model or 'SmolLM2-135M-Instruct'} on {machine}")
    t0 = time.perf_counter()
    for name in [args.only] if args.only else EXPERIMENTS:
        EXPERIMENTS[name](args)
    console.print(f"done in {time.perf_counter() - t0:.0f} s")
    if args.json is not None:   # written last: the tables are printed whatever becomes of it
        with open(args.json, "w") as f:   # (checked writable before the first experiment)
            json.dump({"machine": machine, "model": args.model, "quick": args.quick,
                       "experiments": results}, f, indent=1, default=str)

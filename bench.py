"""
bench.py: the claims of paging, measured on this machine beside baselines, in six experiments
(memory, throughput, prefix, kv_dtype, priority, multiturn): a table that reads at 80 columns,
the long breakdowns below it, and a conclusion.

    python bench.py                    every experiment, the default model
    python bench.py --quick            shorter outputs, a few minutes (what fresh-check runs)
    python bench.py --only prefix      one experiment; --json FILE writes every figure
    python bench.py --only policies --replay FILE [--num-blocks N] [--block-size B] [--sweep]
                                       eviction policies on a trace, no model (see policies)
"""
import inspect
import itertools
import json
import platform
import random
import time
from statistics import fmean

import torch
from rich.console import Console
from rich.table import Table
from transformers import ContinuousBatchingConfig, GenerationConfig

import nanopaged
from model import load_hf
from nanopaged import LLM, SamplingParams, run_arrivals

console = Console(highlight=False)


def agreement(outputs, wanted):
    """The share of outputs equal to the wanted ones, position by position."""
    return fmean(1 if a == b else 0 for a, b in zip(outputs, wanted))


def greedy(max_tokens):
    """Greedy sampling of max_tokens tokens, eos off: every engine makes as many."""
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def mean_p90(values):
    """The mean and the 90th percentile (the value 90% of the way up the sorted values)."""
    return fmean(values), sorted(values)[int(0.9 * len(values))]


def reasons(stats):
    """stats()'s computed_by_reason in words, each reason then its prompt tokens, in the engine's
    order: 'first seen 16, after a miss 384, partial block 96'."""
    return ", ".join(f"{reason} {n}" for reason, n in stats["computed_by_reason"].items())


# ----------------------------------------------------------------------------------------------
# Workloads: prompts cut from a text (nanopaged.py's own source), or random ids for random weights

def corpus(llm):
    # Random weights have no tokenizer: random token ids, the same every run.
    if llm.tokenizer is None:
        return random.Random(0).choices(range(llm.model.config.vocab_size), k=20000)
    return llm.tokenizer.encode(inspect.getsource(nanopaged), add_special_tokens=False)


def pieces(text, seed, lengths):
    """Pieces of text at random places (seed), one of each length range (shortest, longest)."""
    rng = random.Random(seed)
    # The places first, then each piece's length.
    places = rng.sample(range(len(text) - 256), len(lengths))
    result = []
    for i, n in zip(places, lengths):
        result.append(text[i:i + rng.randint(*n)])
    return result


def mixed_workload(llm, num_requests, sample_every=0, longest=128):
    """Prompts of 16-256 tokens, greedy outputs of 8 to longest (eos off: every engine makes as
    many); sample_every: every so many, n=2 samples instead."""
    rng = random.Random(0)
    text = corpus(llm)
    requests = []
    for i in range(num_requests):
        n = rng.randint(16, 256)
        start = rng.randrange(len(text) - n)
        sample = sample_every and i % sample_every == 0
        requests.append((text[start:start + n],
                         SamplingParams(temperature=0.8 if sample else 0,
                                        n=2 if sample else 1,
                                        max_tokens=rng.randint(8, longest),
                                        ignore_eos=True,
                                        seed=i)))
    # Returned as (prompts, params).
    return zip(*requests)


def engine(args, num_blocks=1, **kwargs):
    """An LLM of num_blocks blocks on the command line's model, device and kv_cache_dtype (unless
    kwargs name one)."""
    kwargs.setdefault("kv_cache_dtype", args.kv_cache_dtype)
    return LLM(args.model, device=args.device, num_blocks=num_blocks, **kwargs)


def timed(f, *args):
    """(f(*args), the seconds it took)."""
    t0 = time.perf_counter()
    return f(*args), time.perf_counter() - t0


def run(llm, prompts, params):
    """Requests through the engine: (each output's first sample's token ids, seconds, the pool
    after each step)."""
    seen = []

    def watch(step):
        seen.append(dict(step.stats, running_requests=len(llm.scheduler.running)))

    llm.on_step.append(watch)
    outs, seconds = timed(llm.generate, prompts, params)
    # watch refers to llm: left in, the engine would never be freed.
    llm.on_step.remove(watch)
    return [o.outputs[0].token_ids for o in outs], seconds, seen


def arrive(llm, arrivals):
    """The arrivals through the engine (run_arrivals): (each request's TTFT, each one's first
    sample's token ids), in order."""
    outs = []
    for request_id in run_arrivals(llm, arrivals):
        out = llm.output(request_id)
        outs.append((out.ttft, out.outputs[0].token_ids))
    return zip(*outs)


def hf_generate(hf, prompts, params, size):
    """transformers' generate on static batches of size: left-padded, each to its longest output."""
    for i in range(0, len(prompts), size):
        batch = prompts[i:i + size]
        lengths = [p.max_tokens for p in params[i:i + size]]
        width = max(map(len, batch))
        # Left-padded: -1 marks a pad, given to the model as 0 and left out by the mask (True:
        # a prompt token).
        ids = torch.tensor([[-1] * (width - len(p)) + p for p in batch], device=hf.device)
        out = hf.generate(ids.clamp(0),
                          attention_mask=ids >= 0,
                          max_new_tokens=max(lengths),
                          do_sample=False,
                          pad_token_id=0,
                          eos_token_id=None)
        for row, n in zip(out, lengths):
            yield row[width:width + n].tolist()


def hf_continuous(hf, prompts, params, num_blocks):
    """transformers' continuous batching as generate_batch runs it, each request to its length."""
    # nanopaged's budget, and load_hf's sdpa attention rather than flash attention.
    cb = ContinuousBatchingConfig(page_size=16,
                                  num_blocks=num_blocks,
                                  max_batch_tokens=2048,
                                  auto_switch_to_flash=False)
    # An eos of -1 is none: every request runs to its length.
    with hf.continuous_batching_context_manager(GenerationConfig(do_sample=False, eos_token_id=-1),
                                                continuous_batching_config=cb) as manager:
        ids = []
        for p, q in zip(prompts, params):
            ids.append(manager.add_request(p, max_new_tokens=q.max_tokens))
        # The manager hands each request back as it ends: as many as were added.
        done = {r.request_id: r.generated_tokens for _, r in zip(ids, manager)}
    return [done[i] for i in ids]


# ----------------------------------------------------------------------------------------------
# The experiments

def memory(args):
    """Occupancy, waste and requests that fit a KV budget: paged (block sizes 8, 16, 32) against
    a block of max_model_len per request, on the mixed workload (every fourth request n=2).
    Random tiny weights: the accounting is the same."""
    max_model_len = 1024
    # The budget: max_model_len for a quarter of the requests.
    slots = args.num_requests // 4 * max_model_len
    rows = []
    for size in (8, 16, 32, max_model_len):
        llm = LLM("random:tiny",
                  block_size=size,
                  max_model_len=max_model_len,
                  num_blocks=slots // size)
        seen = run(llm, *mixed_workload(llm, args.num_requests, sample_every=4))[2]
        rows.append(["contiguous" if size == max_model_len else "paged",
                     size,
                     fmean(s["token_occupancy_perc"] for s in seen),
                     # The budget's slots in used blocks, less those holding tokens.
                     round(fmean(s["kv_cache_usage_perc"] * slots * (1 - s["token_occupancy_perc"])
                                 for s in seen)),
                     max(s["running_requests"] for s in seen)])
    return (f"{args.num_requests} requests, a KV budget of {slots} token slots",
            ["layout", "block_size", "token occupancy", "slots wasted",
             "requests at once"],
            rows,
            f"At block_size 16, {rows[1][2]:.0%} of the reserved slots hold tokens, "
            f"against {rows[-1][2]:.0%} when each request reserves "
            f"max_model_len ({max_model_len}) up front: "
            f"{rows[1][4] / rows[-1][4]:.1f}x as many requests run at once in the budget.")


def throughput(args):
    """The same greedy requests (eos off) through nanopaged and three transformers baselines;
    --quick: outputs of 8-16 tokens (8-128), as one at a time takes a token's time each."""
    longest = 16 if args.quick else 128
    # Room for every request at once: mixed_workload's prompts and outputs at their longest.
    num_blocks = args.num_requests * (256 + longest) // 16
    llm = engine(args, num_blocks)
    prompts, params = mixed_workload(llm, args.num_requests, longest=longest)
    ours, seconds, _ = run(llm, prompts, params)
    # The matmul floor: the workload's linear layers at the machine's best GEMM rate. They take
    # 2 FLOPs a weight for each token computed, and the vocabulary's for each token sampled.
    num_tokens = llm.num_generated_tokens
    # The linear layers' weights are the layers' 2-D parameters. Every output token but each
    # request's last goes back through the layers.
    flops = 2 * (sum(p.numel() for p in llm.model.layers.parameters() if p.dim() == 2)
                 * (llm.num_prefill_tokens_computed + num_tokens - args.num_requests)
                 + llm.model.lm_head.weight.numel() * num_tokens)
    # The machine's best GEMM rate (FLOP/s): the fastest of 5 matmuls of 2048². Reading a value
    # back waits for the matmul to finish.
    a = torch.randn(2048, 2048).to(llm.device, llm.dtype)
    floor = flops / (2 * 2048 ** 3) * min(timed(lambda: (a @ a)[0, 0].item())[1]
                                          for _ in range(5))
    # transformers runs the weights nanopaged runs.
    hf = load_hf(args.model, llm.seed)[0].to(llm.device)
    rows = [("nanopaged", seconds, num_tokens / seconds, 1.0, 1.0, floor / seconds)]
    for name, generate, arg in [("generate, batch 1", hf_generate, 1),
                                ("generate, batch 8", hf_generate, 8),
                                ("continuous batching", hf_continuous, num_blocks)]:
        with torch.inference_mode():
            theirs, hf_seconds = timed(lambda: list(generate(hf, prompts, params, arg)))
        rows.append((name,
                     hf_seconds,
                     num_tokens / hf_seconds,
                     hf_seconds / seconds,
                     agreement(theirs, ours),
                     floor / hf_seconds))
    return (f"{len(prompts)} mixed requests, {llm.device}, {llm.dtype}; the others are "
            "transformers'",
            ["engine", "seconds", "output\ntokens/s", "nanopaged's\nspeedup",
             "same\ntokens", "of the\nfloor"],
            rows,
            f"nanopaged is {rows[3][3]:.1f}x as fast as transformers' continuous batching, "
            f"{rows[2][3]:.1f}x static batches of 8, {rows[1][3]:.1f}x one at a time; "
            f"it runs at {rows[0][5]:.0%} of the matmul floor "
            f"({flops / 1e12:.2f} TFLOP of linear layers "
            f"at {flops / floor / 1e9:.0f} GFLOP/s, this machine's best).")


def prefix(args):
    """A system prompt of 400 tokens (25 full blocks) before each 12-token question; a request
    arrives every other step. TTFT: from add_requests to the first token."""
    rows = []
    notes = []
    for caching in (True, False):
        # 412 + 16 tokens: 27 blocks a request, room for all.
        llm = engine(args, args.num_requests * 27, enable_prefix_caching=caching)
        text = corpus(llm)
        # Each question: 12 tokens of the text, 37 apart.
        ttft, _ = arrive(llm, [(2 * i, [text[:400] + text[1000 + 37 * i:][:12]], greedy(16))
                               for i in range(args.num_requests)])
        s = llm.stats()
        rows.append((f"caching {'on' if caching else 'off'}",
                     llm.num_prefill_tokens_computed,
                     s["prefix_cache_hit_rate"],
                     fmean(ttft)))
        notes.append(f"caching {'on' if caching else 'off'}, computed by reason: {reasons(s)}")
    return (f"{args.num_requests} requests of 412 tokens sharing 400, one every other step",
            ["prefix caching", "prefill tokens\ncomputed", "hit rate", "mean ttft (s)"],
            rows,
            *notes,
            f"With prefix caching the engine computes {1 - rows[0][1] / rows[1][1]:.0%} fewer "
            f"prompt tokens and the first token comes {rows[1][3] / rows[0][3]:.1f}x sooner.")


def kv_dtype(args):
    """The KV cache in the model's dtype and in INT8 (kv_cache_dtype): bytes per block; 32 prompts
    (--quick: 8) in the memory of a quarter of their blocks in the model's dtype: requests at
    once, tokens/s; accuracy against the model's dtype (32 greedy tokens, eos off): the first
    token's top-1 agreement and mean KL divergence, the outputs identical, the mean position where
    the others first differ."""
    llm = engine(args, kv_cache_dtype="auto")
    prompts = pieces(corpus(llm), 3, [(32, 256)] * args.num_requests)
    params = greedy(32)
    # The bytes of a quarter of the blocks needed, in the model's dtype.
    memory = (sum(nanopaged.max_blocks_needed(llm, len(p), params) for p in prompts) // 4
              * llm.copier.bytes_per_block["device"])
    rows = []
    for dtype in ("auto", "int8"):
        block_bytes = engine(args, kv_cache_dtype=dtype).copier.bytes_per_block["device"]
        llm = engine(args, memory // block_bytes, kv_cache_dtype=dtype)
        outs, seconds, seen = run(llm, prompts, params)
        # Each prompt's first-token log-probs, as the model hands its logits on: a step each,
        # one row of logits each.
        first = []

        def keep(model, inputs, outputs):
            logits, _ = outputs
            first.append(logits.log_softmax(-1))

        # The hook is removed as the with block ends.
        with llm.model.register_forward_hook(keep):
            for prompt in prompts:
                llm.generate(prompt, greedy(1))
        first = torch.cat(first)
        # The model's dtype comes first: INT8 is measured against it.
        if dtype == "auto":
            want_first, want_outs = first, outs
        # Where each output unlike the model dtype's first differs from it.
        differ = [[a == b for a, b in zip(o, w)].index(False)
                  for o, w in zip(outs, want_outs) if o != w]
        # The first token: the KL divergence from the model dtype's, the mean over the prompts.
        kl = torch.nn.functional.kl_div(first, want_first, reduction="batchmean", log_target=True)
        rows.append((str(llm.kv_cache.dtype).removeprefix("torch."),
                     block_bytes,
                     max(s["running_requests"] for s in seen),
                     params.max_tokens * args.num_requests / seconds,   # eos off: all of them
                     # The first token's top-1 agreement.
                     agreement(first.argmax(-1), want_first.argmax(-1)),
                     f"{kl:.4f}",
                     agreement(outs, want_outs),
                     fmean(differ or [float("nan")])))
    return (f"{len(prompts)} prompts, {memory / 2**20:.0f} MiB of KV cache",
            ["dtype", "bytes/\nblock", "at\nonce", "tokens/s", "top-1", "KL", "identical",
             "differ\nat"],
            rows,
            f"INT8 stores {rows[0][1] / rows[1][1]:.2f}x the blocks in the same memory, "
            f"runs {rows[1][2] / rows[0][2]:.1f}x the requests at once "
            f"at {rows[1][3] / rows[0][3]:.2f}x the tokens/s; "
            f"{rows[1][6]:.0%} of its greedy outputs are identical.")


def priority(args):
    """Short interactive requests (16-32 tokens, 8 out), one every other step, among long batch
    requests queued at once (128-256 tokens, 64 out; --quick: 32), twice as many as the pool
    holds, so that it preempts: first come first served; by priority (interactive 0, batch 1);
    and with aging. The interactive requests' TTFT; the longest a batch request waited for its
    first token."""
    num_batch, num_interactive, batch_out = (6, 8, 32) if args.quick else (12, 24, 64)
    prompts = pieces(corpus(engine(args)), 5,
                     [(128, 256)] * num_batch + [(16, 32)] * num_interactive)
    policies = {"fcfs": {},
                "priority": {"scheduling_policy": "priority"},
                "priority, aging 4": {"scheduling_policy": "priority",
                                      "priority_aging_steps": 4}}
    rows = []
    for name, policy in policies.items():
        # The pool holds half the batch requests at their longest.
        llm = engine(args, num_batch // 2 * (256 + batch_out) // 16, **policy)
        # The batch requests at step 0 (priority 1; under fcfs all are 0), then the interactive
        # ones, one every other step (priority 0).
        (ttft, tokens), seconds = timed(arrive, llm, [
            (0, prompts[:num_batch], greedy(batch_out), [1 if policy else 0] * num_batch),
            *[(2 * i, [p], greedy(8)) for i, p in enumerate(prompts[num_batch:])]])
        # First come first served runs first: the others are compared with it.
        if name == "fcfs":
            want = tokens
        rows.append((name,
                     *mean_p90(ttft[num_batch:]),
                     max(ttft[:num_batch]),
                     llm.num_generated_tokens / seconds,
                     agreement(tokens, want)))
    return (f"{num_interactive} interactive requests among {num_batch} batch requests",
            ["policy", "ttft\nmean", "ttft\np90", "batch:\nlongest ttft", "tokens/s",
             "same\ntokens"],
            rows,
            f"By priority the interactive requests' first token comes "
            f"{rows[0][1] / rows[1][1]:.1f}x sooner than first come first served "
            f"({rows[0][1] / rows[2][1]:.1f}x with aging, which brings the batch requests' "
            f"longest wait from {rows[1][3]:.2f} to {rows[2][3]:.2f} s).")


def multiturn(args):
    """Chats, each turn the whole history and a new 64-token message (16 tokens back; --quick: 6,
    each a step), one request at a time, the chats in turn, in a device pool of two histories;
    the tiers below it; then slow links, emulated (tier_gbps), with copies that block, then in
    the background, written ahead.
    On a CPU the device is host memory too, and the disk file may sit in the page cache: unslowed,
    both links are memory copies."""
    num_chats, num_turns, reply = (4, 4, 6) if args.quick else (8, 6, 16)
    # Two chats' last turns.
    num_blocks = 2 * (num_turns * (64 + reply) + 15) // 16
    # Host blocks for a quarter of the chats.
    quarter = num_chats * num_blocks // 8
    tiers = {"num_cpu_blocks": quarter, "num_disk_blocks": 4 * num_blocks}
    sizes = engine(args, offload_kv_cache_dtype="int8").copier.bytes_per_block
    # The slow links' speeds, filled in by the device-only run, which comes first.
    gbps = {}
    slow = {**tiers, "tier_gbps": gbps}
    configs = {"device only": {},
               "+ host": {"num_cpu_blocks": num_chats * num_blocks},
               "+ 1/4 host": {"num_cpu_blocks": quarter},
               # INT8 host blocks in the bytes of a quarter in the model's dtype.
               "+ 1/4 host, INT8": {"num_cpu_blocks": quarter * sizes["device"] // sizes["host"],
                                    "offload_kv_cache_dtype": "int8"},
               "+ 1/4 host, disk": tiers,
               "slow: blocking": {**slow, "async_copies": False},
               "slow: write-ahead": slow}   # async_copies, the default
    # A warm-up run.
    engine(args, num_blocks).generate([1] * 64)
    rows = []
    notes = []
    for name, pools in configs.items():
        llm = engine(args, num_blocks, **pools)
        text = corpus(llm)
        chats = [[] for _ in range(num_chats)]
        ttft = []
        t0 = time.perf_counter()
        # The chats in turn (each list num_turns times over): a chat's new message, then the reply.
        for i, chat in enumerate(chats * num_turns):
            chat += text[997 * i % (len(text) - 64):][:64]
            out = llm.generate(chat, greedy(reply))[0]
            chat += out.outputs[0].token_ids
            ttft.append(out.ttft)
        seconds = time.perf_counter() - t0
        s = llm.stats()
        # The device-only run comes first. The others are compared with its chats, and the
        # slow links are scaled to its speed: links beside a GPU carry a block over PCIe in 4
        # tokens' compute and over NVMe in 12 (recomputing it: 16).
        if name == "device only":
            want = chats
            # The GB/s of a link that carries a block in one token's compute.
            speed = (sizes["device"] / 1e9
                     * (llm.num_prefill_tokens_computed + llm.num_generated_tokens) / seconds)
            gbps.update(host=speed / 4, disk=speed / 12)
        rows.append((name,
                     llm.num_prefill_tokens_computed,
                     # The prompt tokens found in each tier (cached_by_tier names those with
                     # any), as shares of the tokens looked up.
                     " ".join(f"{s['cached_by_tier'].get(t, 0) / s['prefix_cache_queries']:.0%}"
                              for t in nanopaged.TIERS),
                     *mean_p90(ttft),
                     llm.num_generated_tokens / seconds,
                     chats == want))
        notes.append(f"{name}: waited {s['copy_wait_seconds']:.2f} s on copies; computed by "
                     f"reason: {reasons(s)}")
    device_only, host, _, int8, _, blocking, write_ahead = rows
    return (f"{num_chats} chats of {num_turns} turns, {num_blocks} device blocks; slow: over "
            "slow links",
            ["tiers", "prefill\ncomputed", "hits:\ndevice host\ndisk", "ttft\nmean",
             "ttft\np90", "tokens/s", "same"],
            rows,
            *notes,
            f"With a host tier {1 - host[1] / device_only[1]:.0%} fewer prompt tokens are "
            f"computed and the first token comes {device_only[3] / host[3]:.1f}x sooner, "
            f"{1 - int8[1] / device_only[1]:.0%} with a quarter of its memory in INT8. "
            f"Over links emulated (tier_gbps) as PCIe and NVMe beside a GPU "
            f"(host {gbps['host']:.3g}, disk {gbps['disk']:.3g} GB/s), "
            f"copies in the background, written ahead, "
            f"bring the first token {blocking[3] / write_ahead[3]:.1f}x sooner, "
            f"with {write_ahead[5] / blocking[5]:.1f}x the tokens/s.")


def policies(args):
    """Eviction policies side by side, the requests replayed through the block manager alone (no
    model: nanopaged.replay) at --num-blocks device blocks (default: an eighth of the distinct
    blocks): hit rate (blocks hit / prompt blocks), orphaned blocks (cached, unreachable: an
    ancestor evicted; after each request, the mean), evictions, seconds. Then opt (the ceiling at
    this size) and unlimited (room for every block: the ceiling of reuse). The requests: --replay
    FILE's (Mooncake's JSON lines; blocks of --block-size tokens, default 512), else workload()'s
    (blocks of 16). --sweep: hit rate against the pool's size, a line of bars a policy."""
    requests, block_size, num_blocks, distinct, smallest = args.replayed
    names = [*nanopaged.EVICTION_POLICIES, "opt"]
    rows = []
    for name in names:
        (hits, blocks, orphans, evictions), seconds = timed(nanopaged.replay, requests, name,
                                                             num_blocks, block_size)
        rows.append((name, hits / blocks, orphans, evictions, seconds))
    # Room for every block: LRU then never evicts (nor orphans: a request frees its tail first).
    hits = nanopaged.replay(requests, "lru", distinct + 1, block_size)[0]
    rows.append(("unlimited", hits / blocks, 0.0, 0, 0.0))
    rates = {row[0]: row[1] for row in rows}
    best = max(names[:-1], key=rates.get)
    notes = sweep(requests, names, block_size, smallest, distinct + 1,
                  rates["unlimited"]) if args.sweep else []
    return (f"{len(requests)} requests, {blocks} prompt blocks ({distinct} distinct) of "
            f"{block_size} tokens, {num_blocks} device blocks; replayed without a model",
            ["policy", "hit rate", "orphaned\nblocks", "evictions", "seconds"],
            rows,
            *notes,
            f"LRU finds {rates['lru'] / rates['opt']:.0%} of the hits that opt, which knows the "
            f"future, finds at this size; the best online policy here is {best} "
            f"({rates[best] / rates['opt']:.0%}). Room for every block would hit "
            f"{rates['unlimited']:.0%} of the prompt blocks.")


def replayed(args):
    """For policies, checked before any experiment runs: (requests, block size, device blocks,
    distinct blocks, the sweep's smallest pool: a sixteenth of them, or the largest request)."""
    nanopaged.require(0 not in (args.num_blocks, args.block_size),
                      "--num-blocks and --block-size: positive ints")
    requests = read_trace(args.replay) if args.replay else workload()
    block_size = args.block_size or (512 if args.replay else 16)
    distinct = len(set(itertools.chain.from_iterable(requests)))
    longest = max(map(len, requests))
    num_blocks = args.num_blocks or max(distinct // 8, longest + 1)
    nanopaged.check_args(block_size=block_size)
    nanopaged.require(longest < num_blocks, f"--num-blocks {num_blocks}: a request of {longest} "
                      f"blocks needs {longest + 1} (its last token's too)")
    return requests, block_size, num_blocks, distinct, max(distinct // 16, longest + 1)


def read_trace(path):
    """A trace's requests, each its hash_ids (one id a block, prefix-chained): JSON lines in
    Mooncake's format (FAST'25: timestamp, input_length, output_length, hash_ids); the rest is not
    used."""
    what = f"--replay {path}: not JSON lines with hash_ids, lists of ints (Mooncake's format)"
    try:
        with open(path) as f:
            requests = [json.loads(line)["hash_ids"] for line in f]
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{what}: {e!r}") from None
    nanopaged.require(requests and all(ids and all(map(nanopaged.is_int, ids))
                                       for ids in requests), what)
    return requests


def workload(seed=0):
    """The built-in workload, each request its list of block ids (nanopaged.replay), the same every
    run: 4 system prompts of 6 blocks; 3 few-shot prefixes, each a system prompt and 10 blocks;
    24 chats of 2-8 turns, each after one system prompt, a turn its history and a new message of
    1-4 blocks (the reply after it, 1-2 blocks, joins the history uncached: an output is not
    cached); 160 one-off questions of 1-3 blocks, each after a system prompt or a few-shot prefix.
    The chats' turns and the questions come in a random order, each chat's turns in turn. Each id
    follows one prefix alone, as in Mooncake's traces."""
    rng = random.Random(seed)
    new_ids = itertools.count()

    def blocks(n):
        return [next(new_ids) for _ in range(n)]

    systems = [blocks(6) for _ in range(4)]
    shots = [rng.choice(systems) + blocks(10) for _ in range(3)]
    streams = []   # each chat's requests, in turn; each question alone
    for _ in range(24):
        history = rng.choice(systems)
        turns = []
        for _ in range(rng.randint(2, 8)):
            history = history + blocks(rng.randint(1, 4))
            turns.append(history)
            history = history + blocks(rng.randint(1, 2))   # the reply
        streams.append(turns)
    for _ in range(160):
        streams.append([rng.choice(systems + shots) + blocks(rng.randint(1, 3))])
    # A stream's place for each of its requests, shuffled: its requests in order.
    order = [i for i, stream in enumerate(streams) for _ in stream]
    rng.shuffle(order)
    queues = [iter(stream) for stream in streams]
    return [next(queues[i]) for i in order]


def sweep(requests, names, block_size, smallest, largest, unlimited):
    """Hit rate against the pool's size, smallest to largest blocks in 8 steps: a line of bars a
    policy (a bar's height: its hit rate, a full one unlimited's), then unlimited's."""
    sizes = sorted({round(smallest * (largest / smallest) ** (i / 7)) for i in range(8)})
    lines = ["hit rate against the device pool's size (blocks): " + ", ".join(map(str, sizes))]
    total = sum(map(len, requests))
    for name in names:
        rates = [nanopaged.replay(requests, name, size, block_size)[0] / total for size in sizes]
        bars = "".join(BARS[round(8 * rate / unlimited)] for rate in rates)
        lines.append(f"{name:<9} {bars}  {rates[0]:.2f} to {rates[-1]:.2f}")
    lines.append(f"{'unlimited':<9} {BARS[8] * len(sizes)}  {unlimited:.2f}")
    return lines


BARS = " ▁▂▃▄▅▆▇█"

# Each experiment returns its table (title, columns, rows), any notes (lines for below the
# table: the breakdowns too long for a column) and its conclusion.
EXPERIMENTS = {f.__name__: f
               for f in (memory, throughput, prefix, kv_dtype, priority, multiturn, policies)}

if __name__ == "__main__":
    p = nanopaged.ArgumentParser(description="nanopaged benchmark: the claims of paging, measured")
    p.add_argument("--quick", action="store_true", help="smaller workloads (a few minutes)")
    p.add_argument("--only", choices=EXPERIMENTS, help="run one experiment")
    p.add_argument("--json", help="write every figure to this file")
    p.add_argument("--model", help="None: SmolLM2-135M-Instruct; a directory; random:<preset>")
    p.add_argument("--device", help="cpu or cuda (default: cuda if available)")
    p.add_argument("--kv-cache-dtype",
                   default="auto",
                   help="auto or int8: the KV cache in every experiment (kv_dtype compares both)")
    p.add_argument("--replay", help="policies: a trace file, JSON lines (Mooncake's format)")
    p.add_argument("--num-blocks", type=int, help="policies: the device pool (blocks)")
    p.add_argument("--block-size", type=int, help="policies: tokens a block (512 with --replay)")
    p.add_argument("--sweep", action="store_true", help="policies: hit rate against pool size")
    p.add_argument("--svg", help="policies and the rest: save what is printed as an SVG image")
    args = p.parse_args()
    # A bad --json, --model or --device: one line, before any experiment (they reuse the model).
    try:
        nanopaged.require(args.json is None or nanopaged.writable(args.json),
                          f"--json {args.json!r}: "
                          "not a file this program can write (a folder? no such one?)")
        nanopaged.require(args.svg is None or nanopaged.writable(args.svg),
                          f"--svg {args.svg!r}: not a file this program can write")
        # the policies need no model
        if args.only != "policies":
            engine(args)
        if args.only in (None, "policies"):
            args.replayed = replayed(args)
    except (ValueError, OSError) as e:
        p.error(str(e))
    args.num_requests = 8 if args.quick else 32
    machine = (f"{platform.machine()}, {torch.get_num_threads()} threads, "
               f"{args.device or 'default'}")
    console.record = args.svg is not None
    console.print(f"nanopaged bench: {args.model or 'SmolLM2-135M-Instruct'} on {machine}")
    results = {}   # experiment -> its figures, for --json
    t0 = time.perf_counter()
    for name in [args.only] if args.only else EXPERIMENTS:
        title, columns, rows, *notes, conclusion = EXPERIMENTS[name](args)
        # The experiment's table, its notes (the breakdowns too long for a column) and its
        # conclusion. The first column names a row; the others hold figures.
        table = Table(*columns, title=f"{name}: {title}", title_justify="left")
        for column in table.columns[1:]:
            column.justify = "right"
        for row in rows:
            table.add_row(*[f"{x:.2f}" if isinstance(x, float) else str(x) for x in row])
        console.print(table, *notes, conclusion + "\n", sep="\n", style="bold")
        results[name] = {"columns": columns,
                         "rows": rows,
                         "notes": notes,
                         "conclusion": conclusion}
    console.print(f"done in {time.perf_counter() - t0:.0f} s")
    if args.svg is not None:
        console.save_svg(args.svg, title="python bench.py")
    # Written last: the tables are printed whatever becomes of the file, which was checked
    # writable before the first experiment.
    if args.json is not None:
        with open(args.json, "w") as f:
            json.dump({"machine": machine,
                       "model": args.model,
                       "quick": args.quick,
                       "experiments": results}, f, indent=1)

"""
bench.py: run the engine on a workload and print what its memory system did.

What it teaches: the numbers that tell a paged KV cache is doing its job: how many of the reserved
slots hold real tokens (token occupancy), how often a prompt's blocks were found in the prefix
cache, how many blocks were copied on write, how many requests had to be preempted.

    python bench.py              the default model on a mixed workload
    python bench.py --quick      the same at a small size (what the tests run)

This first version runs one workload; the side-by-side experiments against baselines come next.
"""
import argparse
import platform
import time

import torch
from rich.console import Console
from rich.table import Table

from nanopaged import LLM, BeamSearchParams, SamplingParams

SYSTEM = ("You are a careful assistant. Answer in plain words, keep it short, and say when you do not know. ")
QUESTIONS = ["What is a KV cache?", "Why do blocks help?", "Name a prime number.", "What is copy-on-write?",
             "Tell me a short story about a clockmaker.", "Explain recursion to a child.",
             "What does a scheduler do?", "Write a haiku about memory."]


def workload(llm, num_requests, seed=0):
    """Mixed lengths, a shared system prompt, one n=2 request: something of every mechanism."""
    g = torch.Generator().manual_seed(seed)
    prompts, params = [], []
    for i in range(num_requests):
        if llm.tokenizer:   # the instruct model answers best in its chat format
            messages = [{"role": "system", "content": SYSTEM}] if i % 2 == 0 else []
            messages.append({"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]})
            prompts.append(llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))
        else:
            prompts.append(torch.randint(0, llm.model.config.vocab_size, (8 + 6 * i,), generator=g).tolist())
        params.append(SamplingParams(temperature=0.0 if i % 3 else 0.7, max_tokens=int(torch.randint(8, 48, (1,), generator=g)),
                                     n=2 if i == 0 else 1, seed=i, ignore_eos=llm.tokenizer is None))
    return prompts, params


def peak_blocks(llm, run):
    """Run run(llm); return the peak over steps of blocks in use and of blocks the live sequences'
    tables would hold if none were shared (each sequence holding its own copy of every block)."""
    peak_shared = peak_unshared = 0
    step = llm.step

    def watch():
        nonlocal peak_shared, peak_unshared
        batch = step()
        tables = [s.block_table for s in llm.scheduler.running]
        peak_shared = max(peak_shared, len({b for t in tables for b in t}))
        peak_unshared = max(peak_unshared, sum(map(len, tables)))
        return batch

    llm.step = watch
    run(llm)
    llm.step = step
    return peak_shared, peak_unshared


def sharing_table(model, device, quick):
    """Beam search (width 4) and n=4 sampling: blocks held with sharing against without."""
    table = Table(title="Sharing between samples and beams (block_size 16, peak blocks over the run)")
    for col in ("workload", "blocks with sharing", "blocks without", "share of unshared", "copy-on-write copies"):
        table.add_column(col, justify="right" if col != "workload" else "left")
    max_tokens = 16 if quick else 64
    for name, run in (("beam search, width 4", lambda l, p: l.beam_search([p], BeamSearchParams(4, max_tokens))),
                      ("sampling, n=4", lambda l, p: l.generate([p], SamplingParams(temperature=1.0, n=4, max_tokens=max_tokens, ignore_eos=True)))):
        llm = LLM(model, device=device, num_blocks=512)
        prompt = (llm.tokenizer.apply_chat_template([{"role": "user", "content": QUESTIONS[4]}], add_generation_prompt=True,
                                                    tokenize=False) if llm.tokenizer else list(range(1, 60)))
        shared, unshared = peak_blocks(llm, lambda l: run(l, prompt))
        table.add_row(name, str(shared), str(unshared), f"{shared / unshared:.0%}", str(llm.stats()["num_cow_copies"]))
    return table


def main():
    p = argparse.ArgumentParser(description="nanopaged benchmark: one workload, the engine's metrics")
    p.add_argument("--quick", action="store_true", help="a small workload, a minute on a 2-core CPU")
    p.add_argument("--model", default=None, help="None: SmolLM2-135M-Instruct; a local directory; random:<preset>")
    p.add_argument("--random-weights", action="store_true", help="random weights of the smollm2-135m shape (no files)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--num-requests", type=int, default=None, help="requests in the workload (default 8, quick 4)")
    args = p.parse_args()
    model = "random:smollm2-135m" if args.random_weights else args.model
    console = Console()
    llm = LLM(model, device=args.device, num_blocks=256 if args.quick else None)
    prompts, params = workload(llm, args.num_requests or (4 if args.quick else 8))
    usage, occupancy = [], []
    step = llm.step

    def step_and_watch():   # sample the pool after every step: the end of a run shows an empty pool
        batch = step()
        s = llm.stats()
        usage.append(s["kv_cache_usage_perc"])
        occupancy.append(s["token_occupancy_perc"])
        return batch

    llm.step = step_and_watch
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - t0

    where = f"{platform.machine()}, {torch.get_num_threads()} threads, {llm.device}, {llm.dtype}"
    table = Table(title=f"Outputs ({model or 'smollm2'}; {where})")
    table.add_column("request"), table.add_column("sample"), table.add_column("tokens", justify="right"), table.add_column("text")
    for o in outs:
        for c in o.outputs:
            table.add_row(str(o.request_id), str(c.index), str(len(c.token_ids)), repr(c.text[:60]) if c.text else str(c.token_ids[:8]))
    console.print(table)
    stats = llm.stats()
    table = Table(title="Engine metrics")
    table.add_column("metric"), table.add_column("value", justify="right")
    for k, v in stats.items():
        table.add_row(k, f"{v:.3f}" if isinstance(v, float) else str(v))
    table.add_row("peak kv_cache_usage_perc", f"{max(usage):.3f}")
    table.add_row("mean token_occupancy_perc over steps", f"{sum(occupancy) / len(occupancy):.3f}")
    table.add_row("steps", str(llm.num_steps))
    table.add_row("output tokens per second", f"{stats['num_generated_tokens'] / elapsed:.1f}")
    table.add_row("mean ttft (s)", f"{sum(o.ttft for o in outs) / len(outs):.3f}")
    console.print(table)
    console.print(sharing_table(model, args.device, args.quick))


if __name__ == "__main__":
    main()

"""
bench.py: run the engine on workloads and print what its memory system did.

What it teaches: the numbers that tell a paged KV cache is doing its job: how many of the reserved
slots hold real tokens (token occupancy), how often a prompt's blocks were found in the prefix
cache, how many blocks were copied on write, how much beams and samples save by sharing blocks.

    python bench.py              the default model on a mixed workload
    python bench.py --quick      the same at a small size (what fresh-check runs)

This version runs one mixed workload and the sharing experiment; the side-by-side experiments
against baselines come next.
"""
import argparse
import platform
import time

import torch
from rich.console import Console
from rich.table import Table

from nanopaged import LLM, BeamSearchParams, SamplingParams

SYSTEM = ("You are a careful assistant. Answer in plain words, keep it short, and say when you "
          "do not know.")
QUESTIONS = ["What is a KV cache?", "Why do blocks help?", "Name a prime number.",
             "What is copy-on-write?", "Tell me a short story about a clockmaker.",
             "Explain recursion to a child.", "What does a scheduler do?",
             "Write a haiku about memory."]

def prompt(llm, i, system=False, g=None):
    """Question i in the instruct model's chat format; random token ids for random weights."""
    if llm.tokenizer is None:
        return torch.randint(0, llm.model.config.vocab_size, (8 + 6 * i,), generator=g).tolist()
    messages = [{"role": "system", "content": SYSTEM}] * system
    messages.append({"role": "user", "content": QUESTIONS[i % 8]})
    return llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

def watch(llm):
    """Sample the pool after every step through the step hook (the end of a run shows an empty
    pool): kv_cache_usage_perc, token_occupancy_perc, blocks in use, and blocks the live tables
    would hold if none were shared."""
    seen = []

    def record(report):
        tables = [s.block_table for r in llm.scheduler.running for s in r.seqs]
        seen.append((report.stats["kv_cache_usage_perc"], report.stats["token_occupancy_perc"],
                     len({b for t in tables for b in t}), sum(map(len, tables))))

    llm.on_step.append(record)
    return seen

def table(title, columns, rows):
    t = Table(title=title)
    for i, c in enumerate(columns):
        t.add_column(c, justify="left" if i == 0 else "right")
    for row in rows:
        t.add_row(*map(str, row))
    return t

def main():
    p = argparse.ArgumentParser(description="nanopaged benchmark: a mixed workload, block sharing")
    p.add_argument("--quick", action="store_true", help="small sizes, a minute or two on 2 cores")
    p.add_argument("--model", default=None,
                   help="None: SmolLM2-135M-Instruct; a local directory; random:<preset>")
    p.add_argument("--random-weights", action="store_true",
                   help="random weights of the smollm2-135m shape (no files)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--live", action="store_true", help="watch the pool and the block tables")
    args = p.parse_args()
    model = "random:smollm2-135m" if args.random_weights else args.model
    console = Console()
    # 1. a mixed workload: every other request shares a system prompt, one samples n=2
    llm = LLM(model, device=args.device, num_blocks=256 if args.quick else None)
    g = torch.Generator().manual_seed(0)
    n = 4 if args.quick else 8
    prompts = [prompt(llm, i, system=i % 2 == 0, g=g) for i in range(n)]
    params = [SamplingParams(temperature=0.7 if i % 3 == 0 else 0.0,
                             max_tokens=int(torch.randint(8, 48, (1,), generator=g)),
                             n=2 if i == 0 else 1, seed=i, ignore_eos=llm.tokenizer is None)
              for i in range(n)]
    seen = watch(llm)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, live=args.live)
    elapsed = time.perf_counter() - t0
    stats = llm.stats()
    where = (f"{model or 'smollm2'}; {platform.machine()}, {torch.get_num_threads()} threads, "
             f"{llm.device}, {llm.dtype}")
    console.print(table(f"Outputs ({where})", ["request.sample", "tokens", "text"],
                        [(f"{o.request_id}.{c.index}", len(c.token_ids),
                          repr(c.text[:60]) if c.text else c.token_ids[:8])
                         for o in outs for c in o.outputs]))
    rows = [(k, f"{v:.3f}" if isinstance(v, float) else v) for k, v in stats.items()]
    rows += [("peak kv_cache_usage_perc", f"{max(s[0] for s in seen):.3f}"),
             ("mean token_occupancy_perc over steps", f"{sum(s[1] for s in seen) / len(seen):.3f}"),
             ("steps", llm.num_steps),
             ("output tokens per second", f"{stats['num_generated_tokens'] / elapsed:.1f}"),
             ("mean ttft (s)", f"{sum(o.ttft for o in outs) / len(outs):.3f}")]
    console.print(table("Engine metrics", ["metric", "value"], rows))
    # 2. sharing: beams and samples of one prompt, blocks held at peak against unshared tables
    rows = []
    max_tokens = 16 if args.quick else 64
    beams = BeamSearchParams(4, max_tokens)
    samples = SamplingParams(temperature=1.0, n=4, max_tokens=max_tokens, ignore_eos=True)
    for name, run in (("beam search, width 4",
                       lambda l, p: l.beam_search([p], beams, live=args.live)),
                      ("sampling, n=4", lambda l, p: l.generate([p], samples, live=args.live))):
        llm = LLM(model, device=args.device, num_blocks=512)
        seen = watch(llm)
        run(llm, prompt(llm, 4) if llm.tokenizer else list(range(1, 60)))
        shared = max(s[2] for s in seen)
        unshared = max(s[3] for s in seen)
        rows.append((name, shared, unshared, f"{shared / unshared:.0%}",
                     llm.stats()["num_cow_copies"]))
    console.print(table("Sharing between samples and beams (block_size 16, peak blocks)",
                        ["workload", "blocks with sharing", "blocks without", "share of unshared",
                         "copy-on-write copies"], rows))

if __name__ == "__main__":
    main()

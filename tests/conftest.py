"""Shared helpers: run an engine with its invariants checked after every step, and the transformers oracle."""
import itertools
import os
import sys

# the Triton kernel runs on the CPU through Triton's interpreter (set before anything imports triton)
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
torch.set_num_threads(2)


# ids for the sequences tests make outside an engine (an engine counts its own: Scheduler.seq_ids)
SEQ_IDS = itertools.count()

def computed(bm, tokens):
    """A prompt as the engine computes it: allocated, every token computed, its full blocks
    registered in the prefix cache."""
    from nanopaged import Sequence
    seq = Sequence(next(SEQ_IDS), tokens)
    bm.allocate(seq)
    seq.num_computed_tokens = len(seq)
    bm.cache_full_blocks(seq)
    bm.check_invariants()
    return seq


def checked(llm):
    """Make every engine step end with check_invariants() (through the step hook); returns llm."""
    llm.on_step.append(lambda report: llm.block_manager.check_invariants())
    return llm


def running_seqs(llm):
    """Every sequence of every running request, oldest request first."""
    return [s for r in llm.scheduler.running for s in r.seqs]


def assert_no_block_held(llm):
    """After a run every block is free or cached and no sequence holds any."""
    bm = llm.block_manager
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks, f"{bm.num_blocks - bm.num_free_blocks} blocks still held"
    assert not any(pool.seqs for pool in bm.tiers) and not bm.copies
    assert not llm.scheduler.running and not llm.scheduler.waiting and not llm.scheduler.swapped


def step_without_model(llm, token=0):
    """One engine step as LLM.step takes it, but no model runs: schedule, make the block copies,
    advance every sequence; each whose chunk reaches its last token samples `token` (an n>1
    request's first: n of them, so that its samples fork). Scheduling and the block manager
    alone, for the labs that pin them. Checks the invariants; returns the ScheduledBatch."""
    import nanopaged
    llm.events.step = llm.num_steps + 1
    batch = llm.scheduler.schedule()
    # made at once, blocking, whether or not the engine has a copy engine
    nanopaged.Engine._make_copies(llm, batch)
    sampled = {}
    for request, seq, num_new in batch.entries:
        if seq.num_computed_tokens + num_new == len(seq):
            n = 1 if request.past_first_token else request.params.n
            sampled[seq] = [token] * n
    llm.scheduler.postprocess(batch, sampled)
    llm.num_steps += 1
    llm.block_manager.check_invariants()
    return batch


def hf_greedy(hf, prompt_ids, max_new_tokens):
    """transformers' own greedy generate, one prompt at a time: the oracle for the paged engine."""
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                          max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


@pytest.fixture(scope="session")
def default_hf():
    from model import load_hf
    return load_hf(None, 0)   # load_model's key: the default model loads once a run

"""Ctrl-C at any moment: a real SIGINT sent at every statement the engine runs inside a
generate() or beam_search() call (n=3 seeded samples, beams, a pool so tight that requests are
preempted by swap or by recompute, a request queued alongside) leaves the engine whole: the
interrupted call's requests are gone with their blocks, the queued one finishes with the tokens
of a run that was never interrupted, and the same LLM then gives a fresh engine's outputs."""
import os
import signal
import sys
from collections import Counter

import pytest

import nanopaged
from conftest import assert_no_block_held
from nanopaged import LLM, BeamSearchParams, RequestStatus, SamplingParams

ENGINE = dict(block_size=4, num_blocks=12, num_cpu_blocks=12, max_num_seqs=6,
              max_num_batched_tokens=8)
QUEUED = ([[1, 2, 3, 4, 5, 6, 7]], SamplingParams(temperature=1.0, n=2, seed=7, max_tokens=8))
CALLS = {   # the interrupted call: its prompts, params, and how it is made
    "generate": ([[1, 2, 3, 4, 5, 6, 7, 8, 9], [11, 12, 13, 14, 15]],
                 [SamplingParams(temperature=1.0, n=3, seed=1, max_tokens=10),
                  SamplingParams(temperature=0, max_tokens=12)]),
    "beam_search": ([[21, 22, 23, 24, 25, 26, 27, 28, 29, 30], [1, 2, 3, 4, 5, 6, 7, 8]],
                    BeamSearchParams(beam_width=3, max_tokens=8)),
}


def call(llm, kind):
    prompts, params = CALLS[kind]
    outs = getattr(llm, kind)(prompts, params)
    if kind == "generate":
        return [[c.token_ids for c in o.outputs] for o in outs]
    return [[s.token_ids for s in o.sequences] for o in outs]


def finish(llm, request_ids):
    """Step until nothing is left; the outputs of these requests, as token-id lists."""
    while llm.scheduler.has_unfinished():
        llm.step()
    return [[c.token_ids for c in llm.output(r).outputs] for r in request_ids]


@pytest.fixture(autouse=True)
def sigint_raises():
    """SIGINT raises KeyboardInterrupt here, even under a runner started with it ignored (as a
    background job is)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def engine(mode, seen_seqs):
    llm = LLM("random:tiny", preemption_mode=mode, **ENGINE)
    llm.on_step.append(lambda report: seen_seqs.append(
        sum(len(r.seqs) for r in llm.scheduler.running)))
    return llm


class Interrupt:
    """A trace function that sends SIGINT to this process (or raises `error`) when the engine's
    code reaches `line` for the `occurrence`-th time (sys.settrace, lines of nanopaged.py only).
    Without a line, it keeps every line run, in order."""

    def __init__(self, line=None, occurrence=1, error=None):
        self.line, self.left, self.error = line, occurrence, error
        self.lines = []
        self.sent = False

    def __call__(self, frame, event, arg):   # the global trace: only frames of nanopaged.py
        return self.local if frame.f_code.co_filename == nanopaged.__file__ else None

    def local(self, frame, event, arg):
        if self.sent:
            return None
        if event == "line" and self.line is None:
            self.lines.append((frame.f_lineno, in_step(frame)))
        elif event == "line" and frame.f_lineno == self.line:
            self.left -= 1
            if self.left == 0:
                self.sent = True
                if self.error:   # raised here, it surfaces in the engine's frame, at that line
                    raise self.error
                os.kill(os.getpid(), signal.SIGINT)
        return self.local


def in_step(frame):   # is LLM.step on the stack?
    while frame is not None and frame.f_code is not LLM.step.__code__:
        frame = frame.f_back
    return frame is not None


def traced(llm, kind, interrupt):
    sys.settrace(interrupt)
    try:
        return call(llm, kind)
    finally:
        sys.settrace(None)


def lines_run(mode, kind):
    """Every line of nanopaged.py the call runs, in order, with a request queued alongside."""
    llm = engine(mode, [])
    llm.add_requests(*QUEUED)
    counter = Interrupt()
    traced(llm, kind, counter)
    stats = llm.stats()   # the call preempts, copies on write, and swaps if the mode says so
    assert stats["num_preemptions"] > 0 and stats["num_cow_copies"] > 0
    assert (stats["num_swapped_out_blocks"] > 0) == (mode == "swap")
    return counter.lines


def points(mode, kind, in_steps_only=False):
    """Where to interrupt, as (line, occurrence): the first time each line runs (in the first
    case; later cases, the lines it did not run), and for every fourth line that runs more than
    twice, a time in the middle of the run, where requests are preempted."""
    counts = Counter(line for line, in_a_step in lines_run(mode, kind)
                     if in_a_step or not in_steps_only)
    first = set() if (mode, kind) == CASES[0] else {line for line, _ in lines_run(*CASES[0])}
    again = [(line, n // 2) for line, n in counts.items() if n > 2]
    return [(line, 1) for line in counts if line not in first] + again[::4]


CASES = [("swap", "generate"), ("recompute", "generate"), ("swap", "beam_search"),
         ("recompute", "beam_search")]


@pytest.mark.parametrize("mode, kind", CASES)
def test_sigint_at_every_statement_leaves_the_engine_whole(mode, kind):
    check_every_point(mode, kind, points(mode, kind), KeyboardInterrupt)


def test_an_error_at_every_third_statement_of_a_step_leaves_the_engine_whole():
    """The same for an error raised inside a step (here from the trace function)."""
    where_to = points(*CASES[0], in_steps_only=True)[::3]
    check_every_point(*CASES[0], where_to, RuntimeError("injected"))


def check_every_point(mode, kind, where_to, error):
    """error: KeyboardInterrupt (a SIGINT is sent) or an exception to raise."""
    expected = KeyboardInterrupt if error is KeyboardInterrupt else type(error)
    fresh = engine(mode, [])
    queued = fresh.add_requests(*QUEUED)
    want_call = call(fresh, kind)
    want_queued = finish(fresh, queued)
    interrupted = 0
    for i, (line, occurrence) in enumerate(where_to):
        where = f"{expected.__name__} at nanopaged.py:{line} (time {occurrence})"
        seen_seqs = []
        llm = engine(mode, seen_seqs)
        queued = llm.add_requests(*QUEUED)
        interrupt = Interrupt(line, occurrence, None if error is KeyboardInterrupt else error)
        try:
            traced(llm, kind, interrupt)
        except expected:
            interrupted += 1
            llm.block_manager.check_invariants()
            # the call's own requests are gone, the queued one is there, once
            assert list(llm.requests) == queued, where
            sched = llm.scheduler
            request = llm.requests[queued[0]]
            queues = [*sched.waiting, *sched.running, *sched.swapped]
            assert queues.count(request) == (request.status is not RequestStatus.FINISHED), where
            assert len(request.seqs) + len(request.finished) <= QUEUED[1].n, where
            holders = {s for pool in llm.block_manager.tiers for s in pool.seqs}
            assert holders <= {s.seq_id for s in request.seqs}, where
        else:   # the line was not reached this time: no SIGINT was sent
            assert not interrupt.sent, f"{where}: lost"
        # the queued request ends with the tokens of a run never interrupted (its random stream
        # and its K/V are as they were), and, every tenth time, the same LLM makes the call again
        assert finish(llm, queued) == want_queued, where
        assert_no_block_held(llm)
        if i % 10 == 0:
            assert call(llm, kind) == want_call, f"the same LLM, after {where}"
            assert_no_block_held(llm)
        assert max(seen_seqs, default=0) <= ENGINE["max_num_seqs"], where
    assert interrupted >= len(where_to) // 2

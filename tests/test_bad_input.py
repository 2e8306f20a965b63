"""Hostile input, tried as a user would: each bad value gets a ValueError at the API (or one line
and exit status 2 on the command line) before any work starts, no output is lost while it is
made, the view never passes control characters to the terminal, and occupancy counts only the
slots whose K/V are written."""
import io
import os
import subprocess
import sys

import pytest
import torch
from rich.console import Console

import nanopaged
from conftest import assert_no_block_held, checked
from nanopaged import (DEMOS, LLM, BeamSearchParams, SamplingParams, ScheduledBatch, View,
                       checked_requests, demo_pool, demo_arrivals)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOOD = [5, 6, 7, 8, 9, 10]
GREEDY = SamplingParams(temperature=0, max_tokens=4)

BAD_ENGINE_ARGUMENTS = {   # each used to pass the checks and fail later, after the model loaded
    "dtype=torch.int64": (dict(dtype=torch.int64), "dtype"),
    "dtype=torch.bool": (dict(dtype=torch.bool), "dtype"),
    "device='cudaXYZ'": (dict(device="cudaXYZ"), "device"),
    "num_cpu_blocks=10**12": (dict(num_cpu_blocks=10 ** 12), "num_cpu_blocks"),
    "num_blocks=10**9": (dict(num_blocks=10 ** 9), "num_blocks 1000000000"),   # 8 TB
    "block_size=2**40": (dict(block_size=2 ** 40), "bytes exceed"),   # one block: 8 PB
    "disk_path without a disk": (dict(disk_path="kv.bin"), "num_disk_blocks > 0"),
    "a disk and no prefix cache": (dict(num_disk_blocks=8, enable_prefix_caching=False),
                                   "num_disk_blocks"),   # nothing would ever be written down
    # every step failed inside (islice takes no stop past sys.maxsize); the largest allowed named
    "max_num_seqs=10**30": (dict(max_num_seqs=10 ** 30), r"max_num_seqs .* \[1, 2147483647\]"),
    # the first copy failed (a wait past the timer's range); the floor named
    "tier_gbps 1e-300": (dict(tier_gbps={"host": 1e-300}, num_cpu_blocks=4), r"GB/s >= 1e-09"),
}
if not torch.cuda.is_available():
    BAD_ENGINE_ARGUMENTS["device='cuda' without CUDA"] = (dict(device="cuda"), "CUDA")


@pytest.mark.parametrize("case", list(BAD_ENGINE_ARGUMENTS))
def test_bad_engine_argument_is_a_value_error(case):
    """An LLM argument the engine cannot run with is a ValueError naming it."""
    kwargs, match = BAD_ENGINE_ARGUMENTS[case]
    with pytest.raises(ValueError, match=match):
        LLM("random:tiny", **{"num_blocks": 16, **kwargs})


def test_a_torch_device_is_accepted():
    """device=torch.device('cpu') is the same engine as device='cpu'."""
    llm = LLM("random:tiny", device=torch.device("cpu"), num_blocks=16)
    want = LLM("random:tiny", device="cpu", num_blocks=16).generate([GOOD], GREEDY)
    assert llm.generate([GOOD], GREEDY)[0].outputs[0].token_ids == want[0].outputs[0].token_ids


@pytest.mark.parametrize("length_penalty", [300, -300, 10.5])
def test_a_length_penalty_that_could_overflow_is_refused(length_penalty):
    """length ** length_penalty must stay a finite, nonzero float: the penalty is bounded."""
    with pytest.raises(ValueError, match="length_penalty"):
        BeamSearchParams(beam_width=2, length_penalty=length_penalty)


def test_the_largest_length_penalties_score_without_error():
    """At the bounds, beam search runs and returns finite scores, best first."""
    llm = LLM("random:tiny", block_size=4, num_blocks=64)
    for length_penalty in (10, -10):
        params = BeamSearchParams(beam_width=2, max_tokens=6, length_penalty=length_penalty)
        scores = [s.score for s in llm.beam_search([GOOD], params)[0].sequences]
        assert all(abs(s) < float("inf") for s in scores) and scores == sorted(scores, reverse=True)
    assert_no_block_held(llm)


def test_an_error_while_an_output_is_made_loses_nothing(monkeypatch):
    """If making a finished request's output raises, the request stays to be taken again."""
    llm = LLM("random:tiny", block_size=4, num_blocks=64)
    params = BeamSearchParams(beam_width=2, max_tokens=4)
    [request_id] = llm.add_requests([GOOD], params, kind=BeamSearchParams)
    while llm.scheduler.has_unfinished():
        llm.step()
    real = nanopaged.beam_output

    def broken(*args):
        raise ZeroDivisionError("injected")

    monkeypatch.setattr(nanopaged, "beam_output", broken)
    with pytest.raises(ZeroDivisionError):
        llm.output(request_id)
    monkeypatch.setattr(nanopaged, "beam_output", real)
    want = LLM("random:tiny", block_size=4, num_blocks=64).beam_search([GOOD], params)[0]
    assert [s.token_ids for s in llm.output(request_id).sequences] == \
        [s.token_ids for s in want.sequences]


BAD_COMMAND_LINES = [   # each printed a traceback, or failed only after the run
    ["--block-size", "3"], ["--block-size", "0"], ["--num-blocks", "0"], ["--num-blocks", "5"],
    ["--max-num-batched-tokens", "0"], ["--num-cpu-blocks", "-1"],
    ["--model", "random:nonsense"], ["--preemption-mode", "swap", "--num-cpu-blocks", "0"],
    ["--delay", "-1", "--trace"], ["--delay", "nan", "--trace"], ["--delay", "1"],
    ["--num-blocks", "1000000000"], ["--block-size", str(2 ** 40)],
    ["--trace", "--delay", "1e10"],
    ["--disk-path", "kv.bin"],   # the default demo has no disk tier: the path would do nothing
    ["--watermark-blocks", "-1"],
    ["--max-num-seqs", str(10 ** 30)], ["--host-gbps", "1e-300"],   # passed, then failed inside
    ["--svg", "/no/such/folder"], ["--svg", __file__],   # the images' folder: none, a file
]


@pytest.mark.parametrize("argv", BAD_COMMAND_LINES, ids=" ".join)
def test_a_bad_command_line_is_one_line_and_exit_status_2(argv):
    """python nanopaged.py with a bad value prints one line, `error:` and why, and exits 2."""
    model = [] if "--model" in argv else ["--model", "random:tiny"]
    run = subprocess.run([sys.executable, "nanopaged.py", *model, *argv], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    lines = run.stderr.strip().splitlines()
    assert (run.returncode, len(lines)) == (2, 1), run.stderr
    assert "error:" in lines[0] and "Traceback" not in run.stderr and not run.stdout


@pytest.mark.parametrize("argv, kwargs", [
    (["--max-num-seqs", str(10 ** 30)], dict(max_num_seqs=10 ** 30)),
    (["--host-gbps", "1e-300"], dict(tier_gbps={"host": 1e-300})),
], ids=["max-num-seqs", "host-gbps"])
def test_the_command_line_gives_the_api_s_error_for_a_count_or_link_out_of_range(argv, kwargs):
    """A count past the largest allowed, a link slower than the floor: the command line prints
    the ValueError that LLM() raises, on one line, and exits 2."""
    with pytest.raises(ValueError) as error:
        LLM("random:tiny", num_blocks=16, **kwargs)
    run = subprocess.run([sys.executable, "nanopaged.py", "--model", "random:tiny", *argv],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert (run.returncode, run.stderr) == (2, f"nanopaged.py: error: {error.value}\n")


def test_the_largest_counts_allowed_run():
    """max_num_seqs and max_num_batched_tokens at their largest allowed (2**31 - 1) serve as the
    defaults do: every value that passes the guards runs."""
    largest = dict(max_num_seqs=nanopaged.MAX_COUNT, max_num_batched_tokens=nanopaged.MAX_COUNT)
    llm = checked(LLM("random:tiny", block_size=4, num_blocks=16, **largest))
    want = LLM("random:tiny", block_size=4, num_blocks=16).generate([GOOD] * 3, GREEDY)
    outs = llm.generate([GOOD] * 3, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in want]
    assert_no_block_held(llm)


@pytest.mark.parametrize("block_size", [1, 2, 8])
@pytest.mark.parametrize("name", list(DEMOS))
def test_every_demo_pool_fits_its_requests_at_any_block_size(name, block_size):
    """A demo's pool is counted in tokens: at block size 1 or 2 its requests still fit."""
    llm = LLM("random:tiny", block_size=block_size, **demo_pool(name, block_size))
    for _, prompts, params, *priority in demo_arrivals(name, llm):   # (priority: its demo)
        assert checked_requests(llm, prompts, params, type(params), *priority)


def test_the_view_escapes_control_characters():
    """A prompt holding ESC [2J (clear screen) and a tab reaches the view escaped, never raw."""
    llm = LLM(block_size=4, num_blocks=64)   # the default model: text through its tokenizer
    console = Console(record=True, width=120, color_system=None, file=io.StringIO())
    with View(llm, live=False, console=console):
        llm.generate(["Hi \x1b[2J\tthere"], SamplingParams(temperature=0, max_tokens=2))
    text = console.export_text()
    assert "\x1b" not in text and "\t" not in text
    assert "\\x1b[2J\\tthere" in text


def test_occupancy_counts_only_written_slots_of_a_recomputed_n_gt_1_request():
    """A recomputed n=2 request's second sample shares blocks its leader has not yet written: they
    count as stored only once written (token_occupancy_perc and the view's last-block fill)."""
    llm = checked(LLM("random:tiny", block_size=4, num_blocks=64, max_num_batched_tokens=4,
                      enable_prefix_caching=False))
    llm.add_requests([list(range(20, 36))], SamplingParams(temperature=0, n=2, max_tokens=8))
    while llm.num_steps < 7:   # 4 prefill chunks, the fork, 3 decodes
        llm.step()
    [request] = llm.scheduler.running
    assert len(request.seqs) == 2
    llm.scheduler.preempt(request, ScheduledBatch(budget=4), mode="recompute")
    report = llm.step()   # the leader computes one 4-token chunk; its sibling waits for it
    leader, sibling = request.seqs
    assert sibling.waits_for is leader and leader.num_computed_tokens == 4
    used = llm.block_manager.num_used_blocks()
    assert report.stats["token_occupancy_perc"] == 4 / (used * 4)   # the leader's 4 slots alone
    while llm.scheduler.has_unfinished():
        llm.step()
    assert_no_block_held(llm)


BAD_BENCH_COMMAND_LINES = [   # each ran an experiment first, then a traceback or exit status 0
    ["--model", "nonsense"], ["--model", "random:nonsense"],
    ["--json", os.path.join("no", "such", "folder", "bench.json")],
    ["--json", "."], ["--json", ""],
]
if not torch.cuda.is_available():
    BAD_BENCH_COMMAND_LINES.append(["--device", "cuda"])


@pytest.mark.parametrize("argv", BAD_BENCH_COMMAND_LINES, ids=" ".join)
def test_a_bad_bench_command_line_is_one_line_and_exit_status_2_before_any_experiment(argv):
    """python bench.py with a bad value prints one line and exits 2 before any experiment runs
    (--only memory runs on random:tiny whatever --model says: it used to run, then fail or pass)."""
    run = subprocess.run([sys.executable, "bench.py", "--quick", "--only", "memory", *argv],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    lines = run.stderr.strip().splitlines()
    assert (run.returncode, len(lines)) == (2, 1), run.stderr
    assert "error:" in lines[0] and "Traceback" not in run.stderr and not run.stdout


BAD_CALLS = {   # each raised a TypeError or an AttributeError, or was accepted
    "beam_search(prompts, None)": lambda llm: llm.beam_search([GOOD], None),
    "output([1])": lambda llm: llm.output([1]),
    "add_requests(kind=int)": lambda llm: llm.add_requests([GOOD], kind=int),
    "generate(live='yes')": lambda llm: llm.generate([GOOD], GREEDY, live="yes"),
}


@pytest.mark.parametrize("case", list(BAD_CALLS))
def test_a_bad_call_is_a_value_error_and_the_engine_serves_on(case):
    """A bad argument to a call is a ValueError; a request queued before it ends with the tokens
    it has alone, and nothing is held."""
    llm = checked(LLM("random:tiny", block_size=4, num_blocks=64))
    [queued] = llm.add_requests([GOOD], GREEDY)
    with pytest.raises(ValueError):
        BAD_CALLS[case](llm)
    while llm.scheduler.has_unfinished():
        llm.step()
    want = LLM("random:tiny", block_size=4, num_blocks=64).generate([GOOD], GREEDY)
    assert llm.output(queued).outputs[0].token_ids == want[0].outputs[0].token_ids
    assert_no_block_held(llm)


def test_an_output_path_is_writable_only_as_a_regular_file_or_a_new_one(tmp_path):
    """bench --json takes a new file or a regular one; a folder, a FIFO (opening it would
    wait forever) and a symlink to nowhere are refused, and the check changes nothing."""
    fifo, link, old = tmp_path / "fifo", tmp_path / "link.json", tmp_path / "old.json"
    os.mkfifo(fifo)
    link.symlink_to(tmp_path / "target.json")
    old.write_text("kept")
    assert [nanopaged.writable(str(p)) for p in (tmp_path, fifo, link, "")] == [False] * 4
    assert nanopaged.writable(str(old)) and nanopaged.writable(str(tmp_path / "new.json"))
    assert sorted(os.listdir(tmp_path)) == ["fifo", "link.json", "old.json"]
    assert link.is_symlink() and old.read_text() == "kept"

"""The live view shows the engine as it is: every block id, ref count, state and metric it draws
equals the BlockManager's and the scheduler's at the same step. Traces repeat exactly and carry
every event their demo provokes; a frame fits 80x24; thousands of blocks fold into a grid."""
import io
import os
import re
import subprocess
import sys

import pytest
from rich.console import Console

from conftest import assert_no_block_held, checked
from nanopaged import DEMO_POOLS, DEMOS, LLM, RequestStatus, View, demo_text, demo_waves

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def expected_cell(block):
    if block.ref_count:
        return str(block.ref_count) if block.ref_count < 10 else "+"
    return "·" if block.hash is not None else "."


def check_frame(text, llm, report):
    """Parse one drawn frame and hold every figure in it to the engine at this step."""
    bm, stats = llm.block_manager, report.stats
    lines = text.splitlines()
    first = re.match(r"step (\d+) \| usage (\d+)% \((\d+)/(\d+) blocks\) \| occupancy (\d+)% \| "
                     r"hit rate (\d+)%", lines[0]).groups()
    assert first == (str(report.step), f"{stats['kv_cache_usage_perc']:.0%}"[:-1],
                     str(bm.num_used_blocks()), str(bm.num_blocks),
                     f"{stats['token_occupancy_perc']:.0%}"[:-1],
                     f"{stats['prefix_cache_hit_rate']:.0%}"[:-1])
    second = re.match(r"preemptions (\d+) \| swapped out (\d+) in (\d+) \| copies (\d+) \| "
                      r"evictions (\d+)", lines[1]).groups()
    assert tuple(map(int, second)) == (stats["num_preemptions"], stats["num_swapped_out_blocks"],
                                       stats["num_swapped_in_blocks"], stats["num_cow_copies"],
                                       stats["num_evictions"])
    # the pools: every block's cell, the device pool left of the bar, the CPU pool right of it
    legend = next(i for i, line in enumerate(lines) if line.startswith("digits:"))
    shown = {"device": {}, "cpu": {}}
    for line in lines[3:legend]:
        for pool, part in zip(("device", "cpu"), line.split("│")):
            if part.strip():
                start, cells = re.match(r"\s*(\d+) (\S*)", part).groups()
                shown[pool].update((int(start) + i, c) for i, c in enumerate(cells))
    assert shown["device"] == {b.block_id: expected_cell(b) for b in bm.device.blocks}
    assert shown["cpu"] == {b.block_id: expected_cell(b) for b in bm.cpu.blocks}
    # the sequences: every live one, with its request, state, block table and last block's fill
    sched = llm.scheduler
    live = {s.seq_id: (r, s) for q in (sched.running, sched.swapped, sched.waiting)
            for r in q for s in r.seqs}
    rows = [re.match(r"\s*(\d+)\s+(\d+)\s+(\w+)\s+\[([^\]]*)\]\s+(\d+)/(\d+)", line)
            for line in lines[legend + 2:]]
    rows = [row.groups() for row in rows if row]
    assert sorted(int(row[0]) for row in rows) == sorted(live)
    for seq_id, request_id, state, ids, fill, block_size in rows:
        request, seq = live[int(seq_id)]
        pool = bm.cpu.blocks if request.status is RequestStatus.SWAPPED else bm.device.blocks
        want = [f"{b}*" if pool[b].ref_count > 1 else str(b) for b in seq.block_table]
        if len(want) > 8:
            want = want[:3] + [f"...{len(want)}..."] + want[-3:]
        assert (int(request_id), state, ids.split()) == (request.request_id, request.status.value, want)
        last = len(seq.block_table) - 1   # tokens with K/V in the last block of the table
        in_last = sum(1 for p in range(seq.num_computed_tokens) if p // bm.block_size == last)
        assert (int(fill), int(block_size)) == (in_last, bm.block_size)
    # the events of this step, in their words
    for event in (e for e in report.events if e.kind != "allocate"):
        assert f"{event.step:>5}  {event.words()}" in lines


def test_view_shows_every_block_table_and_metric_as_the_engine_has_them():
    """On a run with prefix hits, forks with copy-on-write, a swap and evictions, every frame's
    cells, tables, states and metrics equal the engine's at that step."""
    llm = checked(LLM("random:tiny", block_size=4, **DEMO_POOLS["mix"]))
    console = Console(record=True, width=200, color_system=None, file=io.StringIO())
    kinds = set()

    def check(report):
        check_frame(console.export_text(clear=True).split("\n", 1)[1], llm, report)
        kinds.update(e.kind for e in report.events)

    with View(llm, live=False, console=console):
        llm.on_step.append(check)   # after the view: it reads the frame this step drew
        for prompts, params in demo_waves("mix", demo_text(llm)):
            if hasattr(params, "beam_width"):
                llm.beam_search(prompts, params)
            else:
                llm.generate(prompts, params)
    assert {"prefix hit", "fork", "copy", "swap out", "swap in", "evict"} <= kinds
    assert_no_block_held(llm)


def test_a_frame_fits_an_80x24_terminal():
    """Every frame of the default demo fits 80 columns and 24 lines, thousands of blocks too."""
    for num_blocks in (DEMO_POOLS["mix"]["num_blocks"], 5000):
        llm = LLM("random:tiny", block_size=4, **{**DEMO_POOLS["mix"], "num_blocks": num_blocks})
        console = Console(width=80, height=24, file=io.StringIO(), color_system=None)
        view = View(llm, live=True, console=console)   # not entered: frames are only measured
        sizes = []
        llm.on_step.append(lambda report: sizes.append(
            console.render_lines(view.frame(report, view.events), pad=False)))
        for prompts, params in demo_waves("mix", demo_text(llm))[:2]:
            llm.generate(prompts, params)
        assert max(len(lines) for lines in sizes) <= 24
        assert max(sum(len(s.text) for s in line) for lines in sizes for line in lines) <= 80
        if num_blocks == 5000:   # folded: each cell stands for several blocks
            assert "blocks a cell" in "".join(s.text for s in sizes[0][2])


TRACE_WORDS = {   # what each demo's trace must show: the plain words of the events it provokes
    "mix": ["finds blocks", "forks from", "copies shared block", "is evicted", "swapped out:",
            "swapped in:", "preempted by swap", "preempted by recompute", "finishes"],
    "prefix": ["finds blocks"],
    "fork": ["forks from", "copies shared block"],
    "beam": ["forks from", "copies shared block", "finishes (pruned)"],
    "preempt": ["preempted by swap", "swapped out:", "swapped in:", "preempted by recompute"],
    "evict": ["is evicted", "finds blocks"],
}


def trace(demo):
    command = [sys.executable, "nanopaged.py", "--model", "random:tiny", "--demo", demo, "--trace"]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=True).stdout


@pytest.mark.parametrize("demo", list(DEMOS))
def test_trace_shows_every_event_its_demo_provokes(demo):
    """`--trace` prints a snapshot per step with the words of each event kind the demo is for."""
    out = trace(demo)
    assert "--- step 1 ---" in out
    for words in TRACE_WORDS[demo]:
        assert words in out, f"the {demo} trace has no {words!r}"


def test_trace_repeats_exactly():
    """Two runs of the default demo's trace print the same text, character for character."""
    assert trace("mix") == trace("mix")


def test_svg_keeps_the_busiest_step(tmp_path):
    """--svg saves, as an SVG image, the frame of the step with the most blocks in use."""
    path = tmp_path / "view.svg"
    out = subprocess.run([sys.executable, "nanopaged.py", "--model", "random:tiny", "--demo", "fork",
                          "--svg", str(path)], cwd=ROOT, capture_output=True, text=True, check=True)
    svg = path.read_text()
    assert svg.startswith("<svg") and "device" in svg and "pool" in svg
    assert "num_cow_copies" in out.stdout   # the run itself printed as without a view

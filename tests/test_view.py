"""The live view shows the engine as it is: every block id, ref count, state and metric it draws
equals the BlockManager's and the scheduler's at the same step. Traces repeat exactly and carry
every event their demo provokes; a frame fits 80x24; thousands of blocks fold into a grid."""
import functools
import html
import io
import os
import re
import subprocess
import sys

import pytest
from rich.console import Console

from conftest import assert_no_block_held, checked
from nanopaged import (DEMO_POOLS, DEMOS, LLM, RequestStatus, SamplingParams, View,
                       demo_arrivals, demo_pool, table_text, wrapped)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def expected_cell(block):
    if block.ref_count:
        return str(block.ref_count) if block.ref_count < 10 else "+"
    return "·" if block.hash is not None else "."


def expand_table(text):
    """'[0-2* 5 (+3) 9]' -> ([(0, '*'), (1, '*'), (2, '*'), (5, '')], 3, [(9, '')])."""
    head, hidden, tail = [], 0, []
    for part in text.strip("[]").split():
        if part.startswith("(+"):
            hidden, head, tail = int(part[2:-1]), tail, []
            continue
        mark = "*" if part.endswith("*") else ""
        first, _, last = part.rstrip("*").partition("-")
        tail += [(b, mark) for b in range(int(first), int(last or first) + 1)]
    return (tail, 0, []) if not hidden else (head, hidden, tail)


def expand_ids(text):
    """'0-2, 5' (the event log's runs) -> [0, 1, 2, 5]."""
    ids = []
    for part in text.split(", "):
        first, _, last = part.partition("-")
        ids += range(int(first), int(last or first) + 1)
    return ids


def check_frame(text, llm, report):
    """Parse one drawn frame and hold every figure in it to the engine at this step."""
    bm, stats = llm.block_manager, report.stats
    lines = text.splitlines()
    header = []   # the K/V dtype and bytes of a block: the device's, then each tier's unlike it
    while not lines[0].startswith("step "):
        header.append(lines.pop(0).strip())
    caches, sizes = llm.kv_caches, llm.copier.bytes_per_block
    tiers = [t for t in ("device", "host", "disk")
             if t == "device" or caches[t].dtype != caches["device"].dtype]
    assert " ".join(header) == "KV cache: " + " | ".join(
        f"{t} {str(caches[t].dtype)[6:]} ({sizes[t]:,} bytes a block)" for t in tiers)
    first = re.match(r"step (\d+) \| usage (\d+)% \((\d+)/(\d+) blocks\) \| cached (\d+) \| "
                     r"occupancy (\d+)% \| hit rate (\d+)%", lines[0]).groups()
    assert first == (str(report.step), f"{stats['kv_cache_usage_perc']:.0%}"[:-1],
                     str(bm.num_used_blocks()), str(bm.num_blocks),
                     str(len(bm.device.cached_block_ids)),
                     f"{stats['token_occupancy_perc']:.0%}"[:-1],
                     f"{stats['prefix_cache_hit_rate']:.0%}"[:-1])
    second = re.match(r"preemptions (\d+) \| swapped out (\d+) in (\d+) \| copies (\d+) \| "
                      r"evictions (\d+)(?: \| written down (\d+) \| loaded (\d+) blocks \(host "
                      r"(\d+), disk (\d+)\))?", lines[1]).groups()
    tiers = len(bm.host.blocks) + len(bm.disk.blocks) > 0
    assert (second[5] is not None) == tiers
    assert tuple(int(x) for x in second if x is not None) == (
        stats["num_preemptions"], stats["num_swapped_out_blocks"], stats["num_swapped_in_blocks"],
        stats["num_cow_copies"], stats["num_evictions"]) + (
        stats["num_offloaded_blocks"], stats["num_loaded_blocks"],   # all in blocks
        stats["host_prefix_cache_hits"] // bm.block_size,
        stats["disk_prefix_cache_hits"] // bm.block_size) * tiers
    # what the step ran: each prefill chunk's positions, the decodes
    pool_top = next(i for i, line in enumerate(lines) if line.startswith("device "))
    ran = " ".join(lines[2:pool_top])
    for _, seq, n in report.batch.entries:
        start = seq.num_computed_tokens - n
        if start < seq.prefill_until:
            assert f"seq {seq.seq_id} prefill {start}-{start + n - 1} of {seq.prefill_until}" in ran
    assert ran.startswith(f"ran {report.batch.num_tokens} token")
    # the decodes' slots, by seq id: where each wrote its last token's K/V (slot_mapping)
    wrote = {}
    for _, seq, n in report.batch.entries:
        position = seq.num_computed_tokens - 1
        if position >= seq.prefill_until and seq.block_table:   # a decode whose table is still up
            block = seq.block_table[position // bm.block_size]
            wrote[seq.seq_id] = block * bm.block_size + position % bm.block_size
    into = re.search(r"seqs? ([\d, -]+) decode into slots ([\d, ]+)$", ran)
    assert into or not wrote   # at 200 columns the slots always fit
    if into:
        shown = dict(zip(expand_ids(into[1]), (int(x) for x in into[2].split(", "))))
        assert all(shown[seq_id] == slot for seq_id, slot in wrote.items())
    # the pools: every block's cell, each pool's rows led by its name, then the first block's id
    legend = next(i for i, line in enumerate(lines) if line.startswith("digit:"))
    shown, pool = {"device": {}, "host": {}, "disk": {}}, None
    for line in lines[pool_top:legend]:
        name, start, cells = re.match(r"(device|host|disk)?\s+(\d+) (\S+)$", line).groups()
        pool = name or pool
        shown[pool].update((int(start) + i, c) for i, c in enumerate(cells))
    for tier in bm.tiers:   # every tier with blocks has its rows
        assert shown[tier.name] == {b.block_id: expected_cell(b) for b in tier.blocks}
    # the sequences: every live one, with its request, state, K/V written and block table
    sched = llm.scheduler
    live = {s.seq_id: (r, s) for q in (sched.running, sched.swapped, sched.waiting)
            for r in q for s in r.seqs}
    header = next(i for i, line in enumerate(lines) if line.lstrip().startswith("seq  req"))
    rows = [re.match(r"\s*(\d+)\s+(\d+)\s+(\w+)\s+(\d+)/(\d+)\s+((?:host)?\[[^\]]*\])", line)
            for line in lines[header + 1:]]
    rows = [row.groups() for row in rows if row]
    assert sorted(int(row[0]) for row in rows) == sorted(live)
    for seq_id, request_id, state, written, length, table in rows:
        request, seq = live[int(seq_id)]
        assert (int(request_id), state) == (request.request_id, request.status.value)
        assert (int(written), int(length)) == (seq.num_written_tokens, len(seq))
        swapped = request.status is RequestStatus.SWAPPED
        pool = bm.host.blocks if swapped else bm.device.blocks
        assert table.startswith("host[") == swapped   # a table into the host pool says so
        want = [(b, "*" if pool[b].ref_count > 1 else "") for b in seq.block_table]
        head, hidden, tail = expand_table(table.removeprefix("host"))
        assert head + tail == want[:len(head)] + want[len(want) - len(tail):]
        assert len(head) + hidden + len(tail) == len(want) and len(table) <= 26
    # the events of this step, in their words (a wrapped one continues 7 columns in)
    joined = text.replace("\n       ", " ")
    for event in report.events:
        assert f"{event.step:>5}  {event.words()}" in joined


def run_arrivals(llm, arrivals):
    """Queue each (step, prompts, params[, priority]) once llm has run that many steps; run to
    the end."""
    for step, prompts, params, *priority in arrivals:
        while llm.num_steps < step and llm.scheduler.has_unfinished():
            llm.step()
        llm.add_requests(prompts, params, type(params), *priority)
    while llm.scheduler.has_unfinished():
        llm.step()
    for request_id in list(llm.requests):
        llm.output(request_id)


def test_view_shows_every_block_table_and_metric_as_the_engine_has_them():
    """On a run with prefix hits, forks with copy-on-write, a swap and evictions, every frame's
    cells, tables, K/V counts, states, batch and metrics equal the engine's at that step."""
    llm = checked(LLM("random:tiny", block_size=4, async_copies=False, **DEMO_POOLS["mix"]))
    console = Console(record=True, width=200, color_system=None, file=io.StringIO())
    kinds = set()

    def check(report):
        check_frame(console.export_text(clear=True).split("\n", 1)[1], llm, report)
        kinds.update(e.kind for e in report.events)

    with View(llm, live=False, console=console):
        llm.on_step.append(check)   # after the view: it reads the frame this step drew
        run_arrivals(llm, demo_arrivals("mix", llm))
    assert {"prefix hit", "fork", "copy", "swap out", "swap in", "evict"} <= kinds
    assert_no_block_held(llm)


def test_a_long_block_table_is_cut_in_its_middle_and_says_how_many_it_leaves_out():
    """A 40-block table fits its 26 columns: its first and last runs, and (+k) for the rest."""
    llm = LLM("random:tiny", block_size=4, num_blocks=128)
    pool = llm.block_manager.device.blocks
    table = [b for b in range(0, 120, 3)][:40]   # no two ids in a row: nothing folds into a run
    text = table_text(pool, table, 26)
    head, hidden, tail = expand_table(text)
    assert len(text) <= 26 and hidden > 0 and len(head) + hidden + len(tail) == 40
    assert [b for b, _ in head] == table[:len(head)] and [b for b, _ in tail] == table[-len(tail):]
    assert table_text(pool, list(range(40)), 26) == "[0-39]"


def frames_of(llm, arrivals, width, height):
    """Every live frame of the run at width x height: (report, rendered lines)."""
    console = Console(width=width, height=height, file=io.StringIO(), color_system=None)
    view = View(llm, live=True, console=console)   # not entered: frames are only measured
    frames = []

    def draw(report):
        lines = console.render_lines(view.frame(report, height), pad=False)
        frames.append((report, ["".join(s.text for s in line) for line in lines]))

    llm.on_step.append(draw)
    run_arrivals(llm, arrivals)
    return frames


@pytest.mark.parametrize("width,height", [(80, 24), (120, 40), (40, 12), (64, 20), (200, 14),
                                          (100, 8), (1, 1)])
def test_the_live_view_shows_or_counts_every_event_and_fits_the_terminal(width, height):
    """A run on three tiers with a step of 14 evictions (written down) and a swap-in, drawn live at
    sizes from 1x1 to 200x14: every frame fits the terminal, and each event of its step is shown in
    full or its rows counted in the last row, or the frame says the terminal is too small (never at
    80x24 or larger)."""
    llm = checked(LLM("random:tiny", block_size=4, num_disk_blocks=30, async_copies=False,
                      **DEMO_POOLS["mix"]))
    fill = [(0, [list(range(1, 81))], SamplingParams(temperature=0, max_tokens=2))]   # 20 cached
    evict = [(2, [list(range(100, 172))], SamplingParams(temperature=0, max_tokens=2))]   # 18 new
    arrivals = [(4 + step, prompts, params) for step, prompts, params in demo_arrivals("mix", llm)]
    frames = frames_of(llm, fill + evict + arrivals, width, height)
    most = max(sum(e.kind in ("evict", "write down") for e in report.events) for report, _ in frames)
    assert most >= 14 and any(e.kind == "swap in" for report, _ in frames for e in report.events)
    for report, lines in frames:
        assert len(lines) <= height and max(map(len, lines)) <= width
        joined = "\n".join(lines).replace("\n       ", " ")
        story = report.events
        squeezed = "".join(lines).replace(" ", "")   # a note, however it was wrapped or cut
        note = f"step {report.step}: {len(story)} events. The terminal ({width}x{height}) is too "
        note = (note + "small for the view").replace(" ", "")
        if note.startswith(squeezed) or squeezed.startswith(note):
            assert width < 80 or height < 24, "the view always fits 80x24"
            continue
        missing = [e for e in story if f"{e.step:>5}  {e.words()}" not in joined]
        if missing:   # the rest of the step, its rows counted: never silently dropped
            count = re.fullmatch(r"  \.\.\. and (\d+) more rows", lines[-1])
            assert count and len(lines) == height, lines[-1]
            rows = [row.plain for e in missing for row in wrapped(f"{e.step:>5}  {e.words()}",
                                                                  width, indent=7)]
            assert int(count[1]) >= len([row for row in rows if row not in lines])
            assert story[-len(missing):] == missing
    assert_no_block_held(llm)


def test_a_frame_fits_an_80x24_terminal_with_thousands_of_blocks():
    """Thousands of blocks fold into a grid of cells that fits 80 columns and 24 lines."""
    llm = LLM("random:tiny", block_size=4, async_copies=False,
              **{**DEMO_POOLS["mix"], "num_blocks": 5000})
    frames = frames_of(llm, demo_arrivals("mix", llm)[:2], 80, 24)
    assert max(len(lines) for _, lines in frames) <= 24
    assert max(len(line) for _, lines in frames for line in lines) <= 80
    words = " ".join(" ".join(frames[0][1]).split())   # the legend may wrap anywhere
    device_row = next(line for line in frames[0][1] if line.startswith("device"))
    assert re.search(r"device: \d+ blocks a cell", words) and device_row.split()[2][0] == "▒"


TRACE_WORDS = {   # what each demo's trace must show: the plain words of the events it provokes
    "mix": ["finds blocks", "forks from", "copies shared block", "is evicted", "swapped out:",
            "swapped in:", "preempted by swap", "preempted by recompute", "finishes"],
    "prefix": ["finds blocks"],
    "fork": ["forks from", "copies shared block"],
    "beam": ["forks from", "copies shared block", "finishes (pruned)"],
    "preempt": ["preempted by swap", "swapped out:", "swapped in:", "preempted by recompute"],
    "evict": ["is evicted", "finds blocks"],
    "batching": ["finds blocks", "decode"],
    "chunked": ["prefill 0-7 of", "decode"],
    "watermark": ["the watermark keeps 1 free"],
    "tiers": ["written down to host block", "written down to disk block", "in the host tier: loaded into",
              "in the disk tier: loaded into"],
    "overlap": ["in the disk tier: loaded into", "copies made in the background", "~: in flight"],
    "priority": ["seq  req  priority  state", "preempted by recompute", "finishes"],
}


def demo_reports(name):
    """Every StepReport of a demo on random weights, its invariants checked after each step."""
    llm = checked(LLM("random:tiny", block_size=4, **demo_pool(name, 4)))
    reports = []   # (report, its prefill chunks, its decodes), taken as each step ends
    llm.on_step.append(lambda report: reports.append((report, chunks(report), decodes(report))))
    run_arrivals(llm, demo_arrivals(name, llm))
    assert_no_block_held(llm)
    return llm, reports


def chunks(report):
    """(prompt length, first position, last position, first chunk?) of each prefill chunk."""
    return [(s.num_prompt_tokens, s.num_computed_tokens - n, s.num_computed_tokens - 1,
             s.num_computed_tokens - n == s.num_cached_tokens)
            for _, s, n in report.batch.entries if s.num_computed_tokens - n < s.prefill_until]


def decodes(report):
    return [s.seq_id for _, s, n in report.batch.entries
            if s.num_computed_tokens - n >= s.prefill_until]


def test_batching_demo_runs_each_arrivals_first_prefill_chunk_beside_running_decodes():
    """Continuous batching: three requests arrive while the first decodes, and each one's first
    prefill chunk runs in one step with the decodes of those already running."""
    _, reports = demo_reports("batching")
    joined = [r.step for r, c, d in reports if any(first for *_, first in c) and d]
    assert len(joined) == 3, joined


def test_chunked_demo_fills_a_long_prompt_over_several_steps_beside_a_decode():
    """Chunked prefill: the long prompt is computed 7 tokens a step (8 minus the decode) over
    several steps, in order, each chunk beside the other request's decode."""
    _, reports = demo_reports("chunked")
    longest = max(c[0] for _, cs, _ in reports for c in cs)
    long_chunks = [(r, c, d) for r, cs, d in reports for c in cs if c[0] == longest]
    assert len(long_chunks) >= 3
    for (report, (_, _, last, _), d), (_, (_, following, _, _), _) in zip(long_chunks,
                                                                         long_chunks[1:]):
        assert following == last + 1 and report.batch.num_tokens == 8 and d


def test_watermark_demo_keeps_a_request_out_that_would_fit():
    """The watermark (1 block of 100) keeps the second request waiting in steps where its 49
    blocks are free: admitting it would leave none for the first one's next decode."""
    llm, reports = demo_reports("watermark")
    held = [r.step for r, _, _ in reports if any(e.kind == "watermark" for e in r.events)]
    assert llm.scheduler.watermark_blocks == 1 and held == [2, 3, 4, 5]
    assert not any(e.kind == "preempt" for r, _, _ in reports for e in r.events)


def test_the_trace_tells_loads_and_write_downs_in_the_order_their_copies_are_made():
    """Each step's load and write-down events name their copies in the order the engine queued
    them: a block is evicted before another is loaded into it, and a host block is read by its
    load before a write-down reuses it (never the other way round, which reads as circular)."""
    for name in ("tiers", "mix", "preempt"):
        llm = checked(LLM("random:tiny", block_size=4, **demo_pool(name, 4)))
        queued, told = [], []
        make_copies = llm._make_copies   # (the demos copy blocking)

        def copies_queued(batch):   # the step's queue, as the engine makes it
            queued.append([(a.name, b, c.name, d) for a, b, c, d in llm.block_manager.copies])
            return make_copies(batch)

        def tell(report):
            told.append([(e.tier.name, e.block_ids[0], e.to_tier.name,
                          e.to_ids[0]) for e in report.events if e.kind in ("load", "write down")])

        llm._make_copies = copies_queued
        llm.on_step.append(tell)
        run_arrivals(llm, demo_arrivals(name, llm))
        for copies, events in zip(queued, told):
            assert [c for c in copies if c in events] == events
        if name == "tiers":
            kinds = {kind for events in told for _, _, kind, _ in events}
            assert sum(map(len, told)) > 20 and kinds == {"device", "host", "disk"}


def test_the_trace_gives_the_cost_rules_figures_where_it_decides():
    """Under preemption_mode='auto' a preempt event says why (the copy against the recompute,
    or no room in the host pool), and a load its copy against its recompute: the figures agree
    with the choice made."""
    llm = checked(LLM("random:tiny", block_size=4, **dict(demo_pool("preempt", 4),
                                                          preemption_mode="auto")))
    events = []
    llm.on_step.append(lambda report: events.extend(report.events))
    run_arrivals(llm, demo_arrivals("preempt", llm))
    llm = checked(LLM("random:tiny", block_size=4, **demo_pool("tiers", 4)))
    llm.on_step.append(lambda report: events.extend(report.events))
    run_arrivals(llm, demo_arrivals("tiers", llm))
    number = r"([\d.e+-]+) ms"
    preempts = [e for e in events if e.kind == "preempt"]
    loads = [e for e in events if e.kind == "load"]
    assert preempts and loads
    for e in preempts:
        figures = re.search(rf"copy 2 x \d+ blocks {number}, recompute \d+ tokens {number}\)$",
                            e.words())
        assert figures or e.words().endswith("(no room for its blocks in the host pool)")
        if figures:
            swap, recompute = map(float, figures.groups())
            assert e.details["mode"] == ("swap" if swap < recompute else "recompute")
    for e in loads:
        copy, recompute = map(float, re.search(rf"copy {number} < recompute {number}\)$",
                                               e.words()).groups())
        assert copy < recompute


def test_watermark_blocks_on_the_command_line_sets_the_watermark():
    """--watermark-blocks 0: the watermark demo's second request is not held back; it runs in
    the last free blocks, and the first one's next block preempts it."""
    out = trace("watermark", "--watermark-blocks", "0")
    assert "the watermark keeps" not in out and "preempted by" in out
    assert "the watermark keeps 1 free" in trace("watermark")


@pytest.mark.parametrize("width", range(64, 161))
def test_the_key_is_never_wrapped_inside_a_phrase(width):
    """The pools' key at any width: each phrase whole on one row, rows broken between phrases."""
    llm = LLM("random:tiny", block_size=4, num_blocks=3000, num_cpu_blocks=8)   # folded cells
    view = View(llm, live=False, console=Console(file=io.StringIO(), width=width))
    rows = [row.plain for row in view.pools(width, max_rows=4)]
    key = rows[next(i for i, row in enumerate(rows) if row.startswith("digit:")):]
    phrases = " ".join(row.strip() for row in key).split(" | ")
    assert "host[...]: in the host pool" in phrases and any("blocks a cell" in p for p in phrases)
    assert all(len(row) <= width for row in key)
    for phrase in phrases:
        assert any(phrase in row for row in key), f"{phrase!r} is cut at {width} columns"


def trace(demo, *argv):
    command = [sys.executable, "nanopaged.py", "--model", "random:tiny", "--demo", demo, "--trace",
               *argv]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=True).stdout


@pytest.mark.parametrize("demo", list(DEMOS))
def test_trace_shows_every_event_its_demo_provokes(demo):
    """`--trace` prints a snapshot per step with the words of each event kind the demo is for."""
    out = trace(demo)
    assert "--- step 1 ---" in out
    for words in TRACE_WORDS[demo]:
        assert words in out, f"the {demo} trace has no {words!r}"


def test_batching_trace_shows_a_newcomers_prefill_beside_decodes_in_one_step():
    """The batching demo's trace has a step whose `ran` line holds a prefill chunk and decodes."""
    assert re.search(r"^ran \d+ tokens: seq \d+ prefill \d+-\d+ of \d+ \| seqs [\d, -]+ decode"
                     r"( into slots [\d, ]+)?$", trace("batching"), re.M)


def test_delay_pauses_longer_on_steps_with_events(monkeypatch):
    """--delay S: each step pauses S, and S more for each event it shows."""
    pauses = []
    monkeypatch.setattr("nanopaged.time.sleep", pauses.append)
    llm = LLM("random:tiny", block_size=4, num_blocks=48)
    events = []
    llm.on_step.append(lambda r: events.append(len(r.events)))
    console = Console(file=io.StringIO(), width=80, color_system=None)
    with View(llm, live=False, console=console, delay=0.5):
        llm.generate([[1, 2, 3, 4, 5, 6, 7]], SamplingParams(n=4, max_tokens=4, seed=0))
    assert pauses == [0.5 * (1 + n) for n in events] and min(events) == 0 and max(events) == 4


def test_trace_repeats_exactly():
    """Two runs of the default demo's trace print the same text, character for character, but
    for the cost rule's measured milliseconds."""
    def masked(text):
        return re.sub(r"[\d.e+-]+ ms", "N ms", text)
    assert masked(trace("mix")) == masked(trace("mix"))


def test_a_step_saved_as_svg_lines_up_its_cells_as_the_terminal_does(tmp_path):
    """--svg: each step's view saved as an image (rich's SVG export), in colour; every span of
    text sits at its column (x = column * the character width, its length as many characters), so
    the image's rows read exactly as the terminal's: the pools' cells line up."""
    from nanopaged import run_arrivals, save_svg
    llm = checked(LLM("random:tiny", block_size=4, **demo_pool("fork", 4)))
    # each step's view as the terminal shows it (the view reads the engine as the step left it)
    console = Console(file=io.StringIO(), width=100, color_system=None)
    terminals = []

    def terminal(report):
        console.print(View(llm, live=False, console=console).frame(report))
        terminals.append([line.rstrip() for line in console.file.getvalue().splitlines()])
        console.file = io.StringIO()

    llm.on_step.append(terminal)
    llm.on_step.append(functools.partial(save_svg, llm, str(tmp_path)))
    run_arrivals(llm, demo_arrivals("fork", llm))
    svg = (tmp_path / "step-2.svg").read_text()
    # in colour (the ref counts in their requests' colours), and its title
    assert len(set(re.findall(r"fill: (#\w+)", svg))) >= 3
    assert "nanopaged: step 2" in html.unescape(svg).replace("\xa0", " ")
    spans = re.findall(r'<text class="[^"]*-r\d+" x="([\d.]+)" y="([\d.]+)" '
                       r'textLength="([\d.]+)"[^>]*>([^<]*)</text>', svg)
    rows = {}
    widths = set()
    for x, y, length, text in spans:
        text = html.unescape(text).replace("\xa0", " ")
        if text.strip():
            widths.add(round(float(length) / len(text), 3))
        row = rows.setdefault(float(y), {})
        for i, char in enumerate(text):
            row[round(float(x) / 12.2) + i] = char
    assert widths == {12.2}   # one character width: nothing stretched or squeezed
    image = ["".join(row.get(c, " ") for c in range(max(row) + 1)).rstrip()
             for _, row in sorted(rows.items())]
    # step 2: the copy-on-write
    assert image == terminals[1] and any(line.startswith("device") for line in image)
    assert_no_block_held(llm)

"""
labs.py: labs a class can hand out, one per mechanism of the block manager and the scheduler.

A lab's handout is a copy of the project with that mechanism's code replaced by a stub that says
what must hold and which test checks each rule; its tests stay. Grading runs the tests that pin
the mechanism (random:tiny or no model, under a minute) and says which invariant broke, in which
block, at which step. A test that runs past a limit (20 s; the slowest takes some 4) fails,
named: a loop that never ends costs seconds, not the grade.

    python tests/labs/labs.py                     the labs, one line each, in the order to take them
    python tests/labs/labs.py handout LAB DIR     DIR: a copy of the project with LAB's stub in
    python tests/labs/labs.py grade LAB [DIR]     LAB's tests in DIR (default: this project)

Where a lab's code is: each region is marked in the engine by one comment line directly above
it, `# lab NAME: below, WHAT`; the region is the statement (a def, an if, a loop, an assignment)
that starts on the next line, and WHAT, its label, names the stub that replaces it. The project
is every lab's solution: grading it passes every lab, and paste_back puts a region's lines back
into a handout, byte for byte.

Read it in order: the labs and their stubs; finding the regions; handout and paste_back;
grading; the command line.
"""
import argparse
import ast
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import xml.etree.ElementTree as ET
from collections import namedtuple
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# the files that hold the labs' regions
ENGINE_FILES = ["nanopaged.py", "kernel.py", "model.py"]
MARKER = "# lab "

# ----------------------------------------------------------------------------------------------
# The labs, in the order to take them: each leans on what the ones before it taught. Each stub is
# keyed by its region's label, what the marker says is below it (so that no key is solution code:
# this file goes out with every handout), and is one statement (comment lines may lead into it).
# A stub says what must hold and which test checks each rule, not the lines to write. A stub that
# can work does, naively, so that a handout fails its own lab only: the other labs' tests
# allocate, free and fork as well.

PREFIX_CACHE_LOOKUP = '''
def _cache_hits(self, seq):
    """[(tier, block)] holding seq's prefix, found by one walk along its hash chain, each
    where it is (below the device: if loading it beats recomputing, section 8).

    Lab prefix-cache. What must hold, and the test of tests/labs/test_lab_prefix_cache.py that
    checks it:
      - a hit is a prefix of whole blocks: block i is found only if blocks 0 to i - 1 were
        (test_the_chain_stops_at_the_first_miss, and ..._though_its_parent_prefix_matches);
      - the block of the last token is never found: its logits are needed
        (test_the_block_of_the_last_token_never_hits);
      - a block found holds these very tokens after this very prefix, however the hashes
        collide (test_colliding_hashes_hand_out_no_wrong_block,
        test_hits_match_a_brute_force_search_over_computed_prefixes);
      - of several blocks holding it, one somebody holds goes first: it takes no free block
        (test_a_held_block_is_shared_before_a_cached_copy);
      - the tiers below are searched too, those worth loading from alone
        (test_a_prefix_written_down_to_the_host_is_found_there_and_loaded,
        test_a_tier_not_worth_loading_from_is_not_searched);
      - below the device, a block a swapped-out request holds is not found
        (test_a_host_block_a_swapped_out_request_holds_is_not_handed_out).
    At hand: _block_hash, _tokens, _lookup, self.worth_loading, Block.prefix_id. This stub finds
    nothing: every prompt is computed."""
    return []
'''

EVICT_OLDEST = '''
def victim(self, pool):
    """(the cached block of pool to evict, why: the policy's words for the trace).

    Lab eviction. What must hold, and the test of tests/labs/test_lab_eviction.py that
    checks it:
      - the victim is the cached block freed longest ago (LRU); pool.cached_block_ids keeps
        the order _cache added them in (test_empty_blocks_go_before_cached_ones_then_the_
        oldest_cached, test_evictions_follow_a_plain_lru_list);
      - _evict takes it out of the prefix cache, down a tier or lost (check_invariants, in
        every test).
    This stub evicts the cached block of the lowest id: it works, but hits less."""
    return min(pool.cached_block_ids), "the lowest id"
'''

FREE_TAIL_FIRST = '''
def free(self, seq, coming_back=False):
    """Drop seq's hold on its blocks, in whichever pool its table points into.
    coming_back: seq was preempted, to be recomputed.

    Lab eviction. What must hold, and the test of tests/labs/test_lab_eviction.py that
    checks it:
      - the blocks go back in the order that gets seq's tail evicted before its prefix, which
        other requests are likelier to share (test_free_releases_the_tail_first,
        test_evictions_follow_a_plain_lru_list);
      - a registered block nobody holds stays cached, its K/V reusable; _release does it
        (check_invariants, in every test);
      - coming_back: each block seq is the last to hold counts as found once more
        (Block.hits, by which the write-down rule keeps blocks: test_a_request_coming_back_
        counts_each_block_it_alone_held_as_found_again);
      - seq holds no block after, in no pool's seqs (check_invariants).
    This stub releases head first and counts nothing: it works, but a prefix goes before its
    own tail."""
    pool = self.host if seq.seq_id in self.host.seqs else self.device
    for block_id in seq.block_table:
        self._release(pool, pool.blocks[block_id])
    pool.seqs.pop(seq.seq_id, None)
    seq.block_table = []
'''

FORK_SHARES = '''
def fork(self, parent, child, num_blocks=None):
    """child shares parent's first num_blocks blocks (all by default); fresh blocks hold the
    rest (a recomputed sample's, section 8).

    Lab copy-on-write. What must hold, and the test of tests/labs/test_lab_copy_on_write.py that
    checks it:
      - the shared blocks are held once more, no K/V copied, no free block taken; their
        tokens count as computed in child; the trace tells it (a "fork" event)
        (test_fork_shares_every_block_and_copies_nothing);
      - past num_blocks, child's blocks are fresh and not computed
        (test_fork_with_num_blocks_shares_only_the_first).
    At hand: _hold, _set_table. This stub shares nothing: child gets fresh blocks and a copy
    of each computed one (BlockCopy records in self.copies, made before the model runs):
    correct, but every fork costs blocks and copies."""
    shared = parent.block_table[:num_blocks]
    # only K/V already computed can be copied now
    computed = min(len(shared) * self.block_size, parent.num_computed_tokens)
    self._set_table(child, [])
    for i in range(self._num_blocks_for(computed)):
        self.copies.append(BlockCopy(self.device, shared[i],
                                     self.device, child.block_table[i]))
    child.num_computed_tokens = computed
    self.record("fork", [child], [], parent=parent.seq_id)
'''

COPY_ON_WRITE = '''
if self._needs_new_block(seq):
    seq.block_table.append(self._allocate_block(seq))
elif self._needs_copy(seq):
    # Lab copy-on-write: seq's last block is shared (ref_count > 1), partly filled, and
    # seq is about to write into it. What must hold, and the test of
    # tests/labs/test_lab_copy_on_write.py that checks it:
    #   - seq writes a block of its own holding a copy of the shared block's K/V, made
    #     before the model runs; the others keep the original, one holder fewer; the
    #     call returns (src, dst); the trace tells it (a "copy" event); num_cow_copies
    #     counts it (test_the_first_writer_of_a_shared_block_copies_it_the_last_writes_
    #     in_place);
    #   - the copy holds the original's K/V (test_n_samples_share_the_prompt_and_copy_
    #     its_last_block_with_its_kv).
    # Reached only once fork shares blocks.
    raise NotImplementedError("lab copy-on-write: write the copy-on-write branch of "
                              "KVCacheManager.append_slot (nanopaged.py)")
'''

SWAP_MOVE = '''
def _move(self, seqs, src, dst, kind, counter):
    """Repoint seqs' tables from src to dst, a dst block per distinct block, and count the
    blocks moved under the metric named counter. Returns [(src block, dst block)].

    Lab preemption. What must hold, and the test of tests/labs/test_lab_preemption.py that
    checks it:
      - each distinct block is copied once, so that the blocks seqs share stay shared, with
        their ref_counts (test_a_swap_moves_a_shared_block_once_and_it_stays_shared);
      - the copies carry the K/V, out and back (BlockCopy records in self.copies, made
        before the model runs); counter counts them
        (test_a_swap_carries_the_kv_to_the_host_and_back);
      - a registered block's copy is registered in dst too, and the original, held by
        nobody now, stays cached; the trace tells the move (an event of kind)
        (test_a_swap_registers_the_copies_of_registered_blocks);
      - seqs live in dst's pool after (dst.seqs; check_invariants, in every test).
    At hand: _get_new_block, _register, _hold, _release. Reached only once preempt swaps."""
    raise NotImplementedError("lab preemption: write KVCacheManager._move (nanopaged.py), "
                              "which swap_out and swap_in call")
'''

PREEMPT_VICTIM = '''
# Lab preemption: seq (of request) is short of a block. What must
# hold, and the test of tests/labs/test_lab_preemption.py that checks
# it: the victim is the running request ranked last, again and
# again until seq can append or its own request gave its blocks
# back (test_the_victim_is_the_last_running_request_in_rank).
# This stub preempts seq's own request: it works, but the first
# come is served last.
while request.status is RequestStatus.RUNNING and not bm.can_append(seq):
    self.preempt(request, batch)
'''

PREEMPT_MODE = '''
def preempt(self, request, batch, mode=None):
    """Take a running request's blocks back, all at once: swapped to the host pool, to resume
    where it was, or freed (the prefix cache may keep much), to be recomputed, in front.
    Returns the mode.

    Lab preemption. What must hold, and the test of tests/labs/test_lab_preemption.py that
    checks it:
      - the mode is the one given, else _choose_mode's (test_with_no_room_on_the_host_a_swap_
        recomputes);
      - the trace tells it: a "preempt" event with the mode, and the reason _choose_mode
        gives as ' (reason)'; num_preemptions counts it (test_the_preempt_event_says_the_
        mode_and_why_as_the_trace_prints_it);
      - swap: its blocks go to the host pool and it waits SWAPPED, in rank order, to resume
        where it was (test_a_swap_carries_the_kv_to_the_host_and_back);
      - recompute: it holds no block, has nothing computed, and waits in front of newer
        requests (test_a_recomputed_request_frees_its_blocks_and_waits_in_front);
      - either way it leaves the running line and the batch (check_invariants).
    This stub always recomputes."""
    self.block_manager.record("preempt", request.seqs,
                              sorted(distinct_blocks(request.seqs)),
                              mode="recompute",
                              why="")
    self.running.remove(request)
    batch.remove(request)
    self.recompute(request)
    self.num_preemptions += 1
    return "recompute"
'''

SLOT_MAPPING = '''
# Lab block-table: the slots where the model writes the K/V of seq's positions start to
# end - 1, appended to batch.slot_mapping in order. What must hold, and the test of
# tests/labs/test_lab_block_table.py that checks it: position p lives in seq's logical
# block p // block_size at offset p % block_size; its slot numbers that place in the
# pool, a block's slots one after another (test_the_slot_mapping_of_a_known_block_table,
# test_paged_greedy_tokens_equal_the_dense_models).
raise NotImplementedError("lab block-table: write the slot mapping in "
                          "Engine._prepare (nanopaged.py)")
'''

GATHER = '''
# Lab block-table: k and v, (seqs, kv_heads, ctx, dim), each context of the group in
# order, read from the pool through the block tables (ids: the group's tables,
# flattened; the mask hides the slots past a context's end). What must hold, and the
# test of tests/labs/test_lab_block_table.py that checks it: position j of the i-th
# sequence's context is slot j % block_size of its logical block j // block_size
# (test_reference_attention_reads_every_context_through_its_block_table,
# test_paged_greedy_tokens_equal_the_dense_models).
raise NotImplementedError("lab block-table: write the gather in paged_attention_ref "
                          "(kernel.py)")
'''


LFU_RANK = '''
def rank(self, block):
    """The block's rank, read as it is cached: RankedEviction evicts the cached device block of
    least rank, ties by LRU (the one freed longest ago).

    Lab policy. What must hold, and the test of tests/labs/test_lab_policy.py that checks it:
      - the victim is the block found the fewest times since it was registered, of those the
        one freed longest ago: a block found twice outlasts one found once, which outlasts one
        never found, however long ago each was freed
        (test_lfu_evicts_the_block_found_least_often_ties_by_lru);
      - a count that never grows is LRU again (SGLang's LFU once was): a block found often
        is kept to be found again, where LRU evicts it for blocks never found again
        (test_lfu_finds_again_the_block_found_most_often).
    Measured by `python bench.py --only policies`: the lfu row's hit rate, against lru's and
    opt's. At hand: the fields of Block (section 2), and what allocate and cache_full_blocks
    do to them. This stub ranks by when the block was cached: it works, but it is LRU."""
    return block.cached_at
'''

LEAF_VICTIM = '''
def victim(self, pool):
    """(the cached block of pool to evict, why: the policy's words for the trace).

    Lab policy. What must hold, and the test of tests/labs/test_lab_policy.py that checks it:
      - on the device, the victim is a leaf, a cached block that no registered device block
        continues, of the leaves the one freed longest ago: no block is left cached after a
        prefix gone, never to be found again (bm.orphans stays empty)
        (test_leaf_evicts_the_oldest_leaf_and_orphans_nothing);
      - with no leaf cached, the victim is LRU's
        (test_with_no_leaf_cached_the_leaf_policy_falls_back_to_lru);
      - the victim is a cached block of pool: _evict takes it out of the prefix cache
        (check_invariants, in every test).
    Measured by `python bench.py --only policies`: the leaf row's orphaned blocks and hit rate,
    against lru's. At hand: pool.cached_block_ids (oldest first), self.children (a prefix id ->
    the registered device blocks that continue it), Block.prefix_id. This stub is LRU: it works,
    but a prefix freed before its continuation goes first, and leaves that continuation
    orphaned."""
    return super().victim(pool)
'''


@dataclass
class Lab:
    name: str
    mechanism: str   # what the verdict names
    writes: str      # what the student writes, and where
    # a region's label (its marker's words after "below, ") -> the stub that replaces it
    stubs: dict

    @property
    def test_file(self):
        return f"tests/labs/test_lab_{self.name.replace('-', '_')}.py"


LABS = [
    Lab("block-table", "the block table and the slot mapping",
        "Engine._prepare's slot mapping (nanopaged.py), paged_attention_ref's gather (kernel.py)",
        {"the slot mapping": SLOT_MAPPING,
         "the gather through the block tables": GATHER}),
    Lab("prefix-cache", "the hash-chain lookup",
        "KVCacheManager._cache_hits (nanopaged.py)",
        {"the walk along the hash chain": PREFIX_CACHE_LOOKUP}),
    Lab("copy-on-write", "fork and copy-on-write",
        "KVCacheManager.fork and append_slot's copy branch (nanopaged.py)",
        {"a fork shares its parent's blocks": FORK_SHARES,
         "a writer of a shared block copies it first": COPY_ON_WRITE}),
    Lab("eviction", "free and LRU eviction",
        "KVCacheManager.free and victim (nanopaged.py)",
        {"the order free releases blocks in": FREE_TAIL_FIRST,
         "which cached block is evicted": EVICT_OLDEST}),
    Lab("preemption", "preemption: the victim, recompute and swap",
        "Scheduler.schedule's victim, Scheduler.preempt, KVCacheManager._move (nanopaged.py)",
        {"the victim": PREEMPT_VICTIM,
         "swap or recompute": PREEMPT_MODE,
         "a swap moves a request's blocks between tiers": SWAP_MOVE}),
    Lab("policy", "eviction policies: LFU and leaf, then your own",
        "LFUEviction.rank, LeafEviction.victim, then a class MyEviction of yours (nanopaged.py)",
        {"LFU's rank": LFU_RANK,
         "the leaf policy's victim": LEAF_VICTIM}),
]
LAB_NAMES = {lab.name: lab for lab in LABS}

# ----------------------------------------------------------------------------------------------
# Finding the regions: the marker line, then the statement that starts after it

def marker_lab(line):
    """The lab a marker line names, or None for any other line."""
    text = line.strip()
    if not text.startswith(MARKER) or ": below, " not in text:
        return None
    return text.removeprefix(MARKER).split(":")[0]


def marker_label(line):
    """What a marker line says is below it: `# lab NAME: below, WHAT` gives WHAT."""
    return line.strip().split(": below, ", 1)[1]


# one region: its marker's label, its lines as 0-based indices (end excluded)
Region = namedtuple("Region", "label start end")


def first_line(node):   # a def's decorators come first
    decorators = getattr(node, "decorator_list", [])
    return min([node.lineno] + [d.lineno for d in decorators])


def regions(text, lab):
    """[Region] of lab's regions in text, in order: from the line after each marker to the end of
    the first statement that starts there or below (the comment lines before it, a stub's, are
    in the region too)."""
    lines = text.splitlines(keepends=True)
    statements = [n for n in ast.walk(ast.parse(text)) if isinstance(n, ast.stmt)]
    found = []
    for i, line in enumerate(lines):
        if marker_lab(line) != lab.name:
            continue
        # 1-based: the line after the marker is i + 2
        after = [n for n in statements if first_line(n) >= i + 2]
        # the first to start; of those starting on one line, the outermost
        node = min(after, key=lambda n: (first_line(n), -n.end_lineno))
        found.append(Region(marker_label(line), i + 1, node.end_lineno))
    return found


def replace_regions(text, lab, replacements):
    """text with lab's regions replaced, in order, by replacements (each a list of lines)."""
    lines = text.splitlines(keepends=True)
    found = regions(text, lab)
    if len(found) != len(replacements):
        raise ValueError(f"lab {lab.name}: {len(found)} regions, {len(replacements)} to put in")
    # from the bottom up, so that the line indices above stay good
    for region, new in reversed(list(zip(found, replacements))):
        lines[region.start:region.end] = new
    return "".join(lines)


def indented(stub, like):
    """stub's lines at the indentation of the line `like`."""
    indent = like[:len(like) - len(like.lstrip())]
    lines = (textwrap.dedent(stub).strip("\n") + "\n").splitlines(keepends=True)
    return [indent + line if line.strip() else line for line in lines]


def stub_for(lab, region, lines):
    """The stub of lab that replaces region (a Region of lines), at the indentation of its first
    line."""
    if region.label not in lab.stubs:
        raise KeyError(f"lab {lab.name}: no stub for the region labelled {region.label!r}")
    return indented(lab.stubs[region.label], lines[region.start])

# ----------------------------------------------------------------------------------------------
# Handouts, and the solution pasted back

def project_files(root=ROOT):
    """The project's files, relative to root: what git tracks, else the sources, README and
    tests (a handout has no .git)."""
    git = subprocess.run(["git", "-C", root, "ls-files"], capture_output=True, text=True)
    if git.returncode == 0 and git.stdout.strip():
        names = git.stdout.splitlines()
    else:
        names = [os.path.relpath(os.path.join(d, f), root)
                 for d, _, files in os.walk(root) if "__pycache__" not in d
                 for f in files if f.endswith(".py") or f in ("README.md", "requirements.txt")]
    return sorted(n for n in names if os.path.isfile(os.path.join(root, n)))


def read(path):
    with open(path, encoding="utf-8", newline="") as f:
        return f.read()


def write(path, text):
    with open(path, "w", encoding="utf-8", newline="") as f:
        f.write(text)


def make_handout(lab, dest, root=ROOT):
    """Copy the project to dest with lab's regions replaced by their stubs. Returns the engine
    files changed."""
    is_empty_folder = os.path.isdir(dest) and not os.listdir(dest)
    if os.path.exists(dest) and not is_empty_folder:
        raise FileExistsError(f"{dest} is not an empty folder: a handout goes into a new or "
                              "empty one")
    for name in project_files(root):
        os.makedirs(os.path.dirname(os.path.join(dest, name)), exist_ok=True)
        shutil.copyfile(os.path.join(root, name), os.path.join(dest, name))
    changed = []
    for name in ENGINE_FILES:
        path = os.path.join(dest, name)
        text = read(path)
        lines = text.splitlines(keepends=True)
        stubs = [stub_for(lab, region, lines) for region in regions(text, lab)]
        stubbed = replace_regions(text, lab, stubs)
        if stubbed != text:
            write(path, stubbed)
            changed.append(name)
    return changed


def paste_back(lab, handout, root=ROOT):
    """Put the project's lines of lab's regions back into the handout's files, over whatever
    is there (the stub, a student's attempt). Returns the files changed."""
    changed = []
    for name in ENGINE_FILES:
        solution = read(os.path.join(root, name))
        lines = solution.splitlines(keepends=True)
        originals = [lines[r.start:r.end] for r in regions(solution, lab)]
        path = os.path.join(handout, name)
        text = read(path)
        pasted = replace_regions(text, lab, originals)
        if pasted != text:
            write(path, pasted)
            changed.append(name)
    return changed

# ----------------------------------------------------------------------------------------------
# Grading: a lab's tests in one pytest run, a verdict a student can act on

def plural(n, noun):
    """"1 block", "2 blocks": for the lab tests' messages."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


@dataclass
class Result:
    lab: Lab
    num_tests: int
    failed: list   # "test name: first line of its message", each failed or erred test

    @property
    def passed(self):
        return self.num_tests > 0 and not self.failed

    def verdict(self):
        head = f"lab {self.lab.name} ({self.lab.mechanism})"
        if self.passed:
            return f"{head}: passed, {self.num_tests} tests"
        if not self.num_tests:
            return f"{head}: failed: no tests ran"
        return (f"{head}: failed: {len(self.failed)} of {self.num_tests} tests; "
                f"write {self.lab.writes}")


def run_labs(labs, root=ROOT, quiet=True, timeout=20):
    """Run labs' tests in root, all in one pytest process: {lab name: Result}. quiet=False
    shows pytest's report (each failure's message) as it runs; a test that runs past timeout
    seconds fails (tests/labs/conftest.py)."""
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "report.xml")
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                   "--tb=short", f"--junitxml={report}", *[lab.test_file for lab in labs]]
        env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1",
               "NANOPAGED_LAB_TIMEOUT": str(timeout)}
        run = subprocess.run(command, cwd=root, env=env,
                             capture_output=quiet, text=True)
        cases = ET.parse(report).getroot().iter("testcase") if os.path.exists(report) else []
        results = {lab.name: Result(lab, 0, []) for lab in labs}
        for case in cases:
            # classname: tests.test_lab_NAME (the module), and the class if any
            module = next(p for p in case.get("classname").split(".") if p.startswith("test_"))
            lab = next(lab for lab in labs if lab.test_file.endswith(f"/{module}.py"))
            results[lab.name].num_tests += 1
            for problem in [*case.iter("failure"), *case.iter("error")]:
                message = (problem.get("message") or "").strip().splitlines() or ["?"]
                results[lab.name].failed.append(f"{case.get('name')}: {message[0]}")
        if quiet and not any(r.num_tests for r in results.values()):
            # pytest itself failed (a syntax error in the handout, say): its own words
            for lab in labs:
                results[lab.name].failed.append(run.stdout[-2000:] + run.stderr[-2000:])
        return results


def grade(lab, root=ROOT, timeout=20):
    """Run lab's tests in root with pytest's report, then the verdict. Returns the Result."""
    result = run_labs([lab], root, quiet=False, timeout=timeout)[lab.name]
    print(result.verdict())
    return result

# ----------------------------------------------------------------------------------------------
# The command line

def main(argv=None):
    parser = argparse.ArgumentParser(
        description="Labs: a handout is the project with one mechanism stubbed out; grading "
                    "runs the tests that pin it.")
    commands = parser.add_subparsers(dest="command")
    commands.add_parser("list", help="the labs, one line each (the default)")
    handout = commands.add_parser("handout", help="copy the project to DIR with LAB's stub in")
    handout.add_argument("lab", choices=LAB_NAMES)
    handout.add_argument("dir", help="a new or empty folder")
    grader = commands.add_parser("grade", help="run LAB's tests in DIR; exit 0 if they pass")
    grader.add_argument("lab", choices=LAB_NAMES)
    grader.add_argument("dir", nargs="?", default=ROOT, help="a handout (default: the project)")
    grader.add_argument("--timeout", type=float, default=20,
                        help="seconds a test may run before it fails (default: 20)")
    args = parser.parse_args(argv)
    if args.command == "handout":
        lab = LAB_NAMES[args.lab]
        try:
            changed = make_handout(lab, args.dir)
        except FileExistsError as error:
            # bad input, as argparse reports it: usage, one line, exit status 2
            parser.error(str(error))
        print(f"{args.dir}: the project, with {lab.mechanism} stubbed out in "
              f"{', '.join(changed)}")
        print(f"write {lab.writes}; the stubs say what. Then grade it:")
        print(f"    cd {args.dir} && python tests/labs/labs.py grade {lab.name}")
        return 0
    if args.command == "grade":
        if not os.path.isdir(os.path.join(args.dir, "tests", "labs")):
            parser.error(f"{args.dir} has no tests/labs/ folder: give a handout's folder")
        if not 0 < args.timeout <= 3600:
            parser.error(f"--timeout must be a number of seconds in (0, 3600], got {args.timeout}")
        return 0 if grade(LAB_NAMES[args.lab], os.path.abspath(args.dir),
                          args.timeout).passed else 1
    for lab in LABS:
        print(f"{lab.name:14} {lab.mechanism}: write {lab.writes}  ({lab.test_file})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

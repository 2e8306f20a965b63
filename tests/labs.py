"""
labs.py: labs a class can hand out, one per mechanism of the block manager and the scheduler.

A lab's handout is a copy of the project with that mechanism's code replaced by a stub that says
what to write; its tests stay. Grading runs the tests that pin the mechanism (random:tiny or no
model, under a minute) and says which invariant broke, in which block, at which step.

    python tests/labs.py                          the labs, one line each
    python tests/labs.py handout LAB DIR          DIR: a copy of the project with LAB's stub in
    python tests/labs.py grade LAB [DIR]          LAB's tests in DIR (default: this project)

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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the files that hold the labs' regions
ENGINE_FILES = ["nanopaged.py", "kernel.py", "model.py"]
MARKER = "# lab "

# ----------------------------------------------------------------------------------------------
# The labs. Each stub is keyed by its region's label, what the marker says is below it (so that
# no key is solution code: this file goes out with every handout), and is one statement (comment
# lines may lead into it). A stub that can work does, naively, so that a handout fails its own
# lab only: the other labs' tests allocate, free and fork as well.

PREFIX_CACHE_LOOKUP = '''
def _cache_hits(self, seq):
    """[(tier, block)] holding seq's prefix, found by one walk along its hash chain, each
    where it is (below the device: if loading it beats recomputing, section 8).

    Lab prefix-cache: write the walk. For each full block i of seq but the one holding its
    last token (whose logits are needed, so it is computed): look its chain hash up
    (self._block_hash(seq, i)) with self._lookup, in the tiers worth loading from
    (worth_loading); _lookup checks the block's tokens and its parent's prefix_id (that of the
    hit before, None for block 0), so a hash collision hands out no wrong block. Below the
    device only a block nobody holds counts (a swapped request's blocks are its own). Of
    several, take one somebody holds (it costs no free block). Stop at the first miss: no
    later block can be this prefix's. This stub finds nothing: every prompt is computed."""
    return []
'''

EVICT_OLDEST = '''
def _evict(self, pool, seq):
    """Take pool's cached block freed longest ago out of the prefix cache, emptied: its K/V
    are written down to a tier below (_write_down), or lost. Which tier: section 8.

    Lab eviction: the victim is the block that has been cached the longest; a block freed
    lately is the likeliest to be asked for again. pool.cached_block_ids holds the cached
    blocks, keeping the order in which _cache added them. This stub takes the block cached
    last, the one most worth keeping: it works, but the prefix cache hits less."""
    block_id, _ = pool.cached_block_ids.popitem(last=True)
    write_down_or_lose(self, pool, pool.blocks[block_id], seq)   # (section 8)
    self._unregister(pool, pool.blocks[block_id])
    pool.empty_block_ids.append(block_id)
'''

FREE_TAIL_FIRST = '''
def free(self, seq, coming_back=False):
    """Drop seq's hold on its blocks, in whichever pool its table points into.
    coming_back (preempted, to be recomputed): each counts as found once more.

    Lab eviction: release the blocks in the order that gets the tail evicted before the
    prefix, which other requests are likelier to share (_release caches a registered block
    nobody holds; _evict takes the one cached longest ago). This stub releases them head
    first: it works, but a prefix is lost before its own tail."""
    pool = self.host if seq.seq_id in self.host.seqs else self.device
    for block_id in seq.block_table:
        block = pool.blocks[block_id]
        if coming_back and block.ref_count == 1:
            # by its last holder: once
            block.hits += 1
        self._release(pool, block)
    pool.seqs.pop(seq.seq_id, None)
    seq.block_table = []
'''

FORK_SHARES = '''
def fork(self, parent, child, num_blocks=None):
    """child shares parent's first num_blocks blocks (all by default): no K/V copied, their
    ref_counts go up, fresh blocks hold the rest (a recomputed sample's, section 8).

    Lab copy-on-write: share, do not copy. Hold each shared block once more (self._hold),
    then give child its table (self._set_table(child, shared): the shared blocks, then fresh
    ones; their tokens count as computed), and record the "fork" event. This stub shares
    nothing: child gets fresh blocks, and a copy of each computed block is queued (a
    BlockCopy in self.copies, made before the model runs): correct, but every fork costs
    blocks and copies."""
    shared = parent.block_table[:num_blocks]
    # only K/V already computed can be copied now
    computed = min(len(shared) * self.block_size, parent.num_computed_tokens)
    self._set_table(child, [])
    for i in range(self._num_blocks_for(computed)):
        self.copies.append(BlockCopy(self.device, shared[i],
                                     self.device, child.block_table[i]))
    child.num_computed_tokens = computed
    self.events.record("fork", [child], [], parent=parent.seq_id)
'''

COPY_ON_WRITE = '''
if self._needs_new_block(seq):
    seq.block_table.append(self._allocate_block(seq))
elif self._needs_copy(seq):
    # Lab copy-on-write: the last block is shared (ref_count > 1) and partly filled: this
    # writer gets its own copy. Allocate a block, queue the copy (a BlockCopy in
    # self.copies), release the shared one (self._release), put the copy in the table,
    # count num_cow_copies, record a "copy" event, and return (src, dst). Reached only
    # once fork shares blocks.
    raise NotImplementedError("lab copy-on-write: write the copy-on-write branch of "
                              "BlockManager.append_slot (nanopaged.py)")
'''

SWAP_MOVE = '''
def _move(self, seqs, src, dst, kind, counter):
    """Repoint seqs' tables from src to dst, a dst block per distinct block (tail first), and
    count the blocks moved under the metric named counter.

    Lab preemption: for each distinct block of seqs' tables (shared ones once, so that they
    stay shared), take a block of dst (self._get_new_block), queue the copy (a BlockCopy in
    self.copies) and, if the block is registered, register its copy in dst too (self._register
    with like=). Record the event `kind`. Then take every new block before letting any old
    one go: hold the new (self._hold), release the old (self._release), repoint the table;
    move each seq from src.seqs to dst.seqs. Count len(mapping) under counter; return
    [(src block, dst block)]. Reached only once preempt swaps."""
    raise NotImplementedError("lab preemption: write BlockManager._move (nanopaged.py), "
                              "which swap_out and swap_in call")
'''

PREEMPT_VICTIM = '''
# Lab preemption: the victim is the last running request in rank
# (self.running[-1]), until seq can append or its own request, the last,
# gave its blocks back. This stub preempts seq's own request: it works,
# but the first come is served last.
while request.status is RequestStatus.RUNNING and not bm.can_append(seq):
    self.preempt(request, batch)
'''

PREEMPT_MODE = '''
def preempt(self, request, batch, mode=None):
    """Take a running request's blocks back, all at once: swapped to the host pool, to resume
    where it was, or freed (the prefix cache may keep much), to be recomputed, in front.

    Lab preemption: unless mode is given, self._choose_mode(request) gives (mode, why); record
    the "preempt" event with them; take request out of self.running and out of batch. "swap":
    self.block_manager.swap_out(*request.seqs), status SWAPPED, into self.swapped in rank
    order (self.enqueue); else self._recompute(request). Count num_preemptions; return the
    mode. This stub always recomputes."""
    self.events.record("preempt", request.seqs,
                       sorted(distinct_blocks(request.seqs)),
                       mode="recompute",
                       why="")
    self.running.remove(request)
    batch.remove(request)
    self._recompute(request)
    self.num_preemptions += 1
    return "recompute"
'''

SLOT_MAPPING = '''
# Lab block-table: each new token's slot, where the model writes its K/V: position
# p of seq is in logical block p // block_size, which is physical block
# seq.block_table[that], at offset p % block_size; its slot is physical block *
# block_size + offset. Add one slot per position start .. end - 1 to
# batch.slot_mapping.
raise NotImplementedError("lab block-table: write the slot mapping in "
                          "LLM._prepare (nanopaged.py)")
'''

GATHER = '''
# Lab block-table: gather the group's contexts through their block tables. ids (the tables,
# flattened) index the first dimension of k_cache and v_cache, whole blocks; view the result
# as (seqs, blocks * block_size, kv_heads, dim), each context in order, and transpose to
# k, v: (seqs, kv_heads, ctx, dim)
raise NotImplementedError("lab block-table: write the gather in paged_attention_ref "
                          "(kernel.py)")
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
        return f"tests/test_lab_{self.name.replace('-', '_')}.py"


LABS = [
    Lab("block-table", "the block table and the slot mapping",
        "LLM._prepare's slot mapping (nanopaged.py), paged_attention_ref's gather (kernel.py)",
        {"the slot mapping": SLOT_MAPPING,
         "the gather through the block tables": GATHER}),
    Lab("prefix-cache", "the hash-chain lookup",
        "BlockManager._cache_hits (nanopaged.py)",
        {"the walk along the hash chain": PREFIX_CACHE_LOOKUP}),
    Lab("copy-on-write", "fork and copy-on-write",
        "BlockManager.fork and append_slot's copy branch (nanopaged.py)",
        {"a fork shares its parent's blocks": FORK_SHARES,
         "a writer of a shared block copies it first": COPY_ON_WRITE}),
    Lab("eviction", "free and LRU eviction",
        "BlockManager.free's order and _evict's victim (nanopaged.py)",
        {"the order free releases blocks in": FREE_TAIL_FIRST,
         "which cached block is evicted": EVICT_OLDEST}),
    Lab("preemption", "preemption: the victim, recompute and swap",
        "Scheduler.schedule's victim, Scheduler.preempt, BlockManager._move (nanopaged.py)",
        {"the victim": PREEMPT_VICTIM,
         "swap or recompute": PREEMPT_MODE,
         "a swap moves a request's blocks between tiers": SWAP_MOVE}),
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


def run_labs(labs, root=ROOT, quiet=True):
    """Run labs' tests in root, all in one pytest process: {lab name: Result}. quiet=False
    shows pytest's report (each failure's message) as it runs."""
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "report.xml")
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                   "--tb=short", f"--junitxml={report}", *[lab.test_file for lab in labs]]
        env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
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


def grade(lab, root=ROOT):
    """Run lab's tests in root with pytest's report, then the verdict. Returns the Result."""
    result = run_labs([lab], root, quiet=False)[lab.name]
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
        print(f"    cd {args.dir} && python tests/labs.py grade {lab.name}")
        return 0
    if args.command == "grade":
        if not os.path.isdir(os.path.join(args.dir, "tests")):
            parser.error(f"{args.dir} has no tests/ folder: give a handout's folder")
        return 0 if grade(LAB_NAMES[args.lab], os.path.abspath(args.dir)).passed else 1
    for lab in LABS:
        print(f"{lab.name:14} {lab.mechanism}: write {lab.writes}  ({lab.test_file})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

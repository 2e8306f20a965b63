"""
The labs hold (tests/labs/labs.py): grading the project passes every lab; each lab's fresh handout
fails its own lab, naming the mechanism, and passes every other; the solution pasted back into a
handout is the project byte for byte, and passes.

Each handout's labs run in one pytest process, all handouts at once, two at a time: the labs'
tests are small, a process's start (torch, transformers) is most of the time.

    python -m pytest -q tests/labs/test_labs.py
"""
import ast
import concurrent.futures
import os
import subprocess
import time

import pytest

from labs import labs

LAB_IDS = [lab.name for lab in labs.LABS]


def read_bytes(root, name):
    with open(os.path.join(root, name), "rb") as f:
        return f.read()


def project_text(name):
    return labs.read(os.path.join(labs.ROOT, name))


# Wrong solutions, each of which a review once saw pass its lab (the policy lab's: known bugs and
# near misses): what is wrong -> (the lab, the project's lines in nanopaged.py and what replaces
# them, the tests that must fail)
WRONG = {
    "a lookup that ignores the cost rule": (
        "prefix-cache",
        [("tiers = [t for t in self.tiers if self.worth_loading(t)]", "tiers = self.tiers")],
        ["test_a_tier_not_worth_loading_from_is_not_searched"]),
    "a swap that registers no copy": (
        "preemption",
        [("""                if src.blocks[block_id].hash is not None:
                    # its copy is found there too
                    self._register(dst, dst.blocks[new], like=src.blocks[block_id])
""", "")],
        ["test_a_swap_registers_the_copies_of_registered_blocks"]),
    "an eviction that never writes down nor remembers, a free that ignores coming_back": (
        "eviction",
        [("self.write_down_or_lose(pool, pool.blocks[block_id], seq, why)",
          'self.counts["num_evictions"] += 1'),
         ("""            if coming_back and block.ref_count == 1:
                # by its last holder: once
                block.hits += 1
""", "")],
        ["test_an_evicted_block_goes_down_to_the_host_or_is_remembered_lost",
         "test_a_request_coming_back_counts_each_block_it_alone_held_as_found_again"]),
    "a preempt event whose reason is not in brackets": (
        "preemption",
        [('why=f" ({why})" if why else "")', "why=why)")],
        ["test_the_preempt_event_says_the_mode_and_why_as_the_trace_prints_it"]),
    # SGLang's LFU once: its counts stayed 0, so that every block tied and LRU chose
    "an LFU whose counts never grow": (
        "policy",
        [("        return block.hits\n", "        return 0\n")],
        ["test_lfu_evicts_the_block_found_least_often_ties_by_lru",
         "test_lfu_finds_again_the_block_found_most_often"]),
    "a leaf policy that evicts the newest leaf": (
        "policy",
        [("for block_id in pool.cached_block_ids:",
          "for block_id in reversed(pool.cached_block_ids):")],
        ["test_leaf_evicts_the_oldest_leaf_and_orphans_nothing"]),
    # the open part, written: a policy of one's own that is LRU again is graded, and fails
    "an own policy that is LRU": (
        "policy",
        [("\n\nEVICTION_POLICIES = {",
          '\n\nclass MyEviction(BlockManager):\n    """LRU."""\n\n\nEVICTION_POLICIES = {')],
        ["test_your_own_policy_beats_lru"]),
}
# a victim chosen by a loop that never ends: each test that preempts runs past the limit
LOOPS = ("preemption", [("self.preempt(self.running[-1], batch)", "pass")])
LOOP_TIMEOUT = 2


def write_wrong(folder, edits):
    """The project in folder, nanopaged.py edited: each (lines, replacement) once."""
    labs.make_handout(labs.LABS[0], folder)
    labs.paste_back(labs.LABS[0], folder)
    path = os.path.join(folder, "nanopaged.py")
    text = labs.read(path)
    for old, new in edits:
        assert text.count(old) == 1, f"not once in nanopaged.py: {old!r}"
        text = text.replace(old, new)
    labs.write(path, text)


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    """{"project": results, lab name: results on its handout, "pasted " + lab name: results on
    that handout with the solution pasted back, "wrong " + a WRONG key: results on the project
    with that wrong solution in, "loops": and with LOOPS'}, each {lab name: labs.Result}; the
    seconds each run took, in "seconds"."""
    # key -> (folder, its labs to run, the limit a test has)
    folders = {"project": (labs.ROOT, labs.LABS, 20)}
    for lab in labs.LABS:
        handout = str(tmp_path_factory.mktemp(lab.name))
        labs.make_handout(lab, handout)
        folders[lab.name] = (handout, labs.LABS, 20)
        pasted = str(tmp_path_factory.mktemp(f"pasted-{lab.name}"))
        labs.make_handout(lab, pasted)
        labs.paste_back(lab, pasted)
        # byte-identical to the project (test_pasting_back...): its own lab is what is left
        folders[f"pasted {lab.name}"] = (pasted, [lab], 20)
    for what, (name, edits, _) in [*WRONG.items(), ("loops", (*LOOPS, None))]:
        folder = str(tmp_path_factory.mktemp("wrong"))
        write_wrong(folder, edits)
        key = "loops" if what == "loops" else f"wrong {what}"
        folders[key] = (folder, [labs.LAB_NAMES[name]], LOOP_TIMEOUT if key == "loops" else 20)

    def timed(root, lab_list, timeout):
        start = time.perf_counter()
        results = labs.run_labs(lab_list, root, timeout=timeout)
        return results, time.perf_counter() - start

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        runs = {key: pool.submit(timed, *args) for key, args in folders.items()}
        graded = {key: run.result()[0] for key, run in runs.items()}
        graded["seconds"] = {key: run.result()[1] for key, run in runs.items()}
        return graded


def test_every_marker_names_a_lab_and_every_stub_a_region():
    """Each `# lab NAME: below, ...` line names a lab; a lab's stubs match its regions' labels,
    one to one."""
    for name in labs.ENGINE_FILES:
        for line in project_text(name).splitlines():
            lab = labs.marker_lab(line)
            assert lab is None or lab in labs.LAB_NAMES, f"{name}: unknown lab in {line.strip()!r}"
    for lab in labs.LABS:
        labels = []
        for name in labs.ENGINE_FILES:
            labels += [region.label for region in labs.regions(project_text(name), lab)]
        assert sorted(labels) == sorted(lab.stubs), (f"lab {lab.name}: the markers say {labels}, "
                                                     f"the stubs are keyed {list(lab.stubs)}")


def test_handouts_parse_and_keep_lines_within_100_columns():
    """Every stubbed engine file is Python, and no line of it is over 100 columns."""
    for lab in labs.LABS:
        for name in labs.ENGINE_FILES:
            text = project_text(name)
            lines = text.splitlines(keepends=True)
            stubs = [labs.stub_for(lab, region, lines) for region in labs.regions(text, lab)]
            stubbed = labs.replace_regions(text, lab, stubs)
            ast.parse(stubbed)
            wide = [line for line in stubbed.splitlines() if len(line) > 100]
            assert not wide, f"lab {lab.name}, {name}: lines over 100 columns: {wide}"


def test_grading_the_project_passes_every_lab(graded):
    """The project is every lab's solution."""
    for name, result in graded["project"].items():
        assert result.passed, f"{result.verdict()}: {result.failed}"


@pytest.mark.parametrize("name", LAB_IDS)
def test_a_handout_fails_its_own_lab_only(graded, name):
    """A fresh handout fails its lab, the verdict naming the mechanism, and passes the others."""
    results = graded[name]
    own = results[name]
    assert not own.passed and own.num_tests > 0, f"the {name} handout passes its own lab"
    lab = labs.LAB_NAMES[name]
    assert own.verdict().startswith(f"lab {name} ({lab.mechanism}): failed: "), own.verdict()
    others = [r.verdict() for other, r in results.items() if other != name and not r.passed]
    failures = [r.failed for r in results.values()]
    assert not others, f"the {name} handout fails other labs: {others}: {failures}"


@pytest.mark.parametrize("name", LAB_IDS)
def test_pasting_back_the_solution_gives_the_project_and_passes(graded, tmp_path, name):
    """paste_back over a fresh handout gives the project's files byte for byte; graded, it
    passes."""
    lab = labs.LAB_NAMES[name]
    labs.make_handout(lab, str(tmp_path))
    changed = labs.paste_back(lab, str(tmp_path))
    assert changed, "paste_back changed nothing: the handout had no stub"
    for file in labs.project_files():
        assert read_bytes(tmp_path, file) == read_bytes(labs.ROOT, file), file
    result = graded[f"pasted {name}"][name]
    assert result.passed, f"{result.verdict()}: {result.failed}"


@pytest.mark.parametrize("what", WRONG)
def test_a_wrong_solution_fails_its_lab_in_the_test_of_the_rule_it_breaks(graded, what):
    """Each wrong solution a review once saw pass (a rule its stub states, dropped) fails its
    lab, in the test that checks that rule."""
    name, _, tests = WRONG[what]
    result = graded[f"wrong {what}"][name]
    failed = [f.split(":")[0] for f in result.failed]
    assert not result.passed and set(tests) <= set(failed), f"{result.verdict()}: {result.failed}"


def test_a_test_that_loops_forever_fails_named_once_past_its_limit(graded):
    """A victim chosen by a loop that never ends: each preemption test that runs it fails,
    named, once past its limit (2 s here, 20 s by default), and the grade ends in moments."""
    result = graded["loops"]["preemption"]
    timed_out = [f for f in result.failed if f"ran past {LOOP_TIMEOUT} s" in f]
    assert len(timed_out) >= 4 and result.failed == timed_out, result.failed
    for failure in timed_out:
        test = failure.split(":")[0]
        assert f"TimeoutError: {test} ran past {LOOP_TIMEOUT} s" in failure, failure
    # a process's start, then each test that loops: its limit and a moment
    assert graded["seconds"]["loops"] < 30 + (LOOP_TIMEOUT + 1) * result.num_tests


def test_the_command_line_lists_every_lab():
    """`python tests/labs/labs.py` prints one line per lab, naming it and what the student
    writes."""
    out = subprocess.run(["python", os.path.join(labs.ROOT, "tests", "labs", "labs.py")],
                         capture_output=True, text=True, check=True).stdout.splitlines()
    assert [line.split()[0] for line in out] == LAB_IDS


def solution_code(lab):
    """The code lines (stripped) of lab's regions in the project that its stubs do not give away
    (a stub's instructions name some calls): what the student is to write."""
    stubs = "\n".join(lab.stubs.values())
    found = set()
    for name in labs.ENGINE_FILES:
        text = project_text(name)
        lines = text.splitlines()
        for region in labs.regions(text, lab):
            found |= {line.strip() for line in lines[region.start:region.end]}
    return {line for line in found
            if line and not line.startswith(("#", '"""')) and line not in stubs}


def test_a_handouts_labs_py_holds_no_solution_code(tmp_path):
    """tests/labs/labs.py goes out with every handout, as is (one handout stands for all): neither
    its lines nor its strings (joined, as Python joins "a" "b") hold a line of any lab's solution
    (short ones, `break`, `else:`, are anybody's)."""
    labs.make_handout(labs.LABS[0], str(tmp_path))
    text = labs.read(tmp_path / "tests" / "labs" / "labs.py")
    strings = [node.value for node in ast.walk(ast.parse(text))
               if isinstance(node, ast.Constant) and isinstance(node.value, str)]
    handout = "\n".join([text, *strings])
    for lab in labs.LABS:
        leaked = sorted(line for line in solution_code(lab) if len(line) > 12 and line in handout)
        assert not leaked, f"a handout's tests/labs/labs.py holds lab {lab.name}'s {leaked}"


def test_a_handout_into_a_folder_not_empty_is_refused_as_bad_input(tmp_path):
    """`handout LAB DIR` with DIR holding files: argparse's one-line error, exit status 2, and
    nothing written."""
    (tmp_path / "notes.txt").write_text("mine")
    run = subprocess.run(["python", os.path.join(labs.ROOT, "tests", "labs", "labs.py"), "handout",
                          "eviction", str(tmp_path)], capture_output=True, text=True)
    assert run.returncode == 2, run.stderr
    assert run.stderr.splitlines()[-1] == (f"labs.py: error: {tmp_path} is not an empty folder: a "
                                           "handout goes into a new or empty one"), run.stderr
    assert "Traceback" not in run.stderr and os.listdir(tmp_path) == ["notes.txt"]

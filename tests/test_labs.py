"""
The labs hold (tests/labs.py): grading the project passes every lab; each lab's fresh handout
fails its own lab, naming the mechanism, and passes every other; the solution pasted back into a
handout is the project byte for byte, and passes.

Each handout's labs run in one pytest process, all handouts at once, two at a time: the labs'
tests are small, a process's start (torch, transformers) is most of the time.

    python -m pytest -q tests/test_labs.py
"""
import ast
import concurrent.futures
import os
import subprocess

import pytest

import labs

LAB_IDS = [lab.name for lab in labs.LABS]


def read_bytes(root, name):
    with open(os.path.join(root, name), "rb") as f:
        return f.read()


def project_text(name):
    return labs.read(os.path.join(labs.ROOT, name))


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    """{"project": results, lab name: results on its handout, "pasted " + lab name: results on
    that handout with the solution pasted back}, each {lab name: labs.Result}."""
    folders = {"project": (labs.ROOT, labs.LABS)}
    for lab in labs.LABS:
        handout = str(tmp_path_factory.mktemp(lab.name))
        labs.make_handout(lab, handout)
        folders[lab.name] = (handout, labs.LABS)
        pasted = str(tmp_path_factory.mktemp(f"pasted-{lab.name}"))
        labs.make_handout(lab, pasted)
        labs.paste_back(lab, pasted)
        # byte-identical to the project (test_pasting_back...): its own lab is what is left
        folders[f"pasted {lab.name}"] = (pasted, [lab])
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        runs = {key: pool.submit(labs.run_labs, run_labs, root)
                for key, (root, run_labs) in folders.items()}
        return {key: run.result() for key, run in runs.items()}


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


def test_the_command_line_lists_every_lab():
    """`python tests/labs.py` prints one line per lab, naming it and what the student writes."""
    out = subprocess.run(["python", os.path.join(labs.ROOT, "tests", "labs.py")],
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
    """tests/labs.py goes out with every handout, as is (one handout stands for all): neither its
    lines nor its strings (joined, as Python joins "a" "b") hold a line of any lab's solution
    (short ones, `break`, `else:`, are anybody's)."""
    labs.make_handout(labs.LABS[0], str(tmp_path))
    text = labs.read(tmp_path / "tests" / "labs.py")
    strings = [node.value for node in ast.walk(ast.parse(text))
               if isinstance(node, ast.Constant) and isinstance(node.value, str)]
    handout = "\n".join([text, *strings])
    for lab in labs.LABS:
        leaked = sorted(line for line in solution_code(lab) if len(line) > 12 and line in handout)
        assert not leaked, f"a handout's tests/labs.py holds lab {lab.name}'s {leaked}"


def test_a_handout_into_a_folder_not_empty_is_refused_as_bad_input(tmp_path):
    """`handout LAB DIR` with DIR holding files: argparse's one-line error, exit status 2, and
    nothing written."""
    (tmp_path / "notes.txt").write_text("mine")
    run = subprocess.run(["python", os.path.join(labs.ROOT, "tests", "labs.py"), "handout",
                          "eviction", str(tmp_path)], capture_output=True, text=True)
    assert run.returncode == 2, run.stderr
    assert run.stderr.splitlines()[-1] == (f"labs.py: error: {tmp_path} is not an empty folder: a "
                                           "handout goes into a new or empty one"), run.stderr
    assert "Traceback" not in run.stderr and os.listdir(tmp_path) == ["notes.txt"]

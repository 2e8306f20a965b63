"""The code reads as the design asks: the reading path (nanopaged.py, model.py and kernel.py down to
the line that marks its end) holds at most 1,000 code lines, the four .py files at most 27,000
tokens (Python's own: names, operators, literals; not comments, docstrings or layout), no line is
over 100 characters, and every statement has a line of its own."""
import ast
import io
import os
import tokenize

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FILES = ["nanopaged.py", "kernel.py", "model.py", "bench.py"]
READING_PATH = ["nanopaged.py", "model.py", "kernel.py"]
END_MARK = "reading path ends here"


def source(name):
    with open(os.path.join(ROOT, name), encoding="utf-8") as f:
        return f.read()


def reading_path_code_lines(text, whole=False):
    """Lines above the first one containing END_MARK (whole: all lines) that are not blank, not
    only a comment, and not part of a docstring (a line with code and a trailing comment counts);
    None if unmarked."""
    lines = text.splitlines()
    docstrings = docstring_lines(text)
    marks = (i for i, line in enumerate(lines, 1) if END_MARK in line.lower())
    end = len(lines) + 1 if whole else next(marks, None)
    if end is None:
        return None
    return sum(1 for i, line in enumerate(lines[:end - 1], 1)
               if line.strip() and not line.strip().startswith("#") and i not in docstrings)


def test_the_reading_path_is_marked_and_holds_at_most_1000_code_lines():
    """Each of the three files marks where a first reading ends; above the marks, 1,000 code lines."""
    counts = {name: reading_path_code_lines(source(name)) for name in READING_PATH}
    assert None not in counts.values(), f"a file without a '{END_MARK}' line: {counts}"
    assert sum(counts.values()) <= 1000, counts


def test_the_reading_path_count_sees_code_only():
    """The count skips blank lines, comments and docstrings, stops at the mark, and counts code."""
    text = ('"""A module\ndocstring."""\nimport os\n\n# a comment\ndef f():\n    """Doc."""\n'
            '    return 1   # code with a comment\n# reading path ends here\nx = 2\n')
    assert reading_path_code_lines(text) == 3   # import os, def f():, return 1


def docstring_lines(text):
    """The line numbers of every docstring (module, class, function) in text."""
    lines = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            first = node.body[0] if node.body else None
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                lines.update(range(first.lineno, first.end_lineno + 1))
    return lines


LAYOUT = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
          tokenize.ENDMARKER, tokenize.ENCODING}


def code_tokens(text):
    """Python's tokens in text, but comments, docstrings and layout (newlines, indentation)."""
    docstrings = docstring_lines(text)
    return sum(1 for tok in tokenize.generate_tokens(io.StringIO(text).readline)
               if tok.type not in LAYOUT and tok.start[0] not in docstrings)


def test_the_token_count_sees_code_only():
    """Comments, docstrings, blank lines and indentation are free; names, operators and literals
    count, one each, however the lines are packed."""
    text = '"""Doc."""\nimport os\n\n# a comment\ndef f(x):\n    """Doc."""\n    return x + 1  # why\n'
    # import os | def f ( x ) : | return x + 1
    assert code_tokens(text) == 2 + 6 + 4
    assert code_tokens("a = [1,\n     2]\n") == code_tokens("a = [1, 2]\n") == 7


def test_the_four_files_hold_at_most_27000_tokens():
    """nanopaged.py, kernel.py, model.py and bench.py together hold at most 27,000 tokens, counted
    as ../shared/tools/reading-path counts them: packing lines buys nothing."""
    tokens = {name: code_tokens(source(name)) for name in FILES}
    assert sum(tokens.values()) <= 27000, tokens


def test_no_line_is_over_100_characters():
    """Every line of the four files fits in 100 columns."""
    wide = [f"{name}:{i} ({len(line)})" for name in FILES
            for i, line in enumerate(source(name).splitlines(), 1) if len(line) > 100]
    assert not wide, f"lines over 100 characters: {wide}"


def test_one_statement_per_line():
    """No semicolons between statements, and no block body on its header's line (`if x: y`)."""
    joined = []
    for name in FILES:
        text = source(name)
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type == tokenize.OP and tok.string == ";":
                joined.append(f"{name}:{tok.start[0]}")
        for node in ast.walk(ast.parse(text)):
            body = getattr(node, "body", None)
            if isinstance(body, list) and body and not isinstance(node, ast.Module):
                if body[0].lineno == node.lineno:
                    joined.append(f"{name}:{node.lineno}")
    assert not joined, f"statements sharing a line: {joined}"


def defs_without_a_blank_line(text):
    """Line numbers of each def or class that is not the first statement of its block and has no
    blank line above it (above its decorators and the comment lines that lead into it)."""
    lines = text.splitlines()
    glued = []
    for node in ast.walk(ast.parse(text)):
        for field in ("body", "orelse", "finalbody"):
            block = getattr(node, field, None)
            if not isinstance(block, list):
                continue
            for statement in block[1:]:
                if not isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    continue
                first = min([statement.lineno] + [d.lineno for d in statement.decorator_list])
                above = first - 2   # index of the line above it
                while above >= 0 and lines[above].strip().startswith("#"):
                    above -= 1
                if above >= 0 and lines[above].strip():
                    glued.append(statement.lineno)
    return sorted(glued)


def test_a_blank_line_before_every_def_and_class():
    """Every def and class but the first statement of its block has a blank line before it (its
    decorators and leading comments go with it), as in the first reading."""
    glued = {name: defs_without_a_blank_line(source(name)) for name in FILES}
    assert not any(glued.values()), f"defs glued to the line above: {glued}"


def test_the_blank_line_rule_sees_glued_defs():
    """The rule flags a method glued to the one above, and passes spaced ones and first ones."""
    text = ("class A:\n    def f(self):\n        return 1\n    # g's comment\n    def g(self):\n"
            "        return 2\n\n    @property\n    def h(self):\n        return 3\n")
    assert defs_without_a_blank_line(text) == [5]


def test_the_readme_is_at_most_420_lines():
    """The README is read by a class in one go: at most 420 lines (the rest: --help, bench.py).
    (400 until exercise 14 and the priority experiment's results table came.)"""
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        assert len(f.read().splitlines()) <= 420

"""The code reads as the design asks: the four .py files hold at most 2,400 lines, no line is over
100 characters, and every statement has a line of its own."""
import ast
import io
import os
import tokenize

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FILES = ["nanopaged.py", "kernel.py", "model.py", "bench.py"]


def source(name):
    with open(os.path.join(ROOT, name), encoding="utf-8") as f:
        return f.read()


def test_no_line_is_over_100_characters():
    """Every line of the four files fits in 100 columns."""
    wide = [f"{name}:{i} ({len(line)})" for name in FILES
            for i, line in enumerate(source(name).splitlines(), 1) if len(line) > 100]
    assert not wide, f"lines over 100 characters: {wide}"


def test_the_four_files_hold_at_most_2400_lines():
    """nanopaged.py, kernel.py, model.py and bench.py together stay within the design's size."""
    lines = {name: len(source(name).splitlines()) for name in FILES}
    assert sum(lines.values()) <= 2400, lines


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

"""The workbook: every trace the README's exercises ask for, printed from one process, so the model
loads once (each command run alone loads it again: some 20 s on 2 cores), and the tables of
bench.py that some exercises ask for instead.

    python tests/exercises/workbook.py > workbook.txt   # every exercise's traces: every
                                                        # demo's, and more
    python tests/exercises/workbook.py 7 9              # exercises 7 and 9 alone

Each trace comes under the command that prints it alone. The answers are tests:
tests/exercises/test_exercises.py, one `test_exercise_N_...` an exercise, its explanation the
docstring."""
import argparse
import contextlib
import io
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
import nanopaged  # noqa: E402

# exercise -> the flags of each command it runs (each with --trace), as the README gives them
EXERCISES = {
    1: ["--demo prefix", "--demo prefix --no-prefix-caching"],
    2: ["--demo fork", "--demo fork --block-size 8"],
    3: ["--demo beam"],
    4: ["--demo batching"],
    5: ["--demo chunked"],
    6: ["--demo watermark", "--demo watermark --watermark-blocks 0"],
    7: ["--demo preempt"],
    8: ["--demo mix", "--demo mix --preemption-mode recompute"],
    9: ["--demo preempt --preemption-mode auto"],
    10: ["--demo evict"],
    11: ["--demo tiers", "--demo tiers --num-disk-blocks 0"],
    12: ["--demo overlap"],
    13: ["--demo tiers --offload-kv-cache-dtype int8",
         "--demo tiers --offload-kv-cache-dtype int8 --num-cpu-blocks 15"],
    14: ["--demo priority", "--demo priority --priority-aging-steps 0"],
}
# exercise -> the flags of the bench.py command it runs: an exercise read from a table, not a trace
TABLES = {
    15: "--only policies",
}


def command(flags):
    return f"python nanopaged.py {flags} --trace"


def trace(flags):
    """What `python nanopaged.py FLAGS --trace` prints, run in this process (the model loaded
    once for all): the trace, the replies and the metrics."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        nanopaged.main([*flags.split(), "--trace"])
    return out.getvalue()


def table(flags):
    """What `python bench.py FLAGS` prints, run as its own process: bench.py's command line is no
    function to call, and its policy tables need no model (a few seconds)."""
    run = subprocess.run([sys.executable, os.path.join(ROOT, "bench.py"), *flags.split()],
                         cwd=ROOT, capture_output=True, text=True, check=True)
    return run.stdout


def exercise(text):
    """An exercise's number, from the command line (argparse's type)."""
    if not text.isdigit() or int(text) not in (*EXERCISES, *TABLES):
        raise argparse.ArgumentTypeError(f"no exercise {text!r}: 1 to "
                                         f"{len(EXERCISES) + len(TABLES)}")
    return int(text)


def exercises_asked(argv=None):
    """The exercises the command line asks for, in its order; all of them for none."""
    parser = argparse.ArgumentParser(
        description="Every trace the README's exercises ask for, from one process (the model "
                    "loads once); the answers are tests/exercises/test_exercises.py.")
    parser.add_argument("exercises", nargs="*", type=exercise, metavar="N",
                        help=f"exercises to print, 1 to {len(EXERCISES) + len(TABLES)} "
                             "(default: all)")
    return parser.parse_args(argv).exercises or [*EXERCISES, *TABLES]


def main(argv=None):
    for n in exercises_asked(argv):
        if n in TABLES:
            print(f"{'=' * 100}\nexercise {n}: python bench.py {TABLES[n]}\n{'=' * 100}")
            print(table(TABLES[n]), flush=True)
            continue
        for flags in EXERCISES[n]:
            print(f"{'=' * 100}\nexercise {n}: {command(flags)}\n{'=' * 100}")
            print(trace(flags), flush=True)


if __name__ == "__main__":
    main()

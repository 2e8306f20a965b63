"""The labs' hook: a time limit on each lab test (test_lab_*.py). The shared helpers the lab tests
import are tests/conftest.py's."""
import os
import signal

import pytest

import model

# The random model's code loaded before any timer starts: a timer that went off in the middle of
# a first import (transformers' model classes, torch's compiler) would leave it half-loaded, and
# every later test would fail on it, not on the lab
model.load_weights("random:tiny", 0)   # (as LLM("random:tiny") asks, cached)

# A lab's test (tests/labs/test_lab_*.py) that runs past this many seconds fails, named, so that
# a handout whose code loops forever is graded in minutes, not hung (tests/labs/labs.py grade
# --timeout sets another limit, through NANOPAGED_LAB_TIMEOUT)
LAB_TIMEOUT = float(os.environ.get("NANOPAGED_LAB_TIMEOUT", 20))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    """Each lab test runs under a SIGALRM timer of LAB_TIMEOUT seconds (its body; module fixtures
    are set up before): past it, it fails with a TimeoutError naming it. The timer goes off again
    every LAB_TIMEOUT seconds until the test ends: code that swallows an exception (a library's
    `except Exception`) cannot keep a loop going."""
    timed = item.path.name.startswith("test_lab_") and hasattr(signal, "setitimer")

    def ran_past(signum, frame):
        raise TimeoutError(f"{item.name} ran past {LAB_TIMEOUT:g} s: does a loop never end?")

    if timed:
        previous = signal.signal(signal.SIGALRM, ran_past)
        signal.setitimer(signal.ITIMER_REAL, LAB_TIMEOUT, LAB_TIMEOUT)
    try:
        yield
    finally:
        if timed:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)

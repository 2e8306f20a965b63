"""bench.py runs every experiment end to end (random tiny weights, --quick: seconds), and what it
measures holds: the same tokens as transformers, in every tier layout."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_every_experiment_runs_and_its_figures_hold(tmp_path):
    path = tmp_path / "bench.json"
    subprocess.run([sys.executable, "bench.py", "--quick", "--model", "random:tiny", "--json",
                    str(path)], cwd=ROOT, check=True, capture_output=True, timeout=600)
    experiments = json.loads(path.read_text())["experiments"]
    assert list(experiments) == ["memory", "throughput", "prefix", "kv_dtype", "priority",
                                 "multiturn"]
    rows = {name: e["rows"] for name, e in experiments.items()}
    paged, contiguous = rows["memory"][1], rows["memory"][-1]
    assert paged[2] > contiguous[2] and paged[4] > contiguous[4]   # occupancy, requests at once
    assert [row[4] for row in rows["throughput"]] == [1.0] * 4     # the same greedy tokens
    assert all(0 < row[5] < 1 for row in rows["throughput"])       # a share of the matmul floor
    on, off = rows["prefix"]
    assert on[1] < off[1] and on[2] > 0 == off[2]                  # fewer computed, hits
    exact = [row for row in rows["multiturn"] if "INT8" not in row[0]]   # INT8 rounds what it loads
    assert all(row[-1] is True for row in exact)
    floats, int8 = rows["kv_dtype"]   # bytes per block, requests at once: INT8 fewer, more
    assert int8[0] == "int8" and floats[1] == 3.2 * int8[1] and int8[2] >= floats[2]
    assert floats[4] == 1.0 == floats[6] and 0 <= int8[4] <= 1    # top-1, identical
    fcfs, by_priority, aging = rows["priority"]
    assert [row[-1] for row in rows["priority"]] == [1.0] * 3      # the same greedy tokens
    assert by_priority[1] < fcfs[1]   # the interactive requests' first token sooner (34x here)
    device_only, with_host = rows["multiturn"][:2]
    assert with_host[1] < device_only[1]                           # the host tier saves compute

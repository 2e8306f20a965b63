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
                                 "multiturn", "policies"]
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
    assert experiments["policies"]["columns"][:2] == ["policy", "hit rate"]
    rates = {row[0]: row[1] for row in rows["policies"]}
    assert list(rates) == ["lru", "fifo", "lfu", "leaf", "opt", "unlimited"]
    online = [rates[p] for p in ("lru", "fifo", "lfu", "leaf")]
    assert 0 < min(online) and max(online) <= rates["opt"] <= rates["unlimited"] <= 1


def test_policies_replay_a_trace_file_without_a_model(tmp_path):
    """Mooncake's format: hash ids prefix-chained, one a block. Of five requests, the second finds
    0, 1; the fourth 0, 1, 2; the fifth 6: 6 hits of 3 + 5 + 3 + 4 + 2 = 17 prompt blocks, under
    every policy in a pool of 12 (11 distinct blocks, and the last token's: nothing evicted)."""
    trace = tmp_path / "trace.jsonl"
    lines = [[0, 1, 2], [0, 1, 3, 4, 5], [6, 7, 8], [0, 1, 2, 9], [6, 10]]
    trace.write_text("".join(json.dumps({"timestamp": i, "input_length": 512 * len(ids),
                                         "output_length": 8, "hash_ids": ids}) + "\n"
                             for i, ids in enumerate(lines)))
    path, svg = tmp_path / "p.json", tmp_path / "p.svg"
    subprocess.run([sys.executable, "bench.py", "--only", "policies", "--replay", str(trace),
                    "--num-blocks", "12", "--sweep", "--json", str(path), "--svg", str(svg)],
                   cwd=ROOT, check=True, capture_output=True, timeout=120)
    policies = json.loads(path.read_text())["experiments"]["policies"]
    hits = 2 + 3 + 1   # [0, 1]; [0, 1, 2]; [6]
    assert [row[:2] for row in policies["rows"]] == [[p, hits / 17] for p in
                                                      ["lru", "fifo", "lfu", "leaf", "opt",
                                                       "unlimited"]]
    assert any(line.startswith("opt ") for line in policies["notes"])   # the sweep's bars
    assert svg.read_text().startswith("<svg")
    trace.write_text('{"hash_ids": [1, 2]}\n{"hash_ids": "x"}\n')
    bad = subprocess.run([sys.executable, "bench.py", "--only", "policies", "--replay",
                          str(trace)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "Mooncake's format" in bad.stderr
    big = subprocess.run([sys.executable, "bench.py", "--only", "policies", "--replay",
                          str(trace.with_name("none.jsonl"))], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert big.returncode == 2 and "No such file" in big.stderr

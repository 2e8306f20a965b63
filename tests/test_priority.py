"""Priorities and aging (scheduling_policy="priority"): the lines are served by priority, the victim
of a preemption is the least urgent running request, equal priorities are first come first served,
and aging's bound holds: no request is admitted after one that came K * (p - q) or more steps later."""
import io
import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rich.console import Console

from conftest import assert_no_block_held, checked
from nanopaged import LLM, PriorityScheduler, SamplingParams, View


def ids(seed, n, vocab=256):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def greedy(max_tokens):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def run(llm, arrivals):
    """arrivals: [(step, prompt, params, priority)] in order of step. Steps the engine to the end;
    returns (tokens by request id, arrival step by id, the ids in the order of their first
    admission, the step of each first admission)."""
    arrived, admitted, first_step = {}, [], {}
    admit = llm.scheduler._admit

    def logged_admit(request, batch):   # the order of first admissions, within a step too
        if request.request_id not in first_step:
            admitted.append(request.request_id)
            first_step[request.request_id] = llm.num_steps + 1
        admit(request, batch)

    llm.scheduler._admit = logged_admit
    for step, prompt, params, priority in arrivals:
        while llm.num_steps < step and llm.scheduler.has_unfinished():
            llm.step()
        [request_id] = llm.add_requests([prompt], params, priority=[priority])
        arrived[request_id] = llm.num_steps
    while llm.scheduler.has_unfinished():
        llm.step()
    tokens = {r: llm.output(r).outputs[0].token_ids for r in arrived}
    assert_no_block_held(llm)
    return tokens, arrived, admitted, first_step


def engine(policy="priority", aging=0, **kw):
    kw = {"block_size": 4, "num_blocks": 24, "async_copies": False, **kw}   # steps repeat exactly
    return checked(LLM("random:tiny", scheduling_policy=policy, priority_aging_steps=aging, **kw))


def test_the_waiting_line_is_served_by_priority_ties_by_arrival():
    """One request runs at a time: they are admitted by priority (lower first), then by arrival."""
    priorities = [2, 0, 1, 0, 2, 1]
    arrivals = [(0, ids(i, 6), greedy(3), p) for i, p in enumerate(priorities)]
    _, _, admitted, _ = run(engine(max_num_seqs=1), arrivals)
    assert admitted == [1, 3, 2, 5, 0, 4]
    _, _, fcfs_order, _ = run(engine("fcfs", max_num_seqs=1),
                              [(s, p, params, 0) for s, p, params, _ in arrivals])
    assert fcfs_order == [0, 1, 2, 3, 4, 5]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_the_victim_is_the_lowest_priority_running_request_newest_among_equals(mode):
    """Every preemption takes the running request of the worst priority, the newest of those."""
    llm = engine(num_blocks=20, num_cpu_blocks=40, preemption_mode=mode)
    victims = []
    preempt = llm.scheduler.preempt

    def logged_preempt(request, batch, mode=None):
        worst = max(llm.scheduler.running, key=lambda r: (r.priority, r.request_id))
        victims.append((request.request_id, worst.request_id))
        return preempt(request, batch, mode)

    llm.scheduler.preempt = logged_preempt
    priorities = [1, 0, 2, 1, 0, 2, 1, 0]
    arrivals = [(0, ids(10 + i, 10), greedy(20), p) for i, p in enumerate(priorities)]
    tokens, *_ = run(llm, arrivals)
    assert len(victims) >= 3, "the pool must force preemptions"
    assert all(victim == worst for victim, worst in victims)
    # 2 and 5 (priority 2) wait for room: the first victim is the newest of priority 1, not 7
    assert victims[0][0] == 6
    # the tokens are those of a pool with room for all
    roomy, *_ = run(engine(num_blocks=400), arrivals)
    assert tokens == roomy


def pressure_arrivals():
    """Long and short requests arriving over 40 steps, priorities 0-3, in a pool that preempts."""
    g = torch.Generator().manual_seed(1)
    arrivals = []
    for i in range(24):
        long = i % 4 == 0
        n = int(torch.randint(12, 30, (1,), generator=g)) if long else int(torch.randint(2, 8, (1,), generator=g))
        arrivals.append((2 * i, ids(100 + i, n), greedy(24 if long else 6), 3 if long else i % 3))
    return arrivals


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_equal_priorities_behave_as_first_come_first_served(mode, monkeypatch):
    """All priorities 0, no aging: the same steps, events and tokens as fcfs, preemptions included."""
    arrivals = [(s, p, params, 0) for s, p, params, _ in pressure_arrivals()]
    traces = []
    for policy in ("fcfs", "priority"):
        llm = engine(policy, num_blocks=20, num_cpu_blocks=40, preemption_mode=mode)
        events = []
        llm.on_step.append(lambda report: events.append(   # (their words would add timings)
            [(e.kind, e.seq_ids, e.block_ids, e.to_ids) for e in report.events]))
        tokens, _, admitted, _ = run(llm, arrivals)
        traces.append((tokens, admitted, events, llm.stats()["num_preemptions"]))
    assert traces[0][3] > 0, "the pool must force preemptions"
    assert traces[0] == traces[1]


def test_greedy_tokens_are_the_same_under_every_policy():
    """fcfs, priority, and priority with aging give every request the same greedy tokens."""
    arrivals = pressure_arrivals()
    fcfs, *_ = run(engine("fcfs"), [(s, p, params, 0) for s, p, params, _ in arrivals])
    by_priority, *_ = run(engine("priority"), arrivals)
    aged, *_ = run(engine("priority", aging=2), arrivals)
    assert fcfs == by_priority == aged


def overtakers(arrived, admitted, priority, aging):
    """(r, q) pairs where q came later than r, was admitted first, and so broke aging's bound."""
    broken = []
    for position, q in enumerate(admitted):
        for r in admitted[position + 1:]:   # admitted after q
            later = arrived[q] - arrived[r]
            if q > r and later >= aging * (priority[r] - priority[q]):
                broken.append((r, q))
    return broken


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 24), st.integers(1, 16), st.integers(0, 3)),
                min_size=2, max_size=14),
       st.integers(1, 4), st.sampled_from(["recompute", "swap"]))
def test_aging_bound_holds_on_random_arrivals(requests, aging, mode):
    """No request is admitted after one that came K * (p - q) or more steps later; all finish."""
    arrivals, step = [], 0
    for i, (gap, prompt_len, max_tokens, priority) in enumerate(requests):
        step += gap
        arrivals.append((step, ids(i, prompt_len), greedy(max_tokens), priority))
    llm = engine(aging=aging, num_blocks=16, num_cpu_blocks=16, preemption_mode=mode)
    tokens, arrived, admitted, _ = run(llm, arrivals)
    priority = {r: arrivals[k][3] for k, r in enumerate(sorted(arrived))}
    assert sorted(admitted) == sorted(arrived) and all(tokens.values())
    assert overtakers(arrived, admitted, priority, aging) == []


def test_the_bound_is_tight_and_without_aging_a_stream_starves_a_request():
    """A request of priority 1 among a stream of 0s: without aging it is admitted last; with K it
    is overtaken only by requests that came within K steps of it, as the bound allows."""
    arrivals = [(0, ids(0, 8), greedy(20), 1)]
    arrivals += [(2 * i, ids(1 + i, 8), greedy(8), 0) for i in range(16)]
    for aging in (0, 3):
        llm = engine(aging=aging, max_num_seqs=1)   # one at a time: a line forms
        _, arrived, admitted, _ = run(llm, arrivals)
        priority = {r: arrivals[r][3] for r in arrived}
        if aging == 0:
            assert admitted[-1] == 0   # every later request went first
        else:   # only those that came at steps 0 and 2, within K * (1 - 0) = 3 steps, go first
            assert admitted[:3] == [1, 2, 0]
            assert overtakers(arrived, admitted, priority, aging) == []


def test_a_failed_step_leaves_the_aging_counts_as_they_were():
    """A step that raises is undone: the steps waited, and so every rank, are as before it."""
    llm = engine(aging=2, num_blocks=12, max_num_seqs=1)
    llm.add_requests([ids(i, 6) for i in range(4)], greedy(6), priority=[2, 1, 0, 0])
    for _ in range(3):
        llm.step()
    waited = dict(llm.scheduler.num_steps_waited)
    lines = [r.request_id for r in [*llm.scheduler.waiting, *llm.scheduler.running]]

    def broken(*args):
        raise RuntimeError("the model failed")

    model, llm.model = llm.model, broken
    with pytest.raises(RuntimeError):
        llm.step()
    llm.model = model
    assert dict(llm.scheduler.num_steps_waited) == waited
    # the running request is to be recomputed: in the line by its rank, as before the step
    rank = llm.scheduler.rank
    assert [r.request_id for r in llm.scheduler.waiting] == sorted(
        lines, key=lambda r: rank(llm.requests[r]))
    llm.block_manager.check_invariants()
    while llm.scheduler.has_unfinished():
        llm.step()
    assert_no_block_held(llm)


def test_the_view_shows_each_requests_priority_effective_and_given():
    """The trace's sequence rows carry a priority column under "priority", and none under fcfs."""
    text = {}
    for policy in ("fcfs", "priority"):
        llm = engine(policy, aging=2 if policy == "priority" else 0, max_num_seqs=1)
        priorities = [1, 0] if policy == "priority" else None
        llm.add_requests([ids(1, 6), ids(2, 6)], greedy(6), priority=priorities)
        for _ in range(5):
            report = llm.step()
        console = Console(width=100, record=True, file=io.StringIO())
        console.print(View(llm, live=False).frame(report))
        text[policy] = console.export_text()
    assert "priority" not in text["fcfs"] and "priority" in text["priority"]
    # request 0 (priority 1) waits behind request 1 (0): 5 steps waited, 2 levels gained: -1
    rows = re.findall(r"^ *\d+ +(\d+) +(-?\d+) \( *(\d+)\) +(\w+)", text["priority"], re.M)
    assert rows == [("1", "0", "0", "running"), ("0", "-1", "1", "waiting")]


@pytest.mark.parametrize("call, message", [
    (lambda llm: llm.generate([[1, 2]], greedy(2), priority=[1]), "scheduling_policy='priority'"),
    (lambda llm: llm.add_requests([[1, 2], [3]], greedy(2), priority=[0]), "one int per prompt"),
    (lambda llm: llm.add_requests([[1, 2]], greedy(2), priority=[0.5]), "one int per prompt"),
    (lambda llm: llm.add_requests([[1, 2]], greedy(2), priority=3), "one int per prompt"),
])
def test_bad_priorities_are_value_errors_and_nothing_is_queued(call, message):
    """A priority under fcfs, or not one int per prompt: a ValueError, and the engine unchanged."""
    llm = engine("fcfs" if "policy" in message else "priority")
    with pytest.raises(ValueError, match=message):
        call(llm)
    assert not llm.scheduler.has_unfinished()


@pytest.mark.parametrize("kwargs, message", [
    (dict(scheduling_policy="lifo"), "scheduling_policy must be"),
    (dict(priority_aging_steps=-1), "priority_aging_steps must be"),
    (dict(scheduling_policy="fcfs", priority_aging_steps=2), "give scheduling_policy='priority'"),
])
def test_bad_policy_arguments_are_value_errors(kwargs, message):
    """Before the model loads: an unknown policy, negative aging, aging without priorities."""
    with pytest.raises(ValueError, match=message):
        LLM("random:tiny", **kwargs)


def test_priority_scheduler_is_chosen_by_the_policy():
    assert isinstance(engine().scheduler, PriorityScheduler)
    assert not isinstance(engine("fcfs").scheduler, PriorityScheduler)


def test_a_finished_request_leaves_the_aging_counts():
    """The steps waited are kept for the requests in a line only: the step after a request has
    finished forgets its count (the undo copies the count every step, so it must not grow with
    every request ever served)."""
    llm = engine(aging=2, max_num_seqs=1)   # one at a time: the others wait, and age
    first = llm.add_requests([ids(i, 6) for i in range(3)], greedy(4), priority=[1, 0, 0])
    while llm.scheduler.has_unfinished():
        llm.step()
    assert sum(llm.scheduler.num_steps_waited[r] for r in first) > 0   # they were counted
    [later] = llm.add_requests([ids(9, 6)], greedy(4), priority=[0])
    llm.step()
    assert set(llm.scheduler.num_steps_waited) == {later}
    while llm.scheduler.has_unfinished():
        llm.step()
    for r in [*first, later]:
        llm.output(r)
    assert_no_block_held(llm)

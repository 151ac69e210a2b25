"""vLLM's priority scheduling (`scheduling_policy="priority"`, `serve --scheduling-policy priority`): requests are
admitted by (priority, arrival), lower first; the running request of the highest (priority, arrival) is preempted
first; "fcfs" accepts only priority 0. Checked against the order the policy defines, computed here on its own, and
against each request's output when it runs alone."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runtime_helpers import RandomLogitsEngine, runtime_config, slowed_steps
from tests.test_server import metrics, request, wait_idle
from trtpaged.errors import RequestError
from trtpaged.runtime.llm_engine import LLMEngine
from trtpaged.runtime.sampling_params import SamplingParams
from trtpaged.server import start_server

GREEDY = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
MODEL = "tiny"


def engine(policy: str = "priority", num_kv_blocks: int = 64, block_size: int = 4, **kw) -> LLMEngine:
    config = runtime_config(num_kv_blocks=num_kv_blocks, block_size=block_size, scheduling_policy=policy, **kw)
    return LLMEngine(RandomLogitsEngine(num_kv_blocks), config, eos_token_ids=[0])


def finish_order(e: LLMEngine) -> list[str]:
    """Request ids in the order they finish, stepping `e` to the end."""
    order: list[str] = []
    while e.has_unfinished():
        order += [o.request_id for o in e.step() if o.finished]
    return order


def test_fcfs_takes_only_priority_zero_and_names_the_field():
    e = engine("fcfs")
    e.add_request([1, 2], GREEDY, priority=0)
    for bad in (1, -1):
        with pytest.raises(RequestError, match="priority scheduling") as info:
            e.add_request([1, 2], GREEDY, priority=bad)
        assert info.value.field == "priority"
    p = engine("priority")
    for bad in (True, 1.5, "1", 2**63, -(2**63) - 1):
        with pytest.raises(RequestError, match=r"integer in \[-2\*\*63, 2\*\*63\)") as info:
            p.add_request([1, 2], GREEDY, priority=bad)
        assert info.value.field == "priority"
    p.add_request([1, 2], GREEDY, priority=2**63 - 1)
    p.add_request([1, 2], GREEDY, priority=-(2**63))
    import numpy as np

    p.add_request([1, 2], GREEDY, priority=np.int64(3))  # vLLM takes numpy's integers too
    assert [g.priority for g in p.scheduler.waiting] == [-(2**63), 3, 2**63 - 1]
    assert all(type(g.priority) is int for g in p.scheduler.waiting)
    assert len(p.scheduler.waiting) == 3 and len(e.scheduler.waiting) == 1  # refused ones left nothing queued
    with pytest.raises(ValueError, match="scheduling_policy"):
        runtime_config(scheduling_policy="lifo")


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.integers(-3, 3), min_size=1, max_size=12))
def test_one_at_a_time_requests_finish_by_priority_then_arrival(priorities):
    """One sequence per step: after the first (admitted alone, before the others arrive), the queued requests run
    one after another in (priority, arrival) order."""
    e = engine(max_batch_size=1, max_num_tokens=8)
    first = e.add_request([1, 2, 3], GREEDY, priority=5)
    e.step()
    ids = [e.add_request([1 + i % 5, 2], GREEDY, priority=p) for i, p in enumerate(priorities)]
    expected = [first] + [ids[i] for i in sorted(range(len(ids)), key=lambda i: (priorities[i], i))]
    assert finish_order(e) == expected
    assert e.kv.pool.num_used == 0


def test_fcfs_runs_requests_in_arrival_order():
    e = engine("fcfs", max_batch_size=1, max_num_tokens=8)
    ids = [e.add_request([1 + i, 2], GREEDY) for i in range(5)]
    assert finish_order(e) == ids


def test_the_lowest_priority_running_request_is_preempted_first():
    """Two requests outgrow a 5-block pool. FCFS preempts the newer one; priority preempts the one of the larger
    priority value even though it is older, and both outputs equal each request's output run alone."""
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    prompts = [[1, 2, 3, 4, 5, 6, 7], [3, 1, 4, 1, 5, 9, 2]]

    def alone(prompt: list[int]) -> list[int]:
        e = engine(num_kv_blocks=64)
        e.add_request(prompt, params)
        while e.has_unfinished():
            outs = [o for o in e.step() if o.finished]
        return outs[0].outputs[0].token_ids

    for policy, priorities, victim in (("fcfs", (0, 0), 1), ("priority", (9, 0), 0)):
        e = engine(policy, num_kv_blocks=5, max_batch_size=4)
        ids = [e.add_request(p, params, priority=q) for p, q in zip(prompts, priorities)]
        outs = {}
        while e.stats()["num_preemptions"] == 0:
            outs.update({o.request_id: o for o in e.step() if o.finished})
        assert [g.request_id for g in e.scheduler.waiting] == [ids[victim]], policy
        assert [g.request_id for g in e.scheduler.running] == [ids[1 - victim]], policy
        while e.has_unfinished():
            outs.update({o.request_id: o for o in e.step() if o.finished})
        assert [outs[r].outputs[0].token_ids for r in ids] == [alone(p) for p in prompts]
        assert e.kv.pool.num_used == 0


def test_a_request_preempted_in_its_prompt_counts_each_sample_as_vllm_counts_child_requests():
    """vLLM v1 fans an n=3 request out into 3 engine requests from the start, each preempted on its own, and its
    num_requests_waiting counts each (vllm/v1/engine/parallel_sampling.py, vllm/v1/core/sched/scheduler.py). A
    request of n samples preempted before its first token (one sequence here, its prompt) counts n in
    num_preemptions and in the engine's waiting sequences; it counted 1."""
    e = engine(num_kv_blocks=6, max_num_tokens=4, max_batch_size=4)
    e.add_request(list(range(1, 8)), SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True), priority=0)
    params = SamplingParams(max_tokens=4, n=3, ignore_eos=True, seed=1)
    victim = e.add_request(list(range(3, 23)), params, priority=9)
    assert e.stats()["num_waiting_seqs"] == 1 + params.n and e.stats()["num_waiting"] == 2
    while e.stats()["num_preemptions"] == 0:
        e.step()
    [group] = e.scheduler.waiting
    assert group.request_id == victim and not group.forked  # the scenario: preempted in its prompt
    stats = e.stats()
    assert stats["num_preemptions"] == stats["num_waiting_seqs"] == params.n
    assert stats["num_running_seqs"] == stats["num_running"] == 1


def test_a_preempted_request_waits_behind_queued_requests_of_lower_value():
    """Recomputed, a preempted request goes back to the queue at its (priority, arrival) place: after a newer
    waiting request of a lower value, before an older one of a higher value."""
    e = engine(num_kv_blocks=5, max_batch_size=2)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    low = e.add_request([1, 2, 3, 4, 5, 6, 7], params, priority=4)
    e.add_request([3, 1, 4, 1, 5, 9, 2], params, priority=0)
    e.step()
    mid = e.add_request([2, 7], params, priority=2)  # the batch is full (2 sequences): it waits
    last = e.add_request([5, 5], params, priority=8)
    while e.stats()["num_preemptions"] == 0:
        e.step()
    assert [g.request_id for g in e.scheduler.waiting] == [mid, low, last]


@pytest.fixture(scope="module")
def priority_server(tiny_engine_dir):
    handle = start_server(tiny_engine_dir, port=0, served_model_name=MODEL, device="cpu", max_batch_size=1,
                          scheduling_policy="priority")  # fmt: skip
    yield handle
    handle.shutdown(timeout=0)


def test_server_serves_waiting_requests_by_priority(priority_server):
    """One sequence at a time: while a long stream runs, a completion of priority 5, then chat and Responses
    requests of priority -5 and 0 queue up; once the stream is closed (aborted), they finish in priority order,
    whatever their arrival. Their answers are those of the same requests sent alone."""
    server = priority_server
    bodies = {
        "low": ("/v1/completions", {"model": MODEL, "prompt": "one two", "max_tokens": 6, "temperature": 0,
                                    "ignore_eos": True, "priority": 5}),
        "high": ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                          "max_tokens": 6, "temperature": 0, "ignore_eos": True, "priority": -5}),
        "mid": ("/v1/responses", {"model": MODEL, "input": "three", "max_output_tokens": 6, "temperature": 0,
                                  "priority": 0}),
    }  # fmt: skip
    alone = {name: request(server, path, body)[2] for name, (path, body) in bodies.items()}

    async def run() -> list[str]:
        done: list[str] = []
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            blocker = {"model": MODEL, "prompt": "x", "max_tokens": 500, "temperature": 0, "ignore_eos": True,
                       "stream": True}  # fmt: skip
            async with client.stream("POST", "/v1/completions", json=blocker) as held:
                lines = held.aiter_lines()  # held until the end: a collected iterator closes the stream
                async for line in lines:
                    if line.startswith("data: "):
                        break  # it runs: the others wait behind it

                async def send(name: str) -> tuple[str, dict]:
                    path, body = bodies[name]
                    resp = await client.post(path, json=body)
                    assert resp.status_code == 200, resp.text
                    done.append(name)
                    return name, resp.json()

                tasks = []
                for name in ("low", "high", "mid"):  # arrival order: low first
                    tasks.append(asyncio.create_task(send(name)))
                    deadline = time.monotonic() + 30
                    while True:
                        m = await asyncio.to_thread(metrics, server)
                        if m["num_requests_waiting"] == len(tasks):
                            break
                        assert m["num_requests_running"] == 1 and time.monotonic() < deadline, m
                        await asyncio.sleep(0.02)
            answers = dict(await asyncio.gather(*tasks))  # the stream is closed (aborted): the queued ones run
        for name, answer in answers.items():
            assert _text(answer) == _text(alone[name]), name
        return done

    restore = slowed_steps(server, 0.02)  # the blocker's 500 tokens take >= 10 s: the others queue long before its end
    try:
        order = asyncio.run(run())
    finally:
        restore()
    assert order == ["high", "mid", "low"]
    wait_idle(server)


def _text(answer: dict) -> str:
    if answer.get("object") == "response":
        return json.dumps(answer["output"][0]["content"][0]["text"])
    choice = answer["choices"][0]
    return choice["text"] if "text" in choice else choice["message"]["content"]


def test_server_refuses_priority_beyond_int64_naming_it(priority_server):
    status, _, body = request(priority_server, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 1,
                                                                   "priority": 2**63})  # fmt: skip
    assert status == 400 and body["error"]["param"] == "priority", body
    wait_idle(priority_server)


def test_aborts_find_requests_in_a_queue_ordered_by_priority():
    """abort finds a group by bisection of its queue's service order: with priorities out of arrival order, every
    abort in shuffled order finds its request, the others finish as each does alone, and every block comes back."""
    import random

    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    rng = random.Random(7)
    prompts = [[1 + i % 7, 2 + i % 5, 3] for i in range(30)]
    priorities = [rng.randint(-4, 4) for _ in prompts]
    e = engine(num_kv_blocks=12, max_batch_size=4, preemption_mode="swap", num_host_blocks=64)
    ids = [e.add_request(p, params, priority=q) for p, q in zip(prompts, priorities)]
    for _ in range(3):
        e.step()
    gone = rng.sample(ids, 15)
    for r in gone:
        assert e.abort(r) and not e.abort(r)
    outs = {}
    while e.has_unfinished():
        outs.update({o.request_id: o for o in e.step() if o.finished})
    assert sorted(outs) == sorted(set(ids) - set(gone))
    for r in outs:
        alone = engine(num_kv_blocks=64)
        a = alone.add_request(prompts[ids.index(r)], params)
        while alone.has_unfinished():
            last = {o.request_id: o for o in alone.step() if o.finished}
        assert outs[r].outputs[0].token_ids == last[a].outputs[0].token_ids
    assert e.kv.pool.num_used == 0


def test_a_prefilling_request_preempts_a_decoding_one_of_a_larger_value():
    """The decoding request of priority 9 is scheduled before a prefill chunk in FCFS's order; under priority the
    prefilling request of priority 0 comes first, so when its chunks outgrow the pool the request preempted is the
    priority-9 one (it preempted itself, and then waited for the other to finish)."""
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    e = engine(num_kv_blocks=10, block_size=4, max_num_tokens=8, max_batch_size=4, max_seq_len=128)
    low = e.add_request([1, 2], params, priority=9)
    e.step()  # low decodes from here on
    high = e.add_request(list(range(1, 34)), params, priority=0)  # 9 blocks, prefilled in chunks
    while e.stats()["num_preemptions"] == 0:
        e.step()
    assert [g.request_id for g in e.scheduler.waiting] == [low]
    assert finish_order(e) == [high, low] and e.kv.pool.num_used == 0


def test_a_swapped_out_request_does_not_hold_back_one_that_comes_before_it():
    """Swap preemption: a priority-9 request swapped out to host memory waits behind a later request of priority
    -5, which is admitted into the free blocks at once (swapped groups held back every admission)."""
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    e = engine(num_kv_blocks=12, block_size=4, max_num_tokens=64, max_batch_size=4, preemption_mode="swap",
               num_host_blocks=64)  # fmt: skip
    first = e.add_request(list(range(1, 17)), params, priority=0)
    low = e.add_request(list(range(3, 19)), params, priority=9)
    while e.stats()["num_swap_outs"] == 0:
        e.step()
    assert [g.request_id for g in e.scheduler.swapped] == [low] and e.kv.pool.num_free >= 1
    high = e.add_request([5, 6], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True), priority=-5)
    e.step()
    assert high in [g.request_id for g in e.scheduler.running] or high not in e.groups  # admitted at once
    order = finish_order(e)
    assert order.index(high) < order.index(low) and sorted(order) == sorted([first, low, high])
    assert e.kv.pool.num_used == 0

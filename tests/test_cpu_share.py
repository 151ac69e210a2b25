"""cpu_share.py: the load readings against the OS's own accounting, the thread rule, and a CPU step beside a busy
process (fewer threads, the same logits)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from trtpaged.runtime import cpu_share
from trtpaged.runtime.cpu_share import DROP_AT, INTERVAL_S, RETURN_BELOW, ThreadBudget

linux = pytest.mark.skipif(not os.path.exists("/proc/stat") or not hasattr(os, "sched_getaffinity"),
                           reason="reads Linux's /proc/stat")
TICKS = os.sysconf("SC_CLK_TCK")
SPIN = "import time\nt = time.monotonic()\nwhile time.monotonic() - t < {seconds}: pass\n"


@linux
def test_own_ticks_are_what_os_times_counts():
    t = time.monotonic()
    while time.monotonic() - t < 0.3:
        pass
    times = os.times()
    own = cpu_share.own_ticks() / TICKS
    assert abs(own - (times.user + times.system)) <= 2 / TICKS + 0.02


@linux
def test_a_process_spinning_on_one_core_shows_in_its_busy_ticks():
    """A child pinned to one of this process's cores and spinning 1 s: that core's busy ticks grow by about 1 s
    (other load only adds), and the cores' own sum (cpuN lines) is what the whole-machine line grows by, at most."""
    core = min(os.sched_getaffinity(0))
    before = cpu_share.cores_busy_ticks(frozenset({core}))
    child = subprocess.Popen([sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{{core}}})\n"
                              + SPIN.format(seconds=1.0)])
    child.wait()
    after = cpu_share.cores_busy_ticks(frozenset({core}))
    assert after - before >= 0.8 * TICKS
    assert cpu_share.cores_busy_ticks(frozenset()) == 0


class _Machine:
    """Readings of a machine whose other processes use `foreign` cores and this process `own`, in steps of
    INTERVAL_S (the subject reads them as it reads /proc)."""

    def __init__(self) -> None:
        self.now, self.machine, self.process = 0.0, 0, 0
        self.foreign = self.own = 0.0

    def advance(self) -> None:
        self.now += INTERVAL_S
        self.process += round(self.own * INTERVAL_S * TICKS)
        self.machine += round((self.own + self.foreign) * INTERVAL_S * TICKS)


def _budget(cores: int, most: int, machine: _Machine) -> ThreadBudget:
    budget = ThreadBudget(frozenset(range(cores)), clock=lambda: machine.now, machine_ticks=lambda: machine.machine,
                          process_ticks=lambda: machine.process)
    torch.set_num_threads(most)
    budget.apply()
    return budget


@pytest.mark.parametrize("cores", [2, 4])
def test_a_thread_fewer_for_each_core_others_keep_busy(cores):
    """The rule as the module says it: n threads drop when others leave fewer than n - DROP_AT cores, to the most
    that fits; they come back one at a time when n + 1 would lack less than RETURN_BELOW of a core."""
    threads_before = torch.get_num_threads()
    machine = _Machine()
    try:
        budget = _budget(cores, cores, machine)
        machine.own = cores * 0.9
        seen = []
        for foreign in (0.0, 0.1, DROP_AT - 0.05, DROP_AT + 0.05, 0.5, RETURN_BELOW + 0.05, RETURN_BELOW - 0.05,
                        RETURN_BELOW - 0.05, 1.0, 1.7, 3.0, 0.0, 0.0, 0.0, 0.0):
            machine.foreign = foreign
            machine.advance()
            seen.append((foreign, budget.apply(), torch.get_num_threads()))
        expected, n = [], cores
        for foreign in [f for f, _, _ in seen]:
            free = cores - foreign
            if free < n - DROP_AT and n > 1:
                n = max(1, int(free + DROP_AT))
            elif free > n + 1 - RETURN_BELOW and n < cores:
                n += 1
            expected.append(n)
        assert [t for _, t, _ in seen] == expected
        assert all(t == got for _, t, got in seen)  # set on this thread
        if cores == 2:
            assert expected[:8] == [2, 2, 2, 1, 1, 1, 2, 2]  # hysteresis: 0.5 keeps 1, 0.3 gives 2 back
    finally:
        torch.set_num_threads(threads_before)


def test_a_count_the_user_sets_is_the_most_it_gives():
    threads_before = torch.get_num_threads()
    machine = _Machine()
    try:
        budget = _budget(4, 4, machine)
        torch.set_num_threads(2)
        machine.advance()
        assert budget.apply() == 2 and budget.most == 2
        machine.advance()
        assert budget.apply() == 2  # a quiet machine: not back to 4
    finally:
        torch.set_num_threads(threads_before)


def test_steps_from_short_lived_threads_get_every_thread_back():
    """LLM.generate called from short-lived threads: a thread started while the budget was down begins at the count
    set last (torch copies it), often under an ended thread's ident; that is not the user's choice, and a quiet
    machine gives the most back."""
    import threading

    threads_before = torch.get_num_threads()
    machine = _Machine()
    try:
        budget = _budget(2, 2, machine)

        def steps_on_new_threads(foreign: float) -> set[int]:
            machine.foreign = foreign
            machine.advance()
            seen, start = [], threading.Barrier(4)

            def step() -> None:
                start.wait()
                seen.append((budget.apply(), torch.get_num_threads()))

            threads = [threading.Thread(target=step) for _ in range(4)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            assert all(applied == got for applied, got in seen)  # set on each thread
            return {applied for applied, _ in seen}

        assert [steps_on_new_threads(f) for f in (0.0, 0.0, 1.0, 1.0, 1.0)] == [{2}, {2}, {1}, {1}, {1}]
        assert [steps_on_new_threads(0.0) for _ in range(3)] == [{2}, {2}, {2}]
        assert budget.most == 2
    finally:
        torch.set_num_threads(threads_before)


def _shared_budget_beside_a_busy_core(monkeypatch) -> ThreadBudget:
    """The process's budget replaced by one over 2 cores whose readings say others keep one busy, time advancing an
    interval at each reading."""
    machine = _Machine()
    machine.foreign = 1.0

    def clock() -> float:
        machine.advance()
        return machine.now

    budget = ThreadBudget(frozenset(range(2)), clock=clock, machine_ticks=lambda: machine.machine,
                          process_ticks=lambda: machine.process)
    monkeypatch.setenv(cpu_share.ENV, "auto")
    monkeypatch.setattr(cpu_share, "_shared", budget)
    return budget


def _step_counts(llm, prompts: list[str]) -> list[int]:
    """The thread count of the step that finished each prompt, read on the calling thread right after that step
    (by the progress bar LLM.generate updates there)."""
    from trtpaged import SamplingParams

    counts = []

    class Bar:
        def __init__(self, **_: object) -> None:
            pass

        def update(self, n: int) -> None:
            counts.append(torch.get_num_threads())

        def close(self) -> None:
            pass

    llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=Bar)
    return counts


@pytest.mark.parametrize("engine, drops", [("tiny_engine_dir", False), ("tiny_int4_engine_dir", True)])
def test_only_a_step_that_gives_the_same_bits_on_any_thread_count_takes_fewer(engine, drops, request, monkeypatch):
    """Other processes keep one of two cores busy: the int4 engine (every matrix product a kernel of ours) steps on
    one thread; the float engine keeps torch's count, since torch's float GEMM rounds differently on another."""
    from trtpaged import LLM

    threads_before = torch.get_num_threads()
    _shared_budget_beside_a_busy_core(monkeypatch)
    try:
        torch.set_num_threads(2)
        llm = LLM(str(request.getfixturevalue(engine)), device="cpu")
        try:
            assert torch.get_num_threads() == 2  # the warm-up's steps gave the caller's thread its count back
            assert _step_counts(llm, ["hello"]) == [1 if drops else 2]
            assert torch.get_num_threads() == 2  # ... as does generate
        finally:
            llm.close()
    finally:
        torch.set_num_threads(threads_before)


def test_a_float_step_after_a_quantized_one_gets_the_threads_back(tiny_engine_dir, tiny_int4_engine_dir,
                                                                   monkeypatch):
    """One busy core of two (fed readings): the int4 engine's steps take a thread; a float engine stepping next on
    the same thread (a float draft beside a quantized target) runs on the whole count again, its bits those of
    torch's count, and the int4 engine's next steps take the thread again without reading that as the user's."""
    from trtpaged import LLM
    from trtpaged.builder.probe import standard_probe
    from trtpaged.runtime.runners import StepBatch

    threads_before = torch.get_num_threads()
    budget = _shared_budget_beside_a_busy_core(monkeypatch)
    try:
        torch.set_num_threads(2)
        with LLM(str(tiny_int4_engine_dir), device="cpu") as target, LLM(str(tiny_engine_dir), device="cpu") as draft:
            _, steps, _ = standard_probe(16, 4, seed=5, all_rows=True)
            batch = StepBatch(**steps[0].inputs)
            counts = []
            for runner in (target.engine.runner, draft.engine.runner, target.engine.runner):
                runner.step(batch)  # one call's steps, as a draft's and its target's follow each other
                counts.append(torch.get_num_threads())
            assert counts == [1, 2, 1] and budget.most == 2
    finally:
        torch.set_num_threads(threads_before)


def test_fixed_turns_it_off(monkeypatch):
    monkeypatch.setenv(cpu_share.ENV, "fixed")
    assert cpu_share.shared_budget() is None


@pytest.mark.parametrize("value", ["off", "FIXED", "", "2"])
def test_an_unknown_setting_is_refused_naming_the_variable(value, tiny_int4_engine_dir, monkeypatch):
    """A typo (say "off") would otherwise leave the budget on without a word: the engine refuses to load."""
    from click.testing import CliRunner

    from trtpaged.cli import main

    monkeypatch.setenv(cpu_share.ENV, value)
    result = CliRunner().invoke(main, ["generate", str(tiny_int4_engine_dir), "--prompt", "hi", "--max-tokens", "2"])
    assert result.exit_code != 0
    assert f"TRTPAGED_CPU_THREADS: got {value!r}; expected one of auto, fixed" in result.output


STEP_BESIDE_A_HOG = textwrap.dedent("""
    import json, os, subprocess, sys, time
    import torch
    cpus = sorted(os.sched_getaffinity(0))[:2]
    os.sched_setaffinity(0, cpus)
    torch.set_num_threads(2)
    from trtpaged import LLM
    from trtpaged.builder.probe import standard_probe
    from trtpaged.runtime.runners import StepBatch
    llm = LLM(sys.argv[1], device="cpu")
    runner = llm.engine.runner
    seqs, steps, _ = standard_probe(64, 16, seed=5, all_rows=True)
    def logits():
        return [runner.step(StepBatch(**s.inputs)).tolist() for s in steps]
    quiet = logits()
    hog = subprocess.Popen([sys.executable, "-c", sys.argv[2]])
    try:
        deadline = time.monotonic() + 20
        counts = []
        while time.monotonic() < deadline and (not counts or counts[-1] != 1):
            busy = logits()
            counts.append(torch.get_num_threads())
            time.sleep(0.05)
    finally:
        hog.kill()
    print(json.dumps({"counts": counts, "same": busy == quiet}))
""")


@linux
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2 if hasattr(os, "sched_getaffinity") else True,
                    reason="needs two cores")
def test_steps_beside_a_busy_process_use_a_thread_fewer_and_give_the_same_logits(tiny_int4_engine_dir):
    """On two cores, a process spinning on one of them: the steps go to one thread within a few intervals, and
    their logits are those of the quiet steps, bit for bit."""
    import json

    hog = SPIN.format(seconds=60)
    out = subprocess.run([sys.executable, "-c", STEP_BESIDE_A_HOG, str(tiny_int4_engine_dir), hog], capture_output=True,
                         text=True, timeout=120, env={**os.environ, cpu_share.ENV: "auto"})
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["counts"][-1] == 1, result["counts"]
    assert result["same"]


def test_bench_neighbour_reports_both_settings_and_leaves_no_process(tiny_engine_dir):
    from trtpaged.bench.neighbour_bench import describe, run_neighbour_bench

    def children() -> set[int]:
        with open(f"/proc/self/task/{os.getpid()}/children") as f:
            return {int(p) for p in f.read().split()}

    before = children() if os.path.exists(f"/proc/self/task/{os.getpid()}/children") else None
    report = run_neighbour_bench(tiny_engine_dir, rounds=2, tokens=8, batch=2)
    for condition in ("quiet", "busy"):
        entry = report[condition]
        assert [len(entry["tok_s"][arm]) for arm in ("auto", "fixed")] == [2, 2]
        assert entry["ratio"] == [a / f for a, f in zip(entry["tok_s"]["auto"], entry["tok_s"]["fixed"])]
        assert len(set(entry["threads"]["fixed"])) == 1  # fixed never moves
    assert "auto / fixed" in describe(report)
    if before is not None:
        assert children() <= before

"""The shared noise module: spread arithmetic, the refusal rule, and other processes' CPU load."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from trtpaged.bench.noise import Noise, NoiseMonitor, assess, interval_verdict, spread, verdict


def test_spread_is_p90_minus_p10_over_median() -> None:
    # sorted [1, 1, 1, 1, 2]: median 1, p10 = 1, p90 at rank 3.6 = 1 + 0.6 * (2 - 1)
    assert spread([1.0, 2.0, 1.0, 1.0, 1.0]) == pytest.approx(0.6)
    assert spread([3.0, 3.0, 3.0]) == 0.0
    assert spread([5.0]) == 0.0


@pytest.mark.parametrize("times", [[1.0, float("nan"), 1.0], [1.0, 1.0, float("nan")], [float("nan")],
                                   [0.0, 0.0, 1.0], [0.0, 0.0, 0.0], [1.0, float("inf"), 1.0]])
def test_a_timing_that_is_no_measurement_gets_no_verdict(times: list[float]) -> None:
    """A NaN timing (a failed measurement) or a median of 0 s (below the clock's resolution) says nothing about
    how the repeats agree: the run gets no verdict (a NaN compared as 'not above the limit' and gave 'met')."""
    noise = assess(spread(times), 0.0, cpus=2)
    assert not noise.trustworthy and verdict(True, noise).startswith("no verdict")
    monitor = NoiseMonitor()
    monitor.add_samples([1.0, 1.0, 1.0])
    monitor.add_samples(times)
    assert not monitor.result().trustworthy


def test_a_round_that_is_no_number_gets_no_interval_verdict() -> None:
    from trtpaged.bench.noise import interval_verdict

    quiet = assess(0.0, 0.0, cpus=2)
    assert interval_verdict([1.0] * 5, 0.9, True, quiet).startswith("met")
    for bad in (float("nan"), float("inf")):
        assert interval_verdict([1.0, 1.0, 1.0, 1.0, bad], 0.9, True, quiet).startswith("no verdict")


def test_noisy_runs_get_no_verdict() -> None:
    quiet = assess(0.02, 0.1, cpus=2)
    assert quiet.trustworthy and verdict(True, quiet) == "met" and verdict(False, quiet) == "NOT met"
    spread_out = assess(0.6, 0.1, cpus=2)
    assert not spread_out.trustworthy and "spread 60.0%" in spread_out.reason
    assert verdict(True, spread_out).startswith("no verdict")
    busy = assess(0.02, 1.3, cpus=2)
    assert not busy.trustworthy and "1.30 cores" in busy.reason
    assert "NOT trustworthy" in busy.describe()


BURN = "import time\nt = time.time()\nwhile time.time() - t < 1.5: pass"


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="needs /proc/stat")
def test_foreign_load_counts_other_processes_not_ours() -> None:
    """A process that is not ours (started by a parent that exits at once, so not our descendant) is foreign
    load; our own children, live (a tensor-parallel rank, a server child), are our CPU time."""
    from trtpaged.bench import process_tree

    orphan = subprocess.run([sys.executable, "-c", "import subprocess, sys\nsubprocess.Popen([sys.executable, '-c', "
                             f"{BURN!r}], start_new_session=True)"], check=True)  # fmt: skip
    assert orphan.returncode == 0
    with NoiseMonitor() as mon:
        time.sleep(1.0)  # we use no CPU: what the monitor sees is the burner (and anyone else)
    assert mon.foreign_cores() is not None and mon.foreign_cores() > 0.2
    time.sleep(0.6)  # the orphan is done
    before = process_tree.cpu_seconds()
    child = subprocess.Popen([sys.executable, "-c", BURN])
    time.sleep(1.0)
    with open(f"/proc/{child.pid}/stat") as f:  # the child's own account of its CPU (after the ")" of its name)
        fields = f.read().rsplit(")", 1)[1].split()
    tick = 1 / os.sysconf("SC_CLK_TCK")
    own = (int(fields[11]) + int(fields[12])) * tick
    during = process_tree.cpu_seconds() - before  # ours and the live child's, read after its own count
    child.wait()
    # (a loaded machine gives the burner less than its 1 s; the totals' float sums may differ by a rounding)
    assert own > 0.1 and during >= own - tick / 2, (own, during)


def test_kernel_bench_verdicts_follow_the_noise() -> None:
    import torch

    from trtpaged import kernels
    from trtpaged.bench.kernel_bench import TARGET_PAGED_OVERHEAD, format_report, run_kernel_bench

    if not kernels.available():
        pytest.skip("kernel library not built")
    report = run_kernel_bench(torch.float32, contexts=(64,), batches=(1,), budget_s=0.02)
    noise, summary = report["noise"], report["summary"]
    if noise["trustworthy"]:  # the verdict is the interval's over the rounds the report gives
        assert summary["overhead_verdict"] == interval_verdict(summary["mean_paged_over_contiguous_rounds"],
                                                               1 + TARGET_PAGED_OVERHEAD, False, Noise(**noise))
        # the bandwidth target is on contexts of 2048+: none ran
        assert summary["bandwidth_verdict"] == "no verdict (no case of 2048 tokens or more: the target is on those)"
    else:
        for key in ("bandwidth_verdict", "overhead_verdict"):
            assert summary[key].startswith("no verdict (noisy run: ")
    assert "noise: worst spread" in format_report(report)


def test_kernel_bench_times_the_paged_layout_at_the_block_size_asked() -> None:
    from click.testing import CliRunner

    from trtpaged import kernels
    from trtpaged.bench.kernel_bench import format_report, run_kernel_bench
    from trtpaged.cli import main

    refused = CliRunner().invoke(main, ["bench", "kernel", "--block-size", "48"])
    assert refused.exit_code == 2 and "--block-size" in refused.output and "'64'" in refused.output
    if not kernels.available():
        pytest.skip("kernel library not built")
    report = run_kernel_bench("float32", contexts=(200,), batches=(2,), budget_s=0.02, block_size=64)
    assert report["block_size"] == 64
    assert "paged blocks of 64 tokens" in format_report(report)
    # 200 keys in blocks of 64: 4 blocks per sequence, the last partly filled; both layouts were timed
    (case,) = report["decode"]
    assert case["paged_ms"] > 0 and case["contiguous_ms"] > 0


def test_kernel_bench_steps_over_every_layer_of_a_deep_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from trtpaged import kernels
    from trtpaged.bench import kernel_bench

    if not kernels.available():
        pytest.skip("kernel library not built")
    calls = []
    real = kernels.paged_attention

    def recording(q, k, v, cache, positions, query_start, context_lens, tables, options, **kwargs):
        calls.append((cache, options.layer, k, positions, tables))
        return real(q, k, v, cache, positions, query_start, context_lens, tables, options, **kwargs)

    monkeypatch.setattr(kernels, "paged_attention", recording)
    kernel_bench._decode_inputs(40, 2, 16, "float32", shuffle=True, layers=3)()
    assert [layer for _, layer, *_ in calls] == [0, 1, 2]  # one call per layer, in order
    for cache, layer, k, positions, tables in calls:
        assert cache is calls[0][0] and cache.shape[1] == 3  # one pool of three layers
        for s, pos in enumerate(positions.tolist()):  # each call wrote its keys into its own layer
            assert torch.equal(cache[tables[s, pos // 16], layer, 0, :, pos % 16], k[s])
    monkeypatch.setattr(kernel_bench, "MAX_POOL_BYTES", 2 * 40 * 2 * 3 * 64 * 4 * 2)  # room for two layers
    row = kernel_bench.measure_decode(40, 2, "float32", copy_gbs=10.0, budget_s=0.01, layers=5)
    assert row.layers == 2 and row.paged_ms > 0 and row.contiguous_ms > 0
    report = kernel_bench.run_kernel_bench("float32", contexts=(40,), batches=(2,), budget_s=0.01, layers=2)
    assert report["layers"] == 2 and report["decode"][0]["layers"] == 2
    assert "one call per layer of a 2-layer pool" in kernel_bench.format_report(report)
    from click.testing import CliRunner

    from trtpaged.cli import main

    refused = CliRunner().invoke(main, ["bench", "kernel", "--device", "cuda", "--layers", "2"])
    assert refused.exit_code == 2 and "--layers" in refused.output  # the CUDA benchmark has no layers


def test_the_median_interval_holds_the_population_median_as_often_as_it_claims() -> None:
    import math
    import random

    from trtpaged.bench.noise import median_interval

    assert median_interval([1.0, 2.0, 3.0, 4.0]) is None  # 4 samples: at most 87.5% coverage
    assert median_interval([5.0, 1.0, 4.0, 2.0, 3.0]) == (1.0, 5.0)
    assert median_interval([float(x) for x in range(9)]) == (1.0, 7.0)  # k = 2: coverage 1 - 2 * 10 / 512
    rng = random.Random(7)
    for n in (5, 9, 12):
        trials = 4000
        # a skewed distribution whose median is known exactly: exponential(1), median ln 2
        held = sum(lo <= math.log(2) <= hi for lo, hi in
                   (median_interval([rng.expovariate(1.0) for _ in range(n)]) for _ in range(trials)))  # fmt: skip
        assert held / trials >= 0.88, (n, held / trials)  # >= 0.9 claimed; 4000 trials: 1.6 points of slack


def test_interval_verdicts_need_the_rounds_on_one_side_of_the_target() -> None:
    from trtpaged.bench.noise import interval_verdict

    quiet = assess(0.4, 0.1, cpus=2)  # a wide spread alone does not refuse an interval verdict
    assert interval_verdict([0.95, 1.0, 0.93, 1.1, 0.97], 0.9, True, quiet).startswith("met (")
    assert interval_verdict([0.7, 0.8, 0.85, 0.6, 0.88], 0.9, True, quiet).startswith("NOT met (")
    straddle = interval_verdict([0.95, 1.0, 0.67, 1.1, 0.97], 0.9, True, quiet)
    assert straddle.startswith("no verdict") and "straddles" in straddle
    # lower is better (structured outputs: constrained / plain <= 1.1)
    assert interval_verdict([1.02, 1.05, 1.0, 1.08, 1.01], 1.1, False, quiet).startswith("met (")
    assert interval_verdict([1.2, 1.3, 1.15, 1.25, 1.4], 1.1, False, quiet).startswith("NOT met (")
    busy = assess(0.01, 0.9, cpus=2)
    assert "0.90 cores" in interval_verdict([1.0] * 5, 0.9, True, busy)
    # fewer than 5 rounds: the spread rule, as before
    assert interval_verdict([1.0, 1.0, 1.0], 0.9, True, assess(0.0, 0.1, cpus=2)) == "met"
    assert interval_verdict([1.0, 1.0, 1.0], 0.9, True, quiet).startswith("no verdict (noisy run")


def test_one_round_gets_no_verdict() -> None:
    """A single round's spread is 0 (nothing to disagree with), which the spread rule read as a quiet run: `bench
    structured --repeats 1` and `bench serve-ratio --repeats 1` gave met / NOT met from one round."""
    from trtpaged.bench.noise import interval_verdict

    quiet = assess(spread([1.3]), 0.0, cpus=2)
    assert quiet.trustworthy  # the run's load was nil: the refusal is the round count's
    for ratio in (0.5, 1.3):
        for higher_is_better in (True, False):
            said = interval_verdict([ratio], 0.9, higher_is_better, quiet)
            assert said.startswith("no verdict (one round"), said
    assert interval_verdict([], 0.9, True, quiet).startswith("no verdict (no rounds")
    assert interval_verdict([1.0, 1.02], 0.9, True, assess(spread([1.0, 1.02]), 0.0, cpus=2)) == "met"


def test_kernel_bench_copy_bandwidth_is_timed_across_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """The copy bandwidth, the bandwidth verdict's other side, was timed once before the cases: a load during it
    alone halved it, doubled every case's fraction of it, and no spread showed it. Now it is timed in bouts before,
    between and after the cases: the best bout is the bar, and the bouts' spread is noise."""
    from trtpaged import kernels
    from trtpaged.bench import kernel_bench

    if not kernels.available():
        pytest.skip("kernel library not built")
    copies = iter([0.2] + [0.1] * 20)  # the first copy timing under a load that then went away
    monkeypatch.setattr(kernel_bench, "best_seconds", lambda fn, **_: next(copies))
    report = kernel_bench.run_kernel_bench("float32", contexts=(64, 128), batches=(1,), budget_s=0.01)
    best_gbs = 2 * (1 << 29) / 0.1 / 1e9
    assert report["copy_bandwidth_gbs"] == pytest.approx(best_gbs)
    for case in report["decode"]:
        assert case["fraction_of_copy"] == pytest.approx(case["bandwidth_gbs"] / best_gbs)
    assert report["noise"]["max_spread"] >= spread([0.2, 0.1, 0.1]) > 0.5
    assert report["summary"]["bandwidth_verdict"].startswith("no verdict (noisy run")


def test_kernel_bench_prints_the_copy_bouts_spread_the_noise_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    """The copy line printed the spread of the bouts' GB/s while the noise counted the spread of their times: bouts
    of 0.2, 0.1 and 0.1 s printed 'spread 40.0%' beside a noise line of 80.0%, which no case had."""
    from trtpaged import kernels
    from trtpaged.bench import kernel_bench

    if not kernels.available():
        pytest.skip("kernel library not built")
    bouts = [0.2, 0.1, 0.1]  # before, between and after the two cases
    copies = iter(bouts)
    monkeypatch.setattr(kernel_bench, "best_seconds", lambda fn, **_: next(copies))
    report = kernel_bench.run_kernel_bench("float32", contexts=(64, 128), batches=(1,), budget_s=0.01)
    assert f"the cases, spread {spread(bouts):.1%} of their times" in kernel_bench.format_report(report)


@pytest.mark.parametrize("paged_rounds, said", [
    ([1.0] * 5 + [1.09] * 3, "no verdict (90% interval of the median round [1.00, 1.09]"),  # 3 rounds of 8 at +9%
    ([1.02, 1.01, 1.03, 1.02, 1.0, 1.02, 1.03, 1.01], "met (90% interval of the median round [1.01, 1.03]"),
    ([1.12, 1.1, 1.11, 1.09, 1.1, 1.12, 1.11, 1.1], "NOT met (90% interval of the median round [1.10, 1.12]"),
])  # fmt: skip
def test_kernel_bench_overhead_verdict_is_on_the_rounds_ratios(monkeypatch: pytest.MonkeyPatch,
                                                               paged_rounds: list[float], said: str) -> None:
    """The paged-overhead verdict compared the two layouts' pooled medians with the 5% target, with each side's
    spread under 10% as its only check: three rounds of eight at +9% left the paged median at +0%, 'met', though
    the rounds could not tell +0% from +9%. It is now on the rounds' own paged / contiguous ratios (the sides a
    round timed together), and refused when their median's interval straddles the target."""
    from trtpaged import kernels
    from trtpaged.bench import kernel_bench, noise

    if not kernels.available():
        pytest.skip("kernel library not built")

    def rounds(steps, **_):  # a fake workload: each round's five repeats of each layout take its time
        times = {"paged": paged_rounds, "contiguous": [1.0] * 8}
        return {name: [[t * 1e-3] * 5 for t in times[name]] for name in steps}

    monkeypatch.setattr(kernel_bench, "interleaved_rounds", rounds)
    monkeypatch.setattr(kernel_bench, "best_seconds", lambda fn, **_: 0.1)  # a steady copy
    monkeypatch.setattr(noise, "_machine_busy_seconds", lambda: None)  # the machine's load: not the subject here
    report = kernel_bench.run_kernel_bench("float32", contexts=(64,), batches=(1,), budget_s=0.01)
    assert report["noise"]["trustworthy"]  # each side's repeats spread at most 9%
    assert report["summary"]["mean_paged_over_contiguous_rounds"] == pytest.approx(paged_rounds)
    assert report["summary"]["overhead_verdict"].startswith(said), report["summary"]["overhead_verdict"]


def test_gpu_kernel_bench_refuses_its_verdict_when_the_repeats_disagree() -> None:
    """`bench kernel --device cuda` printed met / NOT met from the best of three repeats of each timing, however
    far apart they were; its report now carries the repeats' worst spread, and a spread over the limit refuses."""
    from trtpaged.bench.kernel_bench_gpu import format_report

    def report(repeats: list[float]) -> dict:
        case = {"context": 2048, "batch": 8, "num_splits_hint": 4, "paged_us": 10.0, "contiguous_us": 10.0,
                "kv_bytes": 1, "kv_read_gbs": 800.0, "fraction_of_copy_read": 0.8, "fraction_of_copy_moved": 0.8,
                "paged_overhead_pct": 0.0, "float16_us": None, "spread": spread(repeats)}  # fmt: skip
        return {"device": "a GPU", "cuda_archs": "90", "timing": "cuda-graph", "kv_cache_dtype": "float16",
                "heads": {"num_heads": 9, "num_kv_heads": 3, "head_dim": 64}, "block_size": 16,
                "copy": {"bytes": 1 << 30, "read_gbs": 1000.0, "moved_gbs": 2000.0, "spread": 0.0},
                "decode": [case], "noise": assess(spread(repeats), None, cpus=2).to_dict(),
                "summary": {"min_fraction_of_copy_read_long": 0.8, "min_fraction_of_copy_moved_long": 0.8,
                            "target_fraction": 0.7, "mean_paged_overhead_pct": 0.0, "max_paged_overhead_pct": 0.0,
                            "min_speedup_vs_float16": None}}  # fmt: skip

    assert "of bytes moved: met)" in format_report(report([10.0, 10.1, 10.0]))
    noisy = format_report(report([10.0, 14.0, 10.2]))
    assert "of bytes moved: no verdict (noisy run: repeats spread" in noisy and "NOT trustworthy" in noisy

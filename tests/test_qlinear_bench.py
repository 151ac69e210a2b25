"""`bench qlinear`: each cell's weight bytes and its fraction of the weight-streaming limit."""

from __future__ import annotations

import pytest

from trtpaged import kernels
from trtpaged.bench.qlinear_bench import format_report, read_bandwidth_gbs, run_qlinear_bench

pytestmark = pytest.mark.skipif(not kernels.available(), reason="the kernel library is not built")


def test_cells_carry_the_packed_bytes_and_the_fraction_of_the_streaming_limit() -> None:
    report = run_qlinear_bench(shapes={"small": (64, 128)}, batches=(1,), working_set_bytes=1 << 20, budget_s=0.01)
    (row,) = report.rows
    assert row.int8_bytes == kernels.qlinear_packed_bytes(8, 64, 128, 32)
    assert row.int4_bytes == kernels.qlinear_packed_bytes(4, 64, 128, 32)
    assert report.read_gbs > 0
    text = format_report(report)
    assert f"read bandwidth {report.read_gbs:.1f} GB/s" in text
    limit_us = row.int4_bytes / (report.read_gbs * 1e9) * 1e6
    line = next(line for line in text.splitlines() if line.startswith("small") and f"{limit_us:10.1f}" in line)
    assert f"{limit_us / row.int4.median_us:7.0%}" in line


def test_read_bandwidth_is_bytes_over_time() -> None:
    assert 0.01 < read_bandwidth_gbs(1 << 22, repeats=2) < 10_000


@pytest.mark.parametrize("args", [["--threads", "-1"], ["--threads", "0"], ["--working-set-mb", "-5"],
                                  ["--working-set-mb", "0"]])
def test_bad_threads_and_working_set_are_refused_naming_the_option(args) -> None:
    """Was: a traceback from torch.set_num_threads, or a negative working set run and printed as 0.0 GB/s."""
    from click.testing import CliRunner

    from trtpaged.cli import main

    result = CliRunner().invoke(main, ["bench", "qlinear", "--quick", *args])
    assert result.exit_code == 2 and args[0] in result.output and "Traceback" not in result.output, result.output



def test_the_report_carries_the_run_s_noise() -> None:
    """The speedups were printed with each cell's p10-p90 but no noise line: no worst spread, no other processes'
    load, nothing saying a noisy run's ratios are indicative only."""
    from trtpaged.bench.noise import Noise

    report = run_qlinear_bench(shapes={"small": (64, 128)}, batches=(1,), working_set_bytes=1 << 20, budget_s=0.01)
    (row,) = report.rows
    cells = [t for t in (row.fp32, row.int8, row.int4, row.int8pack_mm, row.int8_float, row.int4_float) if t]
    worst = max((t.p90_us - t.p10_us) / t.median_us for t in cells)  # each cell's printed p10-p90 over its median
    assert report.noise["max_spread"] == pytest.approx(worst)
    noise = Noise(**report.noise)
    text = format_report(report)
    assert noise.describe() in text
    assert ("the speedups are indicative only" in text) == (not noise.trustworthy)

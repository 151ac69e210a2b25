"""`bench throughput --profile`: phase and op breakdowns of decode steps on the tiny engine."""

from __future__ import annotations

from trtpaged.bench.step_profile import format_step_profile, run_step_profile


def test_profile_splits_a_step_and_names_the_model_ops(tiny_engine_dir) -> None:
    report = run_step_profile(str(tiny_engine_dir), batches=(1, 4))
    assert [p["batch"] for p in report["phases"]] == [1, 4]
    for p in report["phases"]:
        assert abs(sum(p["phases_s"].values()) - p["step_s"]) < 1e-6 or "phase_seconds" in p["source"]
        assert all(v >= 0 for v in p["phases_s"].values())
    for o in report["ops"]:
        names = [op["op"] for op in o["ops"]]
        assert names and sum(op["share"] for op in o["ops"]) <= 1.0 + 1e-9
        assert any("linear" in n or "addmm" in n or "mm" in n for n in names)
    text = format_step_profile(report)
    assert "where a decode step's time goes" in text and "batch 4 decode" in text
    assert set(report["noise"]) >= {"max_spread", "foreign_cores", "trustworthy"} and "noise: worst spread" in text

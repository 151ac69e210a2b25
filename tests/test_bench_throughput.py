"""`bench throughput`: token accounting of each system on the tiny engine, workloads and the command."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest
from click.testing import CliRunner

from trtpaged.bench.throughput_bench import (Request, default_requests, fresh_prompts, load_requests, percentile,
                                             run_hf, run_trtpaged)  # fmt: skip
from trtpaged.cli import main

REQUESTS = [Request(tuple(range(10, 30)), 5), Request(tuple(range(50, 87)), 3), Request(tuple(range(100, 109)), 6)]


@pytest.fixture(scope="module")
def trtpaged_result(tiny_engine_dir):
    return run_trtpaged(str(tiny_engine_dir), REQUESTS)


def test_trtpaged_token_accounting(trtpaged_result) -> None:
    r = trtpaged_result
    assert r.useful_tokens == 5 + 3 + 6
    # each prompt computed once, then one token per output after the first (the last is sampled, never stored)
    assert r.computed_tokens == (20 + 4) + (37 + 2) + (9 + 5)
    assert r.useful_tok_s == pytest.approx(r.useful_tokens / r.wall_s)
    assert 0 < r.ttft_p50_s <= r.ttft_p99_s <= r.wall_s
    assert r.peak_rss_mb > 0


def test_rounds_run_fresh_prompts_of_the_same_shapes(tiny_engine_dir) -> None:
    fresh = fresh_prompts(REQUESTS, 320, seed=1)
    assert [(len(r.prompt_ids), r.output_len) for r in fresh] == [(len(r.prompt_ids), r.output_len) for r in REQUESTS]
    assert all(f.prompt_ids != r.prompt_ids for f, r in zip(fresh, REQUESTS))
    assert all(0 <= t < 320 for r in fresh for t in r.prompt_ids)
    r = run_trtpaged(str(tiny_engine_dir), REQUESTS, rounds=3)
    assert len(r.round_walls) == 3 and r.round_walls[0] == r.wall_s and all(w > 0 for w in r.round_walls)
    # the first round's accounting is unchanged by the rounds after it (fresh prompts: no prefix hits)
    assert r.computed_tokens == (20 + 4) + (37 + 2) + (9 + 5)


def test_fresh_prompts_keep_what_the_prompts_share() -> None:
    """A round after the first runs the same work: prompts that share a prefix (a Mooncake trace's blocks, a trace's
    prefix_id) share exactly as long a one in the fresh prompts, and nothing with the first round's (were: all fresh
    random tokens, so rounds 2+ of a prefix-sharing trace had no prefix hits and ran other work)."""
    shared, a, b = tuple(range(100, 140)), tuple(range(200, 210)), tuple(range(210, 215))
    requests = [Request(shared + a, 4), Request(shared + b, 4), Request(shared[:20], 2), Request(b, 3)]

    def common(x: tuple, y: tuple) -> int:
        return next((i for i, (s, t) in enumerate(zip(x, y)) if s != t), min(len(x), len(y)))

    for seed in (1001, 1002):
        fresh = fresh_prompts(requests, 320, seed)
        assert [(len(r.prompt_ids), r.output_len) for r in fresh] == [(len(r.prompt_ids), r.output_len)
                                                                         for r in requests]  # fmt: skip
        pairs = [(i, j) for i in range(4) for j in range(i + 1, 4)]
        assert [common(fresh[i].prompt_ids, fresh[j].prompt_ids) for i, j in pairs] == \
            [common(requests[i].prompt_ids, requests[j].prompt_ids) for i, j in pairs]  # fmt: skip
        assert all(common(f.prompt_ids, r.prompt_ids) < 3 for f in fresh for r in requests)
        assert all(0 <= t < 320 for r in fresh for t in r.prompt_ids)


def test_hf_static_batches_pad_and_run_to_the_longest(tiny_engine_dir) -> None:
    r = run_hf(str(tiny_engine_dir), REQUESTS, batch_size=2)
    # batch 1: padded to 37 prompt tokens, runs 5 steps (4 decode positions after the prefill) for 2 rows;
    # batch 2: 9 + 5 for 1 row
    assert r.computed_tokens == 2 * (37 + 4) + 1 * (9 + 5)
    assert r.useful_tokens == 14
    # the second batch waits for the first: its TTFT is later than the first batch's
    assert r.ttft_p99_s > r.ttft_p50_s


def test_percentile_interpolates() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0], 99) == pytest.approx(3.97)


def test_default_mix_and_prompt_files(tmp_path) -> None:
    reqs = default_requests(vocab_size=320)
    assert len(reqs) == 16
    assert all(32 <= len(r.prompt_ids) <= 300 and 16 <= r.output_len <= 240 for r in reqs)
    assert all(0 < t < 320 for r in reqs for t in r.prompt_ids)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "abc", "output_len": 4}\n{"prompt": "de", "output_len": 0}\n')
    with pytest.raises(ValueError, match=r"p.jsonl:2: output_len: must be an integer >= 1"):
        load_requests(prompts, lambda text: [ord(c) for c in text], 320)
    prompts.write_text('{"prompt": "abc", "output_len": 4}\n')
    assert load_requests(prompts, lambda text: [ord(c) for c in text], 320) == [Request((97, 98, 99), 4)]
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"prompt_len": 7, "output_len": 3}\n')
    (req,) = load_requests(trace, lambda text: [], 320)
    assert len(req.prompt_ids) == 7 and req.output_len == 3


def test_cli_json_interface(tiny_engine_dir, tmp_path) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"prompt_len": 20, "output_len": 4}\n{"prompt_len": 33, "output_len": 6}\n')
    result = CliRunner().invoke(main, ["bench", "throughput", str(tiny_engine_dir), "--trace", str(trace),
                                       "--hf-batch-size", "2", "--json"])  # fmt: skip
    assert result.exit_code == 0, result.output
    report = json.loads(result.output[result.output.index("{"):])
    names = [s["name"] for s in report["systems"]]
    assert names == ["trtpaged", "hf transformers (static batches)"]
    for s in report["systems"]:
        assert {"name", "useful_tok_s", "computed_tok_s", "wall_s", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s",
                "peak_rss_mb"} <= set(s)  # fmt: skip
        assert s["useful_tokens"] == 10
    assert report["ratio_vs_baseline"] == pytest.approx(
        report["systems"][0]["useful_tok_s"] / report["systems"][1]["useful_tok_s"])
    assert report["systems"][1]["computed_tokens"] == 2 * (33 + 5)
    from trtpaged import kernels

    assert report["systems"][0]["isa"].startswith(f"kernels {kernels.cpu_isa()}")
    assert report["systems"][1]["isa"].startswith("torch CPU capability ")


def test_cli_names_each_systems_isa_and_the_rounds(tiny_engine_dir, tmp_path) -> None:
    from trtpaged import kernels

    trace = tmp_path / "t.jsonl"
    trace.write_text('{"prompt_len": 20, "output_len": 4}\n')
    result = CliRunner().invoke(main, ["bench", "throughput", str(tiny_engine_dir), "--trace", str(trace),
                                       "--baseline", "none", "--rounds", "2"])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert f"  trtpaged: kernels {kernels.describe_cpu_isa()}" in result.output
    assert "trtpaged: rounds on fresh prompts of the same shapes, wall s " in result.output
    bad = CliRunner().invoke(main, ["bench", "throughput", str(tiny_engine_dir), "--rounds", "0"])
    assert bad.exit_code != 0 and "Invalid value for '--rounds': 0 is not in the range 1<=x<=1000" in bad.output


def test_cli_bad_trace_names_line_and_field(tiny_engine_dir, tmp_path) -> None:
    trace = tmp_path / "bad.jsonl"
    trace.write_text('{"prompt_len": 20, "output_len": 4}\n{"prompt_len": 20, "output_len": "x"}\n')
    result = CliRunner().invoke(main, ["bench", "throughput", str(tiny_engine_dir), "--trace", str(trace)])
    assert result.exit_code != 0 and "bad.jsonl:2: output_len: must be an integer" in result.output


def test_cli_refuses_num_requests_with_a_trace_of_its_own_lines(tiny_engine_dir, tmp_path) -> None:
    """was: --num-requests 1 ignored without a word, both lines run (a ShareGPT file takes it as its sample size)"""
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"prompt_len": 20, "output_len": 4}\n{"prompt_len": 24, "output_len": 4}\n')
    result = CliRunner().invoke(main, ["bench", "throughput", str(tiny_engine_dir), "--trace", str(trace),
                                       "--num-requests", "1", "--baseline", "none"])  # fmt: skip
    assert result.exit_code != 0 and "--num-requests: synthetic workload options" in result.output, result.output


@pytest.mark.parametrize("field, value", [("n", 4), ("beam_width", 3), ("arrival", 500)])
def test_cli_refuses_trace_fields_it_would_not_replay(tiny_engine_dir, tmp_path, field, value) -> None:
    """was: the line ran as one sequence at t=0 and the report counted it so, without a word; the error names the
    file's line (a blank line before it: was "request 2")"""
    trace = tmp_path / "t.jsonl"
    lines = [{"prompt_len": 20, "output_len": 4}, {"prompt_len": 20, "output_len": 4, field: value}]
    trace.write_text("\n".join(json.dumps(line) + "\n" for line in lines))
    result = CliRunner().invoke(main, ["bench", "throughput", str(tiny_engine_dir), "--trace", str(trace),
                                       "--baseline", "none"])  # fmt: skip
    assert result.exit_code != 0 and f"t.jsonl:3: {field}: {value}; bench throughput submits" in result.output


def test_the_rounds_walls_are_the_repeats_whose_spread_refuses_a_verdict() -> None:
    """was: the spread was 0 whatever the rounds did, so a run noisy after its first round was trusted"""
    from trtpaged.bench.throughput_bench import SystemResult, run_noise

    def system(walls: list[float], load: float = 0.0) -> SystemResult:
        return SystemResult("s", 1.0, 1.0, walls[0], 0, 0, 0, 0, 0, 1, 1, foreign_cores=load, round_walls=walls)

    quiet = run_noise([system([1.02, 1.0, 1.01]), system([2.0])])
    assert quiet.trustworthy and quiet.max_spread < 0.05
    noisy = run_noise([system([1.02, 1.52, 1.0]), system([2.0])])
    assert not noisy.trustworthy and "repeats spread" in noisy.reason and noisy.max_spread > 0.3
    assert run_noise([system([1.6, 1.0, 1.01])]).trustworthy  # a cold first round is the report's first / second
    assert not run_noise([system([1.6, 1.0])]).trustworthy  # two rounds: both are the repeats
    assert not run_noise([system([1.0]), system([1.0], load=1.2)]).trustworthy  # one round: the load alone



def test_speculation_rows_account_their_tokens(tiny_engine_dir) -> None:
    """The speculation row outputs exactly the requested tokens, one request at a time, and reports its
    acceptance; transformers' prompt lookup (its peer) produces the same useful tokens."""
    spec = run_trtpaged(str(tiny_engine_dir), REQUESTS, "spec", sequential=True,
                        speculative_config={"num_speculative_tokens": 3, "min_acceptance_rate": 0.0})  # fmt: skip
    assert spec.useful_tokens == 14
    assert spec.notes and spec.notes[0].startswith("speculation: ")
    assert 0 < spec.ttft_p50_s <= spec.ttft_p99_s < spec.wall_s
    hf = run_hf(str(tiny_engine_dir), REQUESTS, batch_size=4, prompt_lookup=3, sequential=True)
    assert hf.useful_tokens == 14 and hf.name.startswith("hf prompt lookup")
    # one request at a time whatever batch size was asked for: each prompt computed once, unpadded
    assert hf.computed_tokens >= 20 + 37 + 9


def test_cli_speculation_rows_side_by_side(tiny_engine_dir, tmp_path) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"prompt_len": 20, "output_len": 4}\n{"prompt_len": 12, "output_len": 5}\n')
    config = '{"num_speculative_tokens": 2, "min_acceptance_rate": 0}'
    result = CliRunner().invoke(main, ["bench", "throughput", str(tiny_engine_dir), "--trace", str(trace),
                                       "--speculative-config", config, "--sequential", "--json"])  # fmt: skip
    assert result.exit_code == 0, result.output
    report = json.loads(result.output[result.output.index('{\n  "engine"'):])  # after the progress lines
    names = [s["name"] for s in report["systems"]]
    assert names == ["trtpaged", "trtpaged (ngram speculation, 2 tokens)", "hf prompt lookup (2 tokens)",
                     "hf transformers (static batches)"]  # fmt: skip
    assert report["sequential"] and report["hf_batch_size"] == 1
    assert report["speculation_ratio"] == pytest.approx(
        report["systems"][1]["useful_tok_s"] / report["systems"][0]["useful_tok_s"])
    bad = CliRunner().invoke(main, ["bench", "throughput", str(tiny_engine_dir), "--speculative-config", '{"k": 1}'])
    assert bad.exit_code != 0 and "speculative_config: unknown field(s) ['k']" in bad.output


def test_a_peer_row_past_its_time_limit_is_reported_and_the_run_goes_on(tiny_engine_dir) -> None:
    """transformers' row gets less time than its process takes to start: it is ended and reported as timed out;
    the trtpaged rows keep their figures and no ratio against the missing row is printed."""
    from trtpaged.bench.throughput_bench import format_throughput_report, run_throughput_bench

    report = run_throughput_bench(str(tiny_engine_dir), REQUESTS, baseline="hf", peer_time_limit=0.05)
    trtpaged, hf = report["systems"]
    assert not trtpaged["timed_out"] and trtpaged["useful_tokens"] == 14
    assert hf["timed_out"] and hf["name"] == "hf transformers (static batches)" and "timed out" in hf["notes"][0]
    assert report["ratio_vs_baseline"] is None
    text = format_throughput_report(report)
    assert text.splitlines()[4].split() == ["hf", "transformers", "(static", "batches)", "timed", "out"]
    assert "trtpaged / hf" not in text


@pytest.mark.parametrize("command,option", [(["bench", "throughput"], "--peer-time-limit"),
                                            (["serve"], "--request-timeout"), (["serve"], "--shutdown-timeout")])
@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_time_options_refuse_non_finite_values_before_loading(command, option, value, tmp_path):
    """A range check compares, and nan compares false: the option is refused by name before any engine dir is
    read (tmp_path holds none, so getting that far would fail differently)."""
    result = CliRunner().invoke(main, [*command, str(tmp_path), option, value])
    assert result.exit_code == 2
    assert f"Invalid value for '{option}'" in result.output
    bounded = option == "--peer-time-limit"  # at most a week: inf is past its range, as -inf is below every one
    out_of_range = value == "-inf" or (value == "inf" and bounded)
    assert ("not in the range" if out_of_range else "not a finite number") in result.output


def test_peak_rss_is_printed_in_the_unit_it_is_counted_in() -> None:
    """peak_rss_mb is MiB (/proc's VmHWM KiB / 1024); the table's header said MB, 4.9% fewer bytes per unit."""
    import re

    from trtpaged.bench.noise import assess
    from trtpaged.bench.throughput_bench import SystemResult, format_throughput_report

    row = SystemResult("s", 1.0, 1.0, 1.0, 0, 0, 0, 0, 287.4, 1, 1)
    text = format_throughput_report({"requests": 1, "prompt_tokens": 1, "output_tokens": 1, "systems": [asdict(row)],
                                     "noise": assess(0.0, 0.0, 2).to_dict(), "ratio_vs_baseline": None})
    header = next(line for line in text.splitlines() if line.startswith("system"))
    assert re.search(r"peak RSS (\S+)$", header).group(1) == "MiB"
    assert text.splitlines()[text.splitlines().index(header) + 1].split()[-1] == "287"


def test_a_spawned_rows_peak_rss_is_its_own_not_its_parents() -> None:
    """A row runs in a process its parent forks and execs (run_isolated's spawn): getrusage's ru_maxrss kept the
    parent's RSS at the fork, so a tiny-engine row started from a parent holding 1.5 GiB reported 1527 MiB for its
    own 286. The child's peak is its own VmHWM, whatever the parent holds."""
    import os
    import subprocess
    import sys

    if not os.path.exists("/proc/self/status"):
        pytest.skip("needs /proc")
    held = bytearray(256 << 20)
    held[::4096] = b"\x01" * len(held[::4096])  # resident in the parent at the fork
    # the child's own VmHWM read before and after: the figure lies between (it may grow in between, by the reads)
    code = ("from trtpaged.bench import process_tree\n"
            "def hwm(): return next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('VmHWM:'))\n"
            "before = hwm()\nmib = process_tree.peak_rss_mb()\nprint(before, mib, hwm())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    del held
    before_kib, mib, after_kib = int(out[0]), float(out[1]), int(out[2])
    assert before_kib / 1024 <= mib <= after_kib / 1024 and mib < 128, out


def test_a_run_of_one_round_reports_its_spread_as_not_measured() -> None:
    """One round repeats nothing, yet the noise line said 'worst spread 0.0%' and the ratio was printed as if its
    agreement had been measured; the spread is now 'not measured' and the ratio says it is one round's."""
    from trtpaged.bench.noise import NoiseMonitor, spread
    from trtpaged.bench.throughput_bench import SystemResult, format_throughput_report, run_noise

    def system(name: str, walls: list[float]) -> SystemResult:
        return SystemResult(name, 100.0, 100.0, walls[0], 0, 0, 0, 0, 0, 1, 1, foreign_cores=0.0, round_walls=walls)

    one = run_noise([system("trtpaged", [1.0]), system("hf", [2.0])])
    assert one.trustworthy and one.max_spread is None and "spread not measured" in one.describe()
    three = run_noise([system("trtpaged", [1.2, 1.0, 1.01]), system("hf", [2.0])])
    assert three.trustworthy and three.max_spread == pytest.approx(spread([1.0, 1.01]))
    for noise, said in ((one, "2.00x (one round: how much it varies was not measured"), (three, "2.00x  (hf")):
        report = {"requests": 1, "prompt_tokens": 1, "output_tokens": 1, "systems": [], "noise": noise.to_dict(),
                  "ratio_vs_baseline": 2.0, "hf_batch_size": 8}  # fmt: skip
        assert f"trtpaged / hf useful tok/s: {said}" in format_throughput_report(report)
    monitor = NoiseMonitor()
    monitor.add_samples([1.3])  # one round of a ratio: nothing repeated
    assert monitor.result().max_spread is None


def test_the_hf_row_repeats_its_rounds_so_both_sides_of_the_ratio_have_a_spread(tiny_engine_dir) -> None:
    """With --rounds N only trtpaged's row (and llama.cpp's) ran N times: the transformers row, the ratio's other
    side, ran once, so the run's spread said nothing of it. Every row now runs the rounds, and each row's rounds
    count in the spread."""
    from trtpaged.bench.noise import spread
    from trtpaged.bench.throughput_bench import run_throughput_bench

    report = run_throughput_bench(str(tiny_engine_dir), REQUESTS, baseline="hf", rounds=3)
    walls = {s["name"]: s["round_walls"] for s in report["systems"]}
    assert {name: len(w) for name, w in walls.items()} == {"trtpaged": 3, "hf transformers (static batches)": 3}
    for s in report["systems"]:  # the reported figures are the first round's
        assert s["wall_s"] == s["round_walls"][0]
    assert report["noise"]["max_spread"] == pytest.approx(max(spread(w[1:]) for w in walls.values()))

"""`trtpaged diagnose`: hand-computed answers on small logs, error messages, and the command."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from click.testing import CliRunner

from trtpaged.bench.diagnose import ModelKV, diagnose, load_request_log, read_request_log, shared_prefix_tokens
from trtpaged.bench.memory_bench import Budget
from trtpaged.bench.server_metrics import classify, gauges, parse_prometheus
from trtpaged.bench.workload import TraceRequest
from trtpaged.cli import main


def _log(tmp_path, rows) -> str:
    path = tmp_path / "log.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(path)


def test_three_requests_with_known_block_counts(tmp_path) -> None:
    # 3 requests of 8 + 4 tokens; 4 blocks x 16 slots; max_seq_len 32: reserving it fits 2 at a time
    # (running 2,2,2,2,1,1,1,1: mean 1.5), exact reservation and paging fit all 3 (mean 3).
    trace, prompts = load_request_log(_log(tmp_path, [{"prompt_len": 8, "output_len": 4}] * 3))
    kv = ModelKV(1000, Budget(num_kv_blocks=4, block_size=16, max_seq_len=32, max_batch_size=8, max_num_tokens=64),
                 "test")
    r = diagnose(trace, prompts, kv)
    assert set(r) >= {"baseline", "sharing", "lengths", "bound"}
    assert all(isinstance(r[k]["verdict"], str) and r[k]["verdict"]
               for k in ("baseline", "sharing", "lengths", "bound"))  # fmt: skip
    b = r["baseline"]
    assert b["mean_running"]["contiguous, reserve max_seq_len"] == 1.5
    assert b["exact_vs_reserve_max"] == 2.0 and b["paged_vs_exact"] == 1.0
    assert b["paged_sharing_vs_reserve_max"] == 2.0
    assert b["speedup_in_steps_vs_reserve_max"] == 2.0  # 8 steps vs 4
    lengths = r["lengths"]
    assert lengths["mean_seq_len"] == 12 and lengths["kv_bytes_per_seq_at_mean_len"] == 12000
    assert lengths["seqs_that_fit_paged"] == 4 and lengths["seqs_that_fit_reserving_max_seq_len"] == 2
    assert r["sharing"]["shared_prefix_share"] == 0.0 and r["sharing"]["predicted_memory_saved"] == 0.0
    assert r["bound"]["steps_with_queue"] == 0


def test_shared_prefixes_from_token_ids(tmp_path) -> None:
    a = list(range(1, 41))
    rows = [{"prompt_token_ids": a, "output_len": 2},
            {"prompt_token_ids": a[:32] + list(range(100, 108)), "output_len": 2, "arrival": 1},
            {"prompt_token_ids": list(range(200, 211)), "output_len": 2}]  # fmt: skip
    trace, prompts = load_request_log(_log(tmp_path, rows))
    assert shared_prefix_tokens(prompts) == [0, 32, 0]
    kv = ModelKV(100, Budget(num_kv_blocks=64, block_size=16, max_seq_len=128, max_batch_size=8, max_num_tokens=256),
                 "t")
    s = diagnose(trace, prompts, kv)["sharing"]
    assert s["shared_prefix_share"] == pytest.approx(32 / 91)
    assert s["shared_prefix_share_in_full_blocks"] == pytest.approx(32 / 91)
    # step 0: requests 0 and 2 (arrival 0) hold 3 + 1 blocks. Step 1: request 1 reuses request 0's 2 full
    # blocks and adds 1: 5 in use, 7 without sharing. Step 2: 0 and 2 are done, request 1 alone holds 3.
    assert s["blocks_with_sharing"] == pytest.approx((4 + 5 + 3) / 3)
    assert s["blocks_without_sharing"] == pytest.approx((4 + 7 + 3) / 3)


def test_memory_bound_when_the_pool_is_full(tmp_path) -> None:
    # 20-token prompts take 2 blocks each: 4 blocks hold two requests; the third waits 4 steps with no free block.
    trace, prompts = load_request_log(_log(tmp_path, [{"prompt_len": 20, "output_len": 4}] * 3))
    kv = ModelKV(10, Budget(num_kv_blocks=4, block_size=16, max_seq_len=32, max_batch_size=8, max_num_tokens=64),
                 "t")
    bound = diagnose(trace, prompts, kv)["bound"]
    assert (bound["steps_with_queue"], bound["memory_bound_steps"], bound["batch_limit_steps"]) == (4, 4, 0)
    assert bound["replay_bound"] == "memory-bound"


def test_scheduler_bound_at_the_batch_limit(tmp_path) -> None:
    trace, prompts = load_request_log(_log(tmp_path, [{"prompt_len": 8, "output_len": 4}] * 3))
    kv = ModelKV(10, Budget(num_kv_blocks=64, block_size=16, max_seq_len=32, max_batch_size=2, max_num_tokens=64), "t")
    bound = diagnose(trace, prompts, kv)["bound"]
    assert (bound["steps_with_queue"], bound["memory_bound_steps"], bound["batch_limit_steps"]) == (4, 0, 4)
    assert bound["replay_bound"] == "scheduler-bound"


def test_the_batch_limit_counts_before_a_full_pool(tmp_path) -> None:
    """Both binding (2 running of max 2, the third does not fit either): more memory would admit nothing, so the
    steps are the batch limit's (was: memory-bound, and with 8x the blocks the same steps were scheduler-bound)."""
    trace, prompts = load_request_log(_log(tmp_path, [{"prompt_len": 20, "output_len": 4}] * 3))
    bounds = []
    for blocks in (4, 32):
        kv = ModelKV(10, Budget(num_kv_blocks=blocks, block_size=16, max_seq_len=32, max_batch_size=2,
                                max_num_tokens=64), "t")  # fmt: skip
        bounds.append(diagnose(trace, prompts, kv)["bound"])
    for bound in bounds:
        assert (bound["memory_bound_steps"], bound["batch_limit_steps"]) == (0, bound["steps_with_queue"])
        assert bound["replay_bound"] == "scheduler-bound"
    assert bounds[0]["steps"] == bounds[1]["steps"]


def test_a_long_log_in_seconds_is_replayed_with_its_idle_hour_skipped(tmp_path) -> None:
    """Two requests 30 minutes apart at 1.33 ms a step: 1,353,384 steps apart (was: refused, arrival above
    1,000,000, naming no line); the replay skips the idle stretch, so it takes the steps of the work alone."""
    rows = [{"prompt_len": 20, "output_len": 4, "arrival": 0.5, "step_time_s": 0.00133},
            {"prompt_len": 20, "output_len": 4, "arrival": 1800.5, "step_time_s": 0.00133}]  # fmt: skip
    trace, prompts = load_request_log(_log(tmp_path, rows))
    assert [r.arrival for r in trace] == [0, math.ceil(1800 / 0.00133 - 1e-9)]
    kv = ModelKV(10, Budget(num_kv_blocks=8, block_size=16, max_seq_len=32, max_batch_size=2, max_num_tokens=64), "t")
    bound = diagnose(trace, prompts, kv)["bound"]
    assert bound["steps"] == 2 * 4 and bound["steps_with_queue"] == 0


def test_requests_logged_by_length_only_are_said_to_hide_their_sharing(tmp_path) -> None:
    """A server log without --request-log-prompts: its requests get random tokens, so the replay finds no shared
    prefix whatever the server found; the report says how many requests that is (was: 0% shared, next to the
    server's own 34% cache hits, without a word)."""
    from trtpaged.bench.diagnose import format_diagnosis

    a = list(range(1, 41))
    rows = [{"prompt_len": 40, "output_len": 2}, {"prompt_len": 40, "output_len": 2, "arrival": 1},
            {"prompt_token_ids": a, "output_len": 2, "arrival": 2}]  # fmt: skip
    data = read_request_log(_log(tmp_path, rows))
    assert data.lengths_only == 2
    kv = ModelKV(10, Budget(num_kv_blocks=64, block_size=16, max_seq_len=64, max_batch_size=8, max_num_tokens=64), "t")
    text = format_diagnosis(diagnose(data.trace, data.prompts, kv, log=data))
    assert "2 requests logged by length only: the sharing below cannot see theirs" in text


def test_log_errors_name_line_and_field(tmp_path) -> None:
    cases = [
        ({"output_len": 3}, r"log.jsonl:2: prompt: give exactly one of"),
        ({"prompt": "x", "prompt_len": 3, "output_len": 3}, r":2: prompt: give exactly one"),
        ({"prompt_len": 3, "prompt_token_ids": [1], "output_len": 3},
         r":2: prompt_len: 3 is not the number of prompt_token_ids"),
        ({"prompt_len": 3}, r":2: output_len: required"),
        ({"prompt_token_ids": [1, "x"], "output_len": 3}, r":2: prompt_token_ids: must be a non-empty list"),
        ({"prompt": "hi", "output_len": 3}, r":2: prompt: text prompts need a tokenizer"),
        ({"prompt_len": 3, "output_len": 3, "beam": 2}, r":2: unknown field\(s\) \['beam'\]"),
        ({"prompt_len": 3, "output_len": 3, "n": 0}, r":2: n: must be >= 1"),
    ]
    for bad, message in cases:
        with pytest.raises(ValueError, match=message):
            load_request_log(_log(tmp_path, [{"prompt_len": 3, "output_len": 1}, bad]))


def test_metrics_parsing_and_classification() -> None:
    text = ("# HELP vllm:num_requests_waiting x\nvllm:num_requests_running{model=\"m\"} 8\n"
            "vllm:num_requests_waiting{model=\"m\"} 5\nvllm:kv_cache_usage_perc{model=\"m\"} 0.97\n")  # fmt: skip
    g = gauges(parse_prometheus(text))
    assert g == {"running": 8.0, "waiting": 5.0, "kv_usage": 0.97}
    assert "memory-bound" in classify([g, g])["verdict"]
    free = {"running": 8.0, "waiting": 5.0, "kv_usage": 0.3}
    assert "scheduler-bound" in classify([free], max_batch_size=8)["verdict"]
    idle = {"running": 1.0, "waiting": 0.0, "kv_usage": 0.1}
    assert "not saturated" in classify([idle])["verdict"]


def test_a_batch_full_of_parallel_samples_is_at_max_batch_size() -> None:
    """max_batch_size counts sequences: two requests of n=4 fill a batch of 8. The gauges read trtpaged's request
    count (2 running), and the verdict said 0 samples at max_batch_size."""
    n, requests, waiting = 4, 2, 1
    text = (f"trtpaged:num_requests_running {requests}\ntrtpaged:num_requests_waiting {waiting}\n"
            f"trtpaged:num_sequences_running {n * requests}\ntrtpaged:num_sequences_waiting {n * waiting}\n"
            "trtpaged:kv_cache_usage_perc 0.3\n")  # fmt: skip
    g = gauges(parse_prometheus(text))
    assert (g["running"], g["waiting"]) == (n * requests, n * waiting)
    assert "(1 at max_batch_size): scheduler-bound" in classify([g], max_batch_size=n * requests)["verdict"]


def test_command_with_an_engine(tmp_path, tiny_engine_dir) -> None:
    rows = [{"prompt": "hello world " * 5, "output_len": 8, "n": 2},
            {"prompt_len": 40, "output_len": 8, "prefix_id": 1, "prefix_len": 32, "beam_width": 2},
            {"prompt_len": 40, "output_len": 8, "prefix_id": 1, "prefix_len": 32, "arrival": 3}]  # fmt: skip
    result = CliRunner().invoke(main, ["diagnose", _log(tmp_path, rows), "--engine", str(tiny_engine_dir), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output[result.output.index("{"):])
    from trtpaged.manifest import read_manifest

    assert report["lengths"]["kv_bytes_per_token"] == read_manifest(tiny_engine_dir).kv_bytes_per_token
    assert report["sharing"]["sequences"] == 5
    assert report["sharing"]["prompt_tokens_in_shared_prefixes"] >= 32
    text = CliRunner().invoke(main, ["diagnose", _log(tmp_path, rows), "--engine", str(tiny_engine_dir)])
    assert "4. memory-bound or scheduler-bound" in text.output


def test_command_with_a_config_and_a_bad_log(tmp_path) -> None:
    tiny_yaml = Path(__file__).resolve().parent.parent / "examples" / "tiny.yaml"
    good = _log(tmp_path, [{"prompt_len": 30, "output_len": 10}])
    result = CliRunner().invoke(main, ["diagnose", good, "--config", str(tiny_yaml), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output[result.output.index("{"):])["lengths"]["kv_bytes_per_token"] > 0
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt_len": 30, "output_len": 10}\n{"prompt_len": 30, "output_len": -1}\n')
    result = CliRunner().invoke(main, ["diagnose", str(bad), "--config", str(tiny_yaml)])
    assert result.exit_code != 0 and "bad.jsonl:2: output_len: must be >= 1" in result.output


def test_a_request_the_budget_can_never_run_is_named_by_its_line(tmp_path, tiny_engine_dir) -> None:
    """A server log's refused request (no output, skipped) and a blank line come before the one whose n exceeds the
    tiny engine's max_batch_size 8: the error names its line, 4. Was: 'request 2' (its number among those kept)."""
    line = {"arrival": 0.5, "prompt_len": 20, "output_len": 3, "output_lens": [3], "n": 1, "beam_width": 1,
            "finish_reasons": ["length"], "step_time_s": 0.01}  # fmt: skip
    path = tmp_path / "log.jsonl"
    nine = {"n": 9, "output_lens": [3] * 9, "finish_reasons": ["length"] * 9}
    path.write_text("\n".join([json.dumps(line | {"output_len": 0, "output_lens": [0]}), "", json.dumps(line),
                               json.dumps(line | nine)]) + "\n")  # fmt: skip
    result = CliRunner().invoke(main, ["diagnose", str(path), "--engine", str(tiny_engine_dir)])
    assert result.exit_code == 1
    assert result.output.strip().splitlines()[-1] == (f"Error: {path}:4: 9 sequences (n) exceed max_batch_size 8: "
                                                      "this KV budget and its limits can never run it")


def test_a_mooncake_trace_is_read_as_bench_memory_replays_it(tmp_path) -> None:
    """Its hash ids' 512-token blocks are the prompts (600 tokens of [1, 2]; 700 of [1, 3]; 1000 of [1, 2]): the
    second repeats block 1 (512 tokens), the third the first's whole 600; its timestamps are steps at --step-time.
    Was: "unknown field(s)"."""
    import yaml

    rows = [{"timestamp": 0, "input_length": 600, "output_length": 20, "hash_ids": [1, 2]},
            {"timestamp": 100, "input_length": 700, "output_length": 20, "hash_ids": [1, 3]},
            {"timestamp": 100, "input_length": 1000, "output_length": 20, "hash_ids": [1, 2]}]
    data = read_request_log(_log(tmp_path, rows), vocab_size=320, step_time=0.01)
    assert [len(p) for p in data.prompts] == [600, 700, 1000] and [r.arrival for r in data.trace] == [0, 10, 10]
    assert shared_prefix_tokens(data.prompts) == [0, 512, 600] and data.output_tokens == 60
    with pytest.raises(ValueError, match="timestamps span 100 ms and a replay's arrivals are engine steps: give "
                                         "--step-time SECONDS"):  # fmt: skip
        read_request_log(_log(tmp_path, rows), vocab_size=320)
    config = yaml.safe_load((Path(__file__).resolve().parent.parent / "examples" / "tiny.yaml").read_text())
    (tmp_path / "model.yaml").write_text(yaml.safe_dump({**config, "max_seq_len": 2048}))
    result = CliRunner().invoke(main, ["diagnose", _log(tmp_path, rows), "--config", str(tmp_path / "model.yaml"),
                                       "--step-time", "0.01", "--json"])  # fmt: skip
    assert result.exit_code == 0, result.output
    sharing = json.loads(result.output[result.output.index("{"):])["sharing"]
    assert sharing["prompt_tokens"] == 2300 and sharing["prompt_tokens_in_shared_prefixes"] == 1112


# ---- the server's request log: arrivals in seconds -------------------------------------------------------
BUDGET = Budget(num_kv_blocks=8, block_size=16, max_seq_len=64, max_batch_size=2, max_num_tokens=64)


def test_seconds_arrivals_replay_as_the_steps_they_fall_in(tmp_path) -> None:
    # 20 ms steps; arrivals 0.5 s (first: step 0), +0.06 s (3 steps later), +0.13 s (during step 6: joins 7),
    # and non-monotonic lines (the log is in finish order) keep their own times.
    seconds = [{"prompt_len": 20, "output_len": 6, "arrival": a, "step_time_s": 0.02} for a in (0.5, 0.56, 0.63, 0.52)]
    steps = [{"prompt_len": 20, "output_len": 6, "arrival": a} for a in (0, 3, 7, 1)]
    data = read_request_log(_log(tmp_path, seconds))
    assert [r.arrival for r in data.trace] == [0, 3, 7, 1]
    assert (data.arrival_unit, data.step_time_s) == ("seconds", 0.02)
    kv = ModelKV(100, BUDGET, "t")
    # the same workload given in steps replays identically (same queueing at the batch limit of 2)
    as_seconds = diagnose(data.trace, data.prompts, kv, log=data)
    (tmp_path / "steps").mkdir()
    trace, prompts = load_request_log(_log(tmp_path / "steps", steps))
    as_steps = diagnose(trace, prompts, kv)
    for key in ("baseline", "bound"):
        assert as_seconds[key] == as_steps[key]
    assert as_seconds["bound"]["batch_limit_steps"] > 0  # the arrivals overlap: the test can tell them apart
    assert as_seconds["log"]["arrival_unit"] == "seconds" and as_steps["log"]["arrival_unit"] == "steps"


def test_step_time_from_the_median_of_the_lines_or_the_flag(tmp_path) -> None:
    rows = [{"prompt_len": 8, "output_len": 2, "arrival": a, "step_time_s": st}
            for a, st in ((0.0, 0.01), (0.1, 0.05), (0.2, 0.02))]  # fmt: skip
    path = _log(tmp_path, rows)
    assert read_request_log(path).step_time_s == 0.02
    assert [r.arrival for r in read_request_log(path).trace] == [0, 5, 10]
    assert [r.arrival for r in read_request_log(path, step_time=0.1).trace] == [0, 1, 2]


def test_server_log_fields_are_read_and_refused_requests_skipped(tmp_path) -> None:
    rows = [{"arrival": 1.25, "prompt_len": 3, "prompt_token_ids": [7, 8, 9], "output_len": 4, "output_lens": [4, 1],
             "n": 2, "beam_width": 1, "cached_tokens": 0, "finish_reasons": ["length", "stop"], "ttft_s": 0.1,
             "latency_s": 0.3, "steps": 5, "step_time_s": 0.05},
            {"arrival": 1.5, "prompt_len": 40, "output_len": 0, "output_lens": [0], "n": 1, "beam_width": 1,
             "cached_tokens": 32, "finish_reasons": ["error"], "ttft_s": None, "latency_s": 0.01, "steps": 1,
             "step_time_s": 0.05}]  # fmt: skip
    scored = {**rows[1], "arrival": 1.75, "prompt_len": 5, "cached_tokens": 0, "finish_reasons": ["length"]}
    aborted = {**rows[1], "arrival": 2.0, "finish_reasons": ["abort"]}
    data = read_request_log(_log(tmp_path, rows + [scored, aborted]))
    assert len(data.trace) == 2 and data.prompts[0] == [7, 8, 9] and data.skipped_without_output == 2
    assert data.trace[0] == TraceRequest(prompt_len=3, output_len=4, n=2)
    # echo with max_tokens 0 (no output): its prefill and the token sampled to score it
    assert data.trace[1] == TraceRequest(prompt_len=5, output_len=1, arrival=10)
    s = data.summary()
    assert (s["prompt_tokens"], s["output_tokens"], s["observed_cached_tokens"]) == (8, 5, 0)


def test_output_lens_and_finish_reasons_count_the_completions(tmp_path) -> None:
    """The server logs one output length and one finish reason per completion (n of them, beams too). A line with
    more was read, its output tokens counted twice over what the replay runs (n 1 replays one completion of 3:
    "6 output tokens"); it is now refused naming the field."""
    ok = {"arrival": 0.5, "prompt_len": 3, "output_len": 3, "output_lens": [3, 2], "n": 2, "beam_width": 2,
          "finish_reasons": ["length", "stop"], "step_time_s": 0.01}  # fmt: skip
    assert read_request_log(_log(tmp_path, [ok])).output_tokens == 5
    cases = [({**ok, "n": 1}, r":1: output_lens: 2 completions for n 1"),
             ({**ok, "n": 3, "beam_width": 3}, r":1: output_lens: 2 completions for n 3"),
             ({**ok, "finish_reasons": ["length"]}, r":1: finish_reasons: 1 for 2 completions \(output_lens\)")]
    for bad, message in cases:
        with pytest.raises(ValueError, match=message):
            read_request_log(_log(tmp_path, [bad]))


def test_seconds_log_errors_name_line_and_field(tmp_path) -> None:
    ok = {"prompt_len": 3, "output_len": 1, "arrival": 0.25, "step_time_s": 0.01}
    cases = [
        ({**ok, "arrival": 2}, r"log.jsonl:2: arrival: 2 mixes units: .*log.jsonl:1 gives seconds"),
        ({**ok, "arrival": float("nan")}, r":2: arrival: must be a finite number, got nan"),
        ({**ok, "arrival": -0.5}, r":2: arrival: must be >= 0, got -0.5"),
        ({**ok, "arrival": "0.5"}, r":2: arrival: must be a step \(integer\) or seconds"),
        ({**ok, "step_time_s": 0.0}, r":2: step_time_s: must be > 0"),
        ({**ok, "step_time_s": float("inf")}, r":2: step_time_s: must be a finite number"),
        ({**ok, "latency_s": -1.0}, r":2: latency_s: must be >= 0"),
        ({**ok, "cached_tokens": -16}, r":2: cached_tokens: must be >= 0"),
        ({**ok, "output_lens": [1, None]}, r":2: output_lens: must be a list of integers"),
        ({**ok, "output_lens": [1, 4]}, r":2: output_len: 1 is not the longest of output_lens \[1, 4\]"),
        ({**ok, "cached_tokens": 3}, r":2: cached_tokens: 3 of a 3-token prompt"),
        ({**ok, "finish_reasons": "stop"}, r":2: finish_reasons: must be a list of strings"),
        ({"prompt_len": 3, "output_len": 1}, r":2: arrival: required when the log's arrivals are seconds"),
    ]
    for bad, message in cases:
        with pytest.raises(ValueError, match=message):
            read_request_log(_log(tmp_path, [ok, bad]))
    no_step_time = _log(tmp_path, [{"prompt_len": 3, "output_len": 1, "arrival": 0.5}])
    with pytest.raises(ValueError, match=r"arrival: seconds need a step time: .*--step-time"):
        read_request_log(no_step_time)
    assert read_request_log(no_step_time, step_time=0.1).trace[0].arrival == 0
    steps = _log(tmp_path, [{"prompt_len": 3, "output_len": 1, "arrival": 4}])
    with pytest.raises(ValueError, match=r"--step-time: the log's arrivals are steps"):
        read_request_log(steps, step_time=0.1)
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match=r"--step-time: must be a positive number"):
            read_request_log(no_step_time, step_time=bad)


def test_command_reads_seconds_and_refuses_a_mix(tmp_path) -> None:
    tiny_yaml = Path(__file__).resolve().parent.parent / "examples" / "tiny.yaml"
    rows = [{"prompt_len": 30, "output_len": 10, "arrival": 0.2932},
            {"prompt_len": 30, "output_len": 10, "arrival": 0.31}]
    result = CliRunner().invoke(main, ["diagnose", _log(tmp_path, rows), "--config", str(tiny_yaml), "--step-time",
                                       "0.004", "--json"])  # fmt: skip
    assert result.exit_code == 0, result.output
    report = json.loads(result.output[result.output.index("{"):])
    assert report["log"]["arrival_unit"] == "seconds" and report["log"]["step_time_s"] == 0.004
    mixed = _log(tmp_path, rows + [{"prompt_len": 30, "output_len": 10, "arrival": 3}])
    result = CliRunner().invoke(main, ["diagnose", mixed, "--config", str(tiny_yaml), "--step-time", "0.004"])
    assert result.exit_code != 0 and "log.jsonl:3: arrival: 3 mixes units" in result.output


def test_kv_tier_what_if_on_a_log(tmp_path) -> None:
    """A system prompt (2 blocks) that comes back after another prompt filled a 4-block pool: the pool alone
    recomputes it, an unbounded tier below the pool restores both blocks (32 tokens)."""
    system = list(range(1, 33))
    rows = [{"prompt_token_ids": system + [40, 41], "output_len": 2, "arrival": 0},
            {"prompt_token_ids": list(range(100, 163)), "output_len": 2, "arrival": 10},
            {"prompt_token_ids": system + [50, 51], "output_len": 2, "arrival": 20}]  # fmt: skip
    trace, prompts = load_request_log(_log(tmp_path, rows))
    kv = ModelKV(100, Budget(num_kv_blocks=4, block_size=16, max_seq_len=128, max_batch_size=8, max_num_tokens=256),
                 "t")
    alone, tier = diagnose(trace, prompts, kv, tier_blocks=[None])["kv_tiers"]
    assert (alone["prefix_hit_tokens"], tier["prefix_hit_tokens"], tier["tier_hit_tokens"]) == (0, 32, 32)
    assert alone["tokens_computed"] - tier["tokens_computed"] == 32

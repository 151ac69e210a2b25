"""`trtpaged diagnose`: hand-computed answers on small logs, error messages, and the command."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from trtpaged.bench.diagnose import ModelKV, diagnose, load_request_log, shared_prefix_tokens
from trtpaged.bench.memory_bench import Budget
from trtpaged.bench.server_metrics import classify, gauges, parse_prometheus
from trtpaged.cli import main


def _log(tmp_path, rows) -> str:
    path = tmp_path / "log.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(path)


def test_three_requests_with_known_block_counts(tmp_path) -> None:
    # 3 requests of 8 + 4 tokens; 4 blocks x 16 slots; max_seq_len 32: reserving it fits 2 at a time
    # (running 2,2,2,2,1,1,1,1: mean 1.5), exact reservation and paging fit all 3 (mean 3).
    trace, prompts = load_request_log(_log(tmp_path, [{"prompt_len": 8, "output_len": 4}] * 3))
    kv = ModelKV(1000, Budget(num_blocks=4, block_size=16, max_seq_len=32, max_batch_size=8, max_num_tokens=64), "test")
    r = diagnose(trace, prompts, kv)
    assert set(r) >= {"baseline", "sharing", "lengths", "bound"}
    assert all(isinstance(r[k]["verdict"], str) and r[k]["verdict"] for k in ("baseline", "sharing", "lengths", "bound"))
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
    kv = ModelKV(100, Budget(num_blocks=64, block_size=16, max_seq_len=128, max_batch_size=8, max_num_tokens=256), "t")
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
    kv = ModelKV(10, Budget(num_blocks=4, block_size=16, max_seq_len=32, max_batch_size=8, max_num_tokens=64), "t")
    bound = diagnose(trace, prompts, kv)["bound"]
    assert (bound["steps_with_queue"], bound["memory_bound_steps"], bound["batch_limit_steps"]) == (4, 4, 0)
    assert bound["replay_bound"] == "memory-bound"


def test_scheduler_bound_at_the_batch_limit(tmp_path) -> None:
    trace, prompts = load_request_log(_log(tmp_path, [{"prompt_len": 8, "output_len": 4}] * 3))
    kv = ModelKV(10, Budget(num_blocks=64, block_size=16, max_seq_len=32, max_batch_size=2, max_num_tokens=64), "t")
    bound = diagnose(trace, prompts, kv)["bound"]
    assert (bound["steps_with_queue"], bound["memory_bound_steps"], bound["batch_limit_steps"]) == (4, 0, 4)
    assert bound["replay_bound"] == "scheduler-bound"


def test_log_errors_name_line_and_field(tmp_path) -> None:
    cases = [
        ({"output_len": 3}, r"log.jsonl:2: prompt: give exactly one of"),
        ({"prompt_len": 3, "prompt_token_ids": [1], "output_len": 3}, r":2: prompt: give exactly one"),
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
    from pathlib import Path

    tiny_yaml = Path(__file__).resolve().parent.parent / "examples" / "tiny.yaml"
    good = _log(tmp_path, [{"prompt_len": 30, "output_len": 10}])
    result = CliRunner().invoke(main, ["diagnose", good, "--config", str(tiny_yaml), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output[result.output.index("{"):])["lengths"]["kv_bytes_per_token"] > 0
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt_len": 30, "output_len": 10}\n{"prompt_len": 30, "output_len": -1}\n')
    result = CliRunner().invoke(main, ["diagnose", str(bad), "--config", str(tiny_yaml)])
    assert result.exit_code != 0 and "bad.jsonl:2: output_len: must be >= 1" in result.output

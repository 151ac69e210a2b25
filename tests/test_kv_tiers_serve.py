"""KV tiers through the public surfaces: LLM(kv_tiers=...) and its errors, `trtpaged serve` with tiers under
multi-turn traffic (bench serve --multi-turn's client), /metrics per tier, and a restart finding the disk."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import random
from dataclasses import replace

import httpx
import pytest

from trtpaged.bench.kv_tiers_bench import live_history_blocks
from trtpaged.bench.multi_turn import MultiTurnSpec, _pauses, run_multi_turn
from trtpaged.bench.server_metrics import parse_prometheus
from trtpaged.runtime.kv_tiers.config import KVTierConfig
import trtpaged.runtime.llm as llm_module
from trtpaged.runtime.llm import LLM
from trtpaged.runtime.sampling_params import SamplingParams
from trtpaged.server import start_server

# the tiny engine's tokenizer is byte-level: about five tokens a word
SPEC = MultiTurnSpec(conversations=4, turns=3, system_words=16, user_words=5, output_tokens=6, think_time_s=0.05)
SMALL_POOL = 20  # four live histories of 100-200 tokens do not fit: turns find their history evicted


NEEDS_REDIS_PY = pytest.mark.skipif(importlib.util.find_spec("redis") is None, reason="the redis client is not "
                                    "installed (scripts/setup.sh installs it)")


@pytest.mark.parametrize("spec, field", [
    ({"host": 1}, "kv_tiers.host"),
    ({"host_memory": "lots"}, "kv_tiers.host_memory"),
    ({"host_memory": 0}, "kv_tiers.host_memory"),
    ({"disk": {"path": "/tmp/x"}}, "kv_tiers.disk"),
    ({"disk": {"path": "/tmp/x", "size": "1GiB", "ttl": 3}}, "kv_tiers.disk.ttl"),
    ({"disk": {"path": "", "size": "1GiB"}}, "kv_tiers.disk.path"),
    ({"remote": "http://127.0.0.1:6379"}, "kv_tiers.remote"),
    ({"remote": "redis://127.0.0.1:99999"}, "kv_tiers.remote"),  # was: "Port out of range 0-65535", unnamed
    ({"remote": "redis://127.0.0.1:6379/abc"}, "kv_tiers.remote"),  # redis-py took database 0
    ({"remote": "redis://127.0.0.1:6379/-1"}, "kv_tiers.remote"),  # every operation then failed
    ({"remote": {"url": "redis://127.0.0.1:1", "timeout_s": 0}}, "kv_tiers.remote.timeout_s"),
    ({"remote": {"url": "redis://127.0.0.1:1", "timeout_s": "1"}}, "kv_tiers.remote.timeout_s"),
    ({"host_memory": "1MiB", "load_timeout_s": 0}, "kv_tiers.load_timeout_s"),
    ({"host_memory": "1MiB", "load_timeout_s": "2"}, "kv_tiers.load_timeout_s"),
    ([1], "kv_tiers"),
    ({"host_memory": 1.5}, "kv_tiers.host_memory"),  # was: 1 byte
    # were: accepted, then every operation failed with a TypeError / ValueError that nothing counted or named; a
    # RedisError (not a ValueError) was a traceback
    pytest.param({"remote": "redis://127.0.0.1:6379/0?foo=bar"}, "kv_tiers.remote", marks=NEEDS_REDIS_PY),
    pytest.param({"remote": "redis://127.0.0.1:6379/0?socket_timeout=abc"}, "kv_tiers.remote", marks=NEEDS_REDIS_PY),
    pytest.param({"remote": "rediss://127.0.0.1:1/0?ssl_cert_reqs=bogus"}, "kv_tiers.remote", marks=NEEDS_REDIS_PY),
    ({"host_memory": "1MiB", "secret_file": "/nonexistent/secret"}, "kv_tiers.secret_file"),
    ({"host_memory": "1MiB", "secret_file": 3}, "kv_tiers.secret_file"),
])  # fmt: skip
def test_tier_config_errors_name_the_field(spec, field):
    with pytest.raises(ValueError) as e:
        KVTierConfig.parse(spec)
    assert str(e.value).startswith(field + ":") or str(e.value).startswith(field + " ")


def test_tier_config_parses_sizes_and_builds_in_order(tmp_path):
    config = KVTierConfig.parse({"host_memory": "1MiB", "disk": {"path": str(tmp_path), "size": "2MB"},
                                 "remote": {"url": "redis://127.0.0.1:1/0", "timeout_s": 0.1}, "load_timeout_s": 3})
    assert (config.host_memory, config.disk_size, config.remote_timeout_s) == (1 << 20, 2_000_000, 0.1)
    assert config.load_timeout_s == 3.0
    pytest.importorskip("redis")
    stack = config.build(bytes(32), 64)
    assert [t.name for t in stack.tiers] == ["host", "disk", "remote"]
    stack.close()


def test_a_short_secret_is_refused_and_a_trailing_newline_is_not_part_of_it(tmp_path):
    short, good = tmp_path / "short", tmp_path / "good"
    short.write_text("x" * 15 + "\n")
    good.write_text("y" * 16 + "\n")
    disk = {"path": str(tmp_path / "kv"), "size": "1MiB"}
    with pytest.raises(ValueError, match="^kv_tiers.secret_file: .* holds 15 bytes; a secret is 16 to 4096 bytes"):
        KVTierConfig.parse({"disk": disk, "secret_file": str(short)})
    config = KVTierConfig.parse({"disk": disk, "secret_file": str(good), "remote": "redis://:hunter2@127.0.0.1:1/0"})
    assert config.secret == b"y" * 16 and "yyyy" not in repr(config) and "hunter2" not in repr(config)
    # nothing it would sign: refused rather than read and left unused
    with pytest.raises(ValueError, match="^kv_tiers.secret_file: signs disk and Redis entries; set disk or remote"):
        KVTierConfig.parse({"host_memory": "1MiB", "secret_file": str(good)})
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # opening it would wait for a writer for ever (was: the server hung at start)
    with pytest.raises(ValueError, match="^kv_tiers.secret_file: .*fifo is not a regular file"):
        KVTierConfig.parse({"disk": disk, "secret_file": str(fifo)})
    with pytest.raises(ValueError, match="^kv_tiers.secret_file: .* is not a regular file"):
        KVTierConfig.parse({"disk": disk, "secret_file": str(tmp_path)})


def test_a_password_in_a_redis_url_is_not_shown_in_errors():
    with pytest.raises(ValueError) as e:
        KVTierConfig.parse({"remote": "redis://:hunter2@127.0.0.1:6379/abc"})
    assert "hunter2" not in str(e.value) and "redis://:***@127.0.0.1:6379/abc" in str(e.value)
    with pytest.raises(ValueError) as e:
        KVTierConfig.parse({"remote": "redis://127.0.0.1:6379/abc?password=hunter2"})
    assert "hunter2" not in str(e.value) and "password=***" in str(e.value)


def test_an_unwritable_disk_path_is_refused_before_the_weights_load(tiny_engine_dir, tmp_path, monkeypatch):
    """was: refused naming the field, but only once the model had loaded"""
    (tmp_path / "a-file").write_text("")
    loads = []
    real_load = llm_module.load_runner
    monkeypatch.setattr(llm_module, "load_runner", lambda *a, **k: loads.append(1) or real_load(*a, **k))
    with pytest.raises(ValueError, match="^kv_tiers.disk.path: .*a-file cannot be written"):
        LLM(tiny_engine_dir, device="cpu", warmup=False,
            kv_tiers={"disk": {"path": str(tmp_path / "a-file"), "size": "1MiB"}})
    assert loads == []


def test_serve_names_the_disk_flag_that_is_missing(tiny_engine_dir, tmp_path):
    from click.testing import CliRunner

    from trtpaged.cli import main

    for given, missing in ((["--kv-disk-path", str(tmp_path)], "--kv-disk-size"), (["--kv-disk-size", "1GiB"],
                                                                                   "--kv-disk-path")):  # fmt: skip
        r = CliRunner().invoke(main, ["serve", str(tiny_engine_dir), "--port", "0", *given])
        assert r.exit_code == 2 and f"{given[0]} needs {missing}" in r.output, r.output


@pytest.mark.parametrize("tiers, field", [({"host_memory": "1.5KB"}, "kv_tiers.host_memory"),
                                          ({"disk": {"path": "PATH", "size": 1}}, "kv_tiers.disk.size")])
def test_a_tier_too_small_for_one_block_is_refused_before_the_weights_load(tiny_engine_dir, tmp_path, monkeypatch,
                                                                           tiers, field):
    """Accepted before, and no block could ever be stored; then refused, but only once the model had loaded."""
    if "disk" in tiers:
        tiers = {"disk": {**tiers["disk"], "path": str(tmp_path)}}
    loads = []
    real_load = llm_module.load_runner
    monkeypatch.setattr(llm_module, "load_runner", lambda *a, **k: loads.append(1) or real_load(*a, **k))
    with pytest.raises(ValueError, match=f"^{field}: .* bytes hold no block; one block's entry is .* bytes"):
        LLM(tiny_engine_dir, device="cpu", warmup=False, kv_tiers=tiers)
    assert loads == []


def test_llm_refuses_tiers_without_prefix_caching(tiny_engine_dir):
    with pytest.raises(ValueError, match="kv_tiers: needs enable_prefix_caching"):
        LLM(tiny_engine_dir, device="cpu", enable_prefix_caching=False, kv_tiers={"host_memory": "1MiB"})


def test_llm_restart_finds_its_system_prompt_on_disk(tiny_engine_dir, tmp_path):
    system = list(range(40, 40 + 64))  # four full blocks
    prompts = [system + [7, 8, 9], system + [10, 11]]
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    tiers = {"disk": {"path": str(tmp_path), "size": "64MiB"}}
    with LLM(tiny_engine_dir, device="cpu", kv_tiers=tiers) as llm:
        first = [o.outputs[0].token_ids for o in llm.generate(prompts[:1], greedy)]
    with LLM(tiny_engine_dir, device="cpu", kv_tiers=tiers) as llm:  # close() above wrote the cache to disk
        again = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
        stats = llm.stats()
    with LLM(tiny_engine_dir, device="cpu") as plain:
        reference = [o.outputs[0].token_ids for o in plain.generate(prompts, greedy)]
    assert again == reference and first == reference[:1]
    assert stats["kv_tier_disk_hits"] == 4 and stats["prefix_cache_tier_hits_tokens"] == 64
    # no token of the system prompt is computed: the first prompt loads it, the second shares those blocks
    assert stats["num_tokens_computed"] == (3 + 3) + (2 + 3)


def _serve_multi_turn(engine_dir, tiers, spec=SPEC):
    handle = start_server(engine_dir, port=0, device="cpu", num_kv_blocks=SMALL_POOL, kv_tiers=tiers)
    try:
        report = asyncio.run(run_multi_turn(handle.url, spec, seed=3))
        metrics = httpx.get(handle.url + "/metrics").text
        pool_stats = handle.llm.stats()
    finally:
        handle.shutdown()
    return report, metrics, pool_stats


def test_server_with_host_tier_answers_multi_turn_traffic_as_without(tiny_engine_dir):
    off, _, _ = _serve_multi_turn(tiny_engine_dir, None)
    # staggered arrivals: other timing, the same conversations
    host, metrics, stats = _serve_multi_turn(tiny_engine_dir, {"host_memory": "8MiB"}, replace(SPEC, stagger=True))
    assert off["failed"] == host["failed"] == 0 and host["completed"] == SPEC.conversations * SPEC.turns
    assert host["replies"] == off["replies"]  # greedy: the tiers change what is computed, never the answer
    assert host["prefix_tier_hit_tokens"] > 0 and host["prefix_hit_rate"] > off["prefix_hit_rate"]
    assert host["prefill_tokens_computed"] < off["prefill_tokens_computed"]
    assert 'trtpaged:kv_tier_hits_total{tier="host"}' in metrics
    values = parse_prometheus(metrics)
    assert values["trtpaged:prefix_cache_tier_hits_total"] == stats["prefix_cache_tier_hits_tokens"] > 0
    assert stats["kv_blocks_used"] == 0  # every request finished: no block held
    assert stats["kv_blocks_free"] == SMALL_POOL and stats["kv_tier_staged_blocks"] == 0


def test_multi_turn_pauses_lockstep_and_staggered():
    lockstep = _pauses(SPEC, random.Random(1))
    assert lockstep == [[0.0] + [SPEC.think_time_s] * (SPEC.turns - 1)] * SPEC.conversations
    spec = replace(SPEC, stagger=True, think_time_s=2.0)
    pauses = _pauses(spec, random.Random(1))
    assert pauses == _pauses(spec, random.Random(1))  # seeded: every row of a run sees the same arrivals
    assert len(pauses) == spec.conversations and all(len(p) == spec.turns for p in pauses)
    assert all(0.0 <= p[0] <= 2.0 and all(1.0 <= t <= 3.0 for t in p[1:]) for p in pauses)
    assert len({p[0] for p in pauses}) == spec.conversations  # the first turns do not arrive together


def test_live_history_blocks_is_the_conversations_mean_history():
    report = {"completed": 6, "total_input_tokens": 6 * 100}
    assert live_history_blocks(report, SPEC, 16) == SPEC.conversations * (100 + SPEC.output_tokens) / 16


def test_tensor_parallel_restore_is_bit_identical_on_every_rank(tiny_kv4_engines, tmp_path):
    """2 ranks (gloo on loopback): an entry holds both ranks' shards; evicted, restored from disk, then read
    back from both ranks: the same bytes, and the greedy outputs equal the run without tiers."""
    from trtpaged.runtime.sequence import Sequence

    engine_dir = tiny_kv4_engines[2]
    prompts = [[(7 * i + 11 * j) % 250 + 3 for j in range(70)] for i in range(4)]
    traffic = prompts + [prompts[0]]
    greedy = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)

    def run(llm):
        return [llm.generate([p], greedy)[0].outputs[0].token_ids for p in traffic[:4]]

    with LLM(engine_dir, device="cpu", num_kv_blocks=12) as plain:
        reference = run(plain) + [plain.generate([traffic[4]], greedy)[0].outputs[0].token_ids]
    with LLM(engine_dir, device="cpu", num_kv_blocks=12,
             kv_tiers={"disk": {"path": str(tmp_path), "size": "64MiB"}}) as llm:
        kv, runner = llm.engine.kv, llm.engine.runner
        out = [llm.generate([traffic[0]], greedy)[0].outputs[0].token_ids]
        probe = Sequence(10**6, traffic[0])
        computed = runner.read_blocks([b.block_id for b in kv.find_cached_prefix(probe)])
        kv.free(probe)
        assert len(computed) == 4 and len(computed[0]) == 2 * runner.local.kv_cache[0].numel() * 4
        out += [llm.generate([p], greedy)[0].outputs[0].token_ids for p in traffic[1:4]]
        kv.tiers.flush()
        out.append(llm.generate([traffic[4]], greedy)[0].outputs[0].token_ids)
        probe = Sequence(10**6, traffic[0])
        restored = runner.read_blocks([b.block_id for b in kv.find_cached_prefix(probe)])
        kv.free(probe)
        stats = llm.stats()
    assert out == reference
    assert stats["kv_tier_disk_hits"] >= 4 and restored == computed

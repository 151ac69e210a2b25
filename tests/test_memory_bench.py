"""The memory benchmark's replays: exact accounting on small hand-checked workloads."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from trtpaged.bench.memory_bench import (Budget, format_memory_report, run_memory_bench, run_sharing_table,
                                         simulate_contiguous, simulate_paged)
from trtpaged.bench.workload import TraceRequest, load_trace, parse_range, synthetic_trace
from trtpaged.cli import main

THREE = [TraceRequest(prompt_len=8, output_len=4) for _ in range(3)]


def test_contiguous_reserve_max_fits_two_of_three() -> None:
    # 4 blocks x 16 = 64 slots, max_seq_len 32: two reservations fit, the third waits 4 steps.
    budget = Budget(num_kv_blocks=4, block_size=16, max_seq_len=32, max_batch_size=8, max_num_tokens=64)
    r = simulate_contiguous(THREE, budget, "max_seq_len")
    assert r.running == [2, 2, 2, 2, 1, 1, 1, 1]
    # tokens stored after each step: prompt + generated - 1 per sequence, over 32 slots each
    assert r.utilisation[:4] == [(2 * (8 + k)) / 64 for k in range(4)]


def test_contiguous_reserve_exact_fits_all() -> None:
    budget = Budget(num_kv_blocks=4, block_size=16, max_seq_len=32, max_batch_size=8, max_num_tokens=64)
    r = simulate_contiguous(THREE, budget, "exact")
    assert r.running == [3, 3, 3, 3]
    assert r.utilisation == [(3 * (8 + k)) / 36 for k in range(4)]


def test_paged_replay_uses_one_block_per_short_sequence() -> None:
    budget = Budget(num_kv_blocks=4, block_size=16, max_seq_len=32, max_batch_size=8, max_num_tokens=64)
    r = simulate_paged(THREE, budget, sharing=False)
    assert r.running == [3, 3, 3, 3]  # all admitted at once: 3 blocks of 4
    assert r.utilisation == [(3 * (8 + k)) / 48 for k in range(4)]
    assert r.preemptions == 0 and r.refused == 0


def test_sharing_stores_a_shared_prefix_once() -> None:
    # Two requests with the same 32-token prefix: with sharing its 2 full blocks are held once.
    trace = [TraceRequest(48, 2, prefix_id=0, prefix_len=32),
             TraceRequest(48, 2, arrival=1, prefix_id=0, prefix_len=32)]
    budget = Budget(num_kv_blocks=64, block_size=16, max_seq_len=128, max_batch_size=8, max_num_tokens=256)
    plain = simulate_paged(trace, budget, sharing=False)
    shared = simulate_paged(trace, budget, sharing=True)
    # step 1: request 0 holds 48 + 1 computed tokens in 4 blocks; request 1 computes its 48 prompt tokens.
    assert plain.utilisation[1] == pytest.approx((49 + 48) / ((4 + 3) * 16))
    assert shared.utilisation[1] == pytest.approx((49 + 48 - 32) / ((4 + 3 - 2) * 16))


def test_no_speed_up_is_shown_where_a_policy_refused_requests() -> None:
    """Reserving max_seq_len (64 slots) in a 32-slot pool refuses every request, so its steps are no baseline: the
    speed-up is None ('-'), not 0.00x; the mean-running ratio too."""
    budget = Budget(num_kv_blocks=2, block_size=16, max_seq_len=64, max_batch_size=8, max_num_tokens=64)
    report = run_memory_bench(THREE, budget)
    by_name = {p["policy"]: p for p in report["policies"]}
    assert by_name["contiguous, reserve max_seq_len"]["refused"] == 3 and by_name["paged"]["refused"] == 0
    assert all(p["speedup_in_steps_vs_reserve_max"] is None for p in report["policies"])
    assert "0.00x" not in format_memory_report(report)


def test_paged_beats_reservations_on_a_mixed_workload() -> None:
    trace = synthetic_trace(60, (16, 128), (8, 128), seed=1)
    budget = Budget(num_kv_blocks=64, block_size=16, max_seq_len=512, max_batch_size=64, max_num_tokens=512)
    report = run_memory_bench(trace, budget)
    by_name = {p["policy"]: p for p in report["policies"]}
    reserve_max = by_name["contiguous, reserve max_seq_len"]
    paged = by_name["paged"]
    assert paged["mean_running"] > 2 * reserve_max["mean_running"]
    assert paged["steps"] < reserve_max["steps"]
    assert paged["mean_utilisation"] > by_name["contiguous, reserve exact"]["mean_utilisation"]


def test_trace_errors_name_line_and_field(tmp_path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text('{"prompt_len": 10, "output_len": 5}\n{"prompt_len": 10, "output_len": 0}\n')
    with pytest.raises(ValueError, match=r"t.jsonl:2: output_len: must be >= 1"):
        load_trace(path)
    path.write_text('{"prompt_len": 10, "output_len": 5, "prompt": "x"}\n')
    with pytest.raises(ValueError, match=r":1: unknown field\(s\) \['prompt'\]"):
        load_trace(path)
    with pytest.raises(ValueError, match="--prompt-len"):
        parse_range("9:3", "--prompt-len")


def test_cli_replays_a_trace(tmp_path) -> None:
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(json.dumps({"prompt_len": 20 + i, "output_len": 10, "n": 2}) for i in range(5)))
    result = CliRunner().invoke(main, ["bench", "memory", "--trace", str(path), "--num-kv-blocks", "32", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output[result.output.index("{"):])
    assert report["sequences"] == 10
    assert [p["policy"] for p in report["policies"]] == [
        "contiguous, reserve max_seq_len", "contiguous, reserve exact", "paged", "paged + sharing"]  # fmt: skip


def test_time_weighting_counts_the_tokens_each_step_computes() -> None:
    budget = Budget(num_kv_blocks=4, block_size=16, max_seq_len=32, max_batch_size=8, max_num_tokens=64)
    r = simulate_contiguous(THREE, budget, "max_seq_len")
    # step 0: two 8-token prompts; steps 1-3: two decodes; step 4: the third prompt; then one decode each
    assert r.computed == [16, 2, 2, 2, 8, 1, 1, 1]
    assert r.time_weighted_running == pytest.approx((2 * 16 + 2 * 2 * 3 + 1 * 8 + 1 * 3) / 33)
    paged = simulate_paged(THREE, budget, sharing=False)
    assert paged.tokens_computed == 3 * (8 + 3)  # each prompt once, then 3 decode tokens (the 4th is never stored)


def test_recompute_preemption_costs_its_tokens_again() -> None:
    # 3 blocks of 16 for two sequences that each grow to 2 blocks: one is preempted and recomputed.
    trace = [TraceRequest(prompt_len=14, output_len=10) for _ in range(2)]
    budget = Budget(num_kv_blocks=3, block_size=16, max_seq_len=64, max_batch_size=8, max_num_tokens=64)
    r = simulate_paged(trace, budget, sharing=False)
    assert r.preemptions >= 1
    assert r.tokens_computed > 2 * (14 + 9)


def test_beam_search_shares_the_prompt_and_copies_on_write() -> None:
    # One request, 20-token prompt (blocks 16 + 4), beam width 2, 3 output tokens, block_size 16.
    # step 0: prefill, 2 blocks. After it the two beams share both blocks; at step 1 the first beam
    # to write into the shared half-full block copies it, the other writes in place: 3 blocks in use,
    # 4 without sharing (in the prefill too: two beams, each its own 2). Step 2 is the same whichever parents the
    # beams come from.
    trace = [TraceRequest(prompt_len=20, output_len=3, beam_width=2)]
    budget = Budget(num_kv_blocks=16, block_size=16, max_seq_len=64, max_batch_size=8, max_num_tokens=64)
    r = simulate_paged(trace, budget, sharing=True)
    assert r.blocks_with_sharing == [2, 3, 3]
    assert r.blocks_without_sharing == [4, 4, 4]
    assert r.sharing() == pytest.approx(
        {"memory_saved": 1 - 8 / 12, "blocks_with_sharing": 8 / 3, "blocks_without_sharing": 12 / 3})


def test_parallel_samples_share_the_full_prompt_block() -> None:
    # n = 3: after the prefill the samples share blocks [0, 1]; two copy the half-full block, one writes in place.
    trace = [TraceRequest(prompt_len=20, output_len=2, n=3)]
    budget = Budget(num_kv_blocks=16, block_size=16, max_seq_len=64, max_batch_size=8, max_num_tokens=64)
    r = simulate_paged(trace, budget, sharing=True)
    assert r.blocks_with_sharing == [2, 4]
    assert r.blocks_without_sharing == [6, 6]
    assert r.sharing()["memory_saved"] == pytest.approx(1 - 6 / 12)


def test_samples_and_beams_run_from_admission_in_every_replay() -> None:
    """A group's prompt is one sequence until its first sample forks it; the sharing replay counted it so in its
    prefill step, and diagnose said sharing cut concurrency (0.81x on n=4). Every replay runs the same 4 (and a beam
    search returning 2 of its 4 beams, as serve logs it, holds 4: it was counted 8, n x beam_width)."""
    budget = Budget(num_kv_blocks=64, block_size=16, max_seq_len=64, max_batch_size=8, max_num_tokens=256)
    for request in (TraceRequest(prompt_len=40, output_len=4, n=4), TraceRequest(40, 4, n=2, beam_width=4)):
        assert request.num_seqs == 4
        runs = [simulate_contiguous([request], budget, reserve="max_seq_len"), simulate_paged([request], budget, False),
                simulate_paged([request], budget, True)]
        assert [r.running for r in runs] == [[4] * 4] * 3, request


def test_blocks_without_sharing_are_what_the_replay_without_sharing_holds() -> None:
    """'Without sharing' is each sequence's own copy, from admission: in every step the sharing replay's count equals
    the blocks in use when the same requests run unshared (contention-free, so both run in lockstep). The prefill
    step counted one prompt for n samples (2 blocks where the unshared replay holds 4 for n = 2), so memory saved
    read 22% for a 20-token prompt, n = 2, 5 tokens (1 - 14/18) where it is 30% (1 - 14/20)."""
    budget = Budget(num_kv_blocks=64, block_size=16, max_seq_len=64, max_batch_size=8, max_num_tokens=512)
    for trace in ([TraceRequest(20, 5, n=2)], [TraceRequest(20, 3, beam_width=2)],
                  [TraceRequest(40, 4, n=2, beam_width=4)],
                  [TraceRequest(33, 6, n=3), TraceRequest(16, 4), TraceRequest(50, 5, beam_width=3)]):
        shared, plain = simulate_paged(trace, budget, True), simulate_paged(trace, budget, False)
        assert shared.blocks_without_sharing == plain.blocks_with_sharing, trace
    r = simulate_paged([TraceRequest(20, 5, n=2)], budget, True)
    # by hand: 2 samples x 2 blocks (20..24 tokens) every step; shared: 2 in the prefill, then 16 + 2 x (4 + 1)
    assert r.sharing()["memory_saved"] == pytest.approx(1 - (2 + 3 * 4) / (4 * 5))


def test_contiguous_copies_prompts_count_against_the_step_token_budget() -> None:
    """Without sharing every sample computes its own prompt (tokens computed counted 2 x 40), but the step budget
    was charged one: the contiguous replays computed 100 tokens in a step of max_num_tokens 64 (both requests'
    prefills at once), taking 3 steps where the same limits allow 4. By hand: step 0 the two copies' 80-token
    prefill, alone (over the budget, as if chunked); step 1 their decodes + the 20-token prompt; the copies' third
    token in step 2, the 20-token request's in step 3."""
    budget = Budget(num_kv_blocks=64, block_size=16, max_seq_len=128, max_batch_size=8, max_num_tokens=64)
    trace = [TraceRequest(40, 3, n=2), TraceRequest(20, 3)]
    for reserve in ("max_seq_len", "exact"):
        r = simulate_contiguous(trace, budget, reserve)
        assert r.computed == [80, 2 + 20, 3, 1] and r.running == [2, 3, 3, 1], reserve


def test_without_sharing_nothing_is_saved() -> None:
    trace = [TraceRequest(prompt_len=20, output_len=3, beam_width=2)]
    budget = Budget(num_kv_blocks=16, block_size=16, max_seq_len=64, max_batch_size=8, max_num_tokens=64)
    r = simulate_paged(trace, budget, sharing=False)
    assert r.running == [2, 2, 2]  # two independent copies
    assert r.sharing()["memory_saved"] == 0.0


def test_sharing_table_saves_more_with_wider_beams() -> None:
    trace = synthetic_trace(8, (40, 80), (20, 40), seed=2)
    budget = Budget(num_kv_blocks=512, block_size=16, max_seq_len=256, max_batch_size=64, max_num_tokens=512)
    rows = run_sharing_table(trace, budget, ns=(2, 4), widths=(2, 4))
    saved = {(r["kind"], r["width"]): r["memory_saved"] for r in rows}
    assert 0 < saved[("parallel", 2)] < saved[("parallel", 4)] < 1
    assert 0 < saved[("beam", 2)] < saved[("beam", 4)] < 1


def test_cli_beam_width_reports_sharing_and_plots(tmp_path) -> None:
    png = tmp_path / "m.png"
    result = CliRunner().invoke(main, ["bench", "memory", "--num-requests", "6", "--prompt-len", "20:40",
                                       "--output-len", "5:10", "--beam-width", "4", "--num-kv-blocks", "256",
                                       "--plot", str(png), "--json"])  # fmt: skip
    assert result.exit_code == 0, result.output
    report = json.loads(result.output[result.output.index("{"):])
    assert report["sequences"] == 24
    assert set(report["sharing"]) == {"memory_saved", "blocks_with_sharing", "blocks_without_sharing"}
    assert report["sharing"]["blocks_with_sharing"] < report["sharing"]["blocks_without_sharing"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_trace_type_errors_name_line_and_field(tmp_path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text('{"prompt_len": 10, "output_len": 5}\n\n{"prompt_len": 10, "output_len": 5, "beam_width": "4"}\n')
    with pytest.raises(ValueError, match=r"t.jsonl:3: beam_width: must be an integer"):
        load_trace(path)
    path.write_text('{"prompt_len": 10, "output_len": 5}\n[1, 2]\n')
    with pytest.raises(ValueError, match=r"t.jsonl:2: expected a JSON object"):
        load_trace(path)


# ---- bench memory --trace with --n / --beam-width: a line's own value wins, the flag fills the rest ------------
BIG = ["--num-kv-blocks", "4096", "--block-size", "16", "--max-seq-len", "512", "--max-batch-size", "256",
       "--max-num-tokens", "4096"]  # fmt: skip
LINES = [(54, 5), (97, 9), (33, 12), (16, 3), (60, 10)]  # (prompt_len, output_len): odd lengths, block edges crossed


def expected_blocks(lines: list[tuple[int, int, int]], bs: int = 16) -> tuple[float, float]:
    """Means over steps of blocks in use with and without sharing, from the block math alone, for requests
    (prompt_len P, output_len O, n) that all arrive at step 0 into a budget that holds them all.

    Step 0 prefills each prompt: ceil(P / bs) blocks. The first sample forks n sequences that share the
    prompt's P // bs full blocks; from step k = 1 on each sample writes position P + k - 1, so it holds
    ceil((P + k) / bs) - P // bs blocks of its own (the shared partial block is copied on its first write).
    The request samples its O-th token in step O - 1 and is freed after it. Without sharing every sequence's
    table counts in full, the n samples' prompts in step 0 too: n * ceil((P + k) / bs) for k from 0.
    """
    steps = max(o for _, o, _ in lines)
    with_, without = 0, 0
    for p, o, n in lines:
        with_ += -(-p // bs) + sum(p // bs + n * (-(-(p + k) // bs) - p // bs) for k in range(1, o))
        without += sum(n * -(-(p + k) // bs) for k in range(0, o))
    return with_ / steps, without / steps


def _memory_report(tmp_path, rows, *flags):
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    result = CliRunner().invoke(main, ["bench", "memory", "--trace", str(path), *BIG, *flags, "--json"])
    return result, (json.loads(result.output[result.output.index("{"):]) if result.exit_code == 0 else None)


def test_trace_with_n_flag_shares_as_the_block_math_says(tmp_path) -> None:
    rows = [{"prompt_len": p, "output_len": o} for p, o in LINES]
    _, plain = _memory_report(tmp_path, rows)
    result, four = _memory_report(tmp_path, rows, "--n", "4")
    assert result.exit_code == 0, result.output
    assert "--n 4: set on 5 of 5 trace lines" in result.output
    assert four["sequences"] == 20 and plain["sequences"] == 5
    for report, n in ((plain, 1), (four, 4)):
        with_, without = expected_blocks([(p, o, n) for p, o in LINES])
        assert report["sharing"]["blocks_with_sharing"] == pytest.approx(with_)
        assert report["sharing"]["blocks_without_sharing"] == pytest.approx(without)
        assert report["sharing"]["memory_saved"] == pytest.approx(1 - with_ / without)
    assert plain["sharing"]["memory_saved"] == 0.0 < four["sharing"]["memory_saved"]


def test_a_lines_own_n_wins_over_the_flag(tmp_path) -> None:
    rows = [{"prompt_len": p, "output_len": o, **({"n": 2} if i < 2 else {})} for i, (p, o) in enumerate(LINES)]
    result, report = _memory_report(tmp_path, rows, "--n", "4")
    assert result.exit_code == 0, result.output
    assert "--n 4: set on 3 of 5 trace lines; 2 give their own n or beam_width" in result.output
    ns = [2, 2, 4, 4, 4]
    with_, without = expected_blocks([(p, o, n) for (p, o), n in zip(LINES, ns)])
    assert report["sequences"] == sum(ns)
    assert report["sharing"]["blocks_with_sharing"] == pytest.approx(with_)
    assert report["sharing"]["blocks_without_sharing"] == pytest.approx(without)


def test_beam_width_flag_fills_lines_like_a_beam_trace(tmp_path) -> None:
    rows = [{"prompt_len": p, "output_len": o} for p, o in LINES]
    rows[0]["n"] = 3  # keeps its parallel sampling
    result, report = _memory_report(tmp_path, rows, "--beam-width", "3")
    assert result.exit_code == 0, result.output
    # the same trace written with beam_width on the lines the flag fills
    explicit = [TraceRequest(p, o, n=3) if i == 0 else TraceRequest(p, o, beam_width=3)
                for i, (p, o) in enumerate(LINES)]
    budget = Budget(num_kv_blocks=4096, block_size=16, max_seq_len=512, max_batch_size=256, max_num_tokens=4096)
    assert report["sharing"] == pytest.approx(simulate_paged(explicit, budget, sharing=True).sharing())
    assert report["sequences"] == 3 * 5


def test_flags_that_cannot_apply_to_a_trace_are_errors(tmp_path) -> None:
    own = [{"prompt_len": p, "output_len": o, "n": 1} for p, o in LINES]
    result, _ = _memory_report(tmp_path, own, "--n", "4")
    assert result.exit_code != 0 and "--n: every line of" in result.output and "would change nothing" in result.output
    rows = [{"prompt_len": p, "output_len": o} for p, o in LINES]
    result, _ = _memory_report(tmp_path, rows, "--n", "4", "--beam-width", "2")
    assert result.exit_code != 0 and "--n, --beam-width: give one of them with --trace" in result.output
    result, _ = _memory_report(tmp_path, rows, "--num-requests", "50", "--prompt-len", "8")
    assert result.exit_code != 0 and "--num-requests, --prompt-len: synthetic workload options" in result.output
    result, _ = _memory_report(tmp_path, rows, "--n", "0")
    assert result.exit_code != 0 and "--n" in result.output


def test_kv_tier_what_if_reaches_an_unbounded_pool_s_hits() -> None:
    """Requests one after another, four system prompts of 4 blocks each taking turns: a pool of 8 blocks
    forgets each prompt before it comes back; an unbounded tier below it must find every prompt again, so
    its prefix hits equal those of a pool with room for everything (the independent truth)."""
    from trtpaged.bench.memory_bench import format_tier_table, parse_tier_blocks, run_tier_what_if

    trace = [TraceRequest(prompt_len=80, output_len=4, arrival=10 * i, prefix_id=i % 4, prefix_len=64)
             for i in range(12)]  # fmt: skip
    small = Budget(num_kv_blocks=8, block_size=16, max_seq_len=128, max_batch_size=4, max_num_tokens=128)
    big = Budget(num_kv_blocks=512, block_size=16, max_seq_len=128, max_batch_size=4, max_num_tokens=128)
    rows = run_tier_what_if(trace, small, parse_tier_blocks("4,unbounded"))
    alone, four, unbounded = rows
    everything = simulate_paged(trace, big, sharing=True)
    assert everything.prefix_hit_tokens == 8 * 64  # each prompt's 2nd and 3rd turn find its 4 blocks
    assert alone["prefix_hit_tokens"] == 0 and alone["tier_hit_tokens"] == 0
    assert unbounded["prefix_hit_tokens"] == unbounded["tier_hit_tokens"] == everything.prefix_hit_tokens
    assert alone["tokens_computed"] - unbounded["tokens_computed"] == 8 * 64
    # pool + a 4-block tier hold fewer than the 4 prompts in rotation: LRU on a cyclic pattern keeps the wrong ones
    assert four["tier_hit_tokens"] == 0 and four["tokens_computed"] == alone["tokens_computed"]
    assert "| unbounded | 53.3% | 512 |" in format_tier_table(rows, small.num_kv_blocks)  # 512 of 12 x 80 tokens
    with pytest.raises(ValueError, match="--kv-tier-blocks: block counts must be from 1 to 1099511627776"):
        parse_tier_blocks("4,0")
    with pytest.raises(ValueError, match="--kv-tier-blocks: block counts must be from 1 to 1099511627776 .* got 1{27}"):
        parse_tier_blocks("1" * 40)
    with pytest.raises(ValueError, match="--kv-tier-blocks: at most 16 sizes .* got 17"):
        parse_tier_blocks(",".join(["8"] * 17))  # 3000 sizes were 3000 replays of the trace


def test_idle_steps_between_arrivals_count_in_no_replay() -> None:
    # The same request twice, 1000 steps apart: every policy computes for 2 x 10 steps, one sequence running.
    # Before, the contiguous replays counted the 990 idle steps (the paged ones never did): paged "50x faster".
    budget = Budget(num_kv_blocks=64, block_size=16, max_seq_len=512, max_batch_size=8, max_num_tokens=256)
    report = run_memory_bench([TraceRequest(20, 10), TraceRequest(20, 10, arrival=1000)], budget)
    for p in report["policies"]:
        assert (p["steps"], p["mean_running"], p["speedup_in_steps_vs_reserve_max"]) == (20, 1.0, 1.0), p


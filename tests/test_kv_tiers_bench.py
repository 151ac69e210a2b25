"""`bench kv-tiers`' checks before any server starts: the rows, and turns that no pool of --num-kv-blocks (or no
max_seq_len) could ever run, counted on the very prompts the multi-turn client sends."""

from __future__ import annotations

import asyncio

import pytest

import trtpaged.bench.multi_turn as multi_turn
from trtpaged.bench.kv_tiers_bench import check_rows, check_turns_fit, conversation_prompts
from trtpaged.bench.multi_turn import MultiTurnSpec
from trtpaged.bench.serve_bench import RequestResult

SPEC = MultiTurnSpec(conversations=3, turns=3, system_words=8, user_words=4, output_tokens=4, think_time_s=0.0)


@pytest.mark.parametrize("seed, variant", [(0, 0), (5, 1)])
def test_the_prompts_checked_are_the_ones_run_multi_turn_sends(monkeypatch, seed, variant):
    """conversation_prompts replays run_multi_turn's draws: with empty replies, the same texts, turn by turn."""
    sent: list[str] = []

    async def one(client, url, body, headers):
        sent.append(body["prompt"])
        return RequestResult(ok=True, text="")

    async def scrape(client, base_url):
        return {}

    monkeypatch.setattr(multi_turn, "_one", one)
    monkeypatch.setattr(multi_turn, "_scrape", scrape)
    asyncio.run(multi_turn.run_multi_turn("http://127.0.0.1:1", SPEC, seed=seed, variant=variant))
    expected = conversation_prompts(SPEC, seed, variant)
    assert sorted(sent) == sorted(text for texts in expected for text in texts)
    assert len(sent) == SPEC.conversations * SPEC.turns


def test_rows_are_named_once_each():
    assert check_rows(["off", " host"]) == ["off", "host"]
    for rows, words in ((["host", "host"], "host given more than once"), (["off", ""], "an empty name"),
                        (["hots"], "unknown hots")):
        with pytest.raises(ValueError, match="--rows: " + words):
            check_rows(rows)


def test_turns_that_fit_pass_and_the_refusal_names_what_to_change(tiny_engine_dir):
    check_turns_fit(tiny_engine_dir, SPEC, num_kv_blocks=64, seeds=[0], variants=(0, 1))
    with pytest.raises(ValueError, match=r"--num-kv-blocks 2: the pool holds 32 tokens .* give at least \d+ blocks"):
        check_turns_fit(tiny_engine_dir, SPEC, num_kv_blocks=2, seeds=[0])
    long = MultiTurnSpec(conversations=1, turns=4, system_words=64, user_words=24, output_tokens=16)
    with pytest.raises(ValueError, match="more than the engine's max_seq_len 512"):
        check_turns_fit(tiny_engine_dir, long, num_kv_blocks=256, seeds=[0])
    # a last turn whose lower bound fits but whose estimate (each earlier reply output_tokens long) does not: a warning
    from trtpaged.manifest import read_manifest
    from trtpaged.runtime.llm import load_tokenizer

    tokenizer = load_tokenizer(tiny_engine_dir, read_manifest(tiny_engine_dir))
    last = max(len(tokenizer.encode(texts[-1])) for texts in conversation_prompts(SPEC, 0, 0))
    blocks = -(-(last + SPEC.output_tokens) // 16)
    assert last + SPEC.turns * SPEC.output_tokens > 16 * blocks  # the case holds
    warned: list[str] = []
    check_turns_fit(tiny_engine_dir, SPEC, num_kv_blocks=blocks, seeds=[0], say=warned.append)
    assert len(warned) == 1 and "will likely fail" in warned[0], warned


def test_a_row_in_which_no_turn_completed_exits_1(monkeypatch, tiny_engine_dir):
    """A run whose every turn failed printed a table of zeros and exited 0."""
    from click.testing import CliRunner

    import trtpaged.bench.kv_tiers_bench as bench
    from trtpaged.cli import main

    rows = {"off": {"completed": 8, "failed": 0}, "host": {"completed": 0, "failed": 8,
                                                           "error_examples": ["HTTP 400: too long"]}}
    report = {"engine": str(tiny_engine_dir), "num_kv_blocks": 16, "conversations": 2, "turns": 4,
              "think_time_s": 0.0, "stagger": False, "rounds": 1, "rows": rows}
    monkeypatch.setattr(bench, "run_kv_tiers_bench", lambda *args, **kwargs: report)
    r = CliRunner().invoke(main, ["bench", "kv-tiers", str(tiny_engine_dir), "--num-kv-blocks", "16"])
    assert r.exit_code == 1, r.output
    assert "| host (8 failed) |" in r.output  # the report is printed first
    assert r.output.strip().splitlines()[-1] == "Error: no turn completed in row host (first error: HTTP 400: too long)"


@pytest.mark.parametrize("rounds", [1, 2])
def test_the_ttft_ratios_come_with_their_rounds_spread_and_the_run_s_load(tiny_engine_dir, rounds):
    """'TTFT p50 vs off' was printed with no spread and no noise line (a tiny engine's host row, the same work as
    off, showed 1.47x in one run); the report now carries the rounds' ratios, their spread and the run's load, and
    a noisy run's or a single round's ratios are printed as indicative only."""
    from trtpaged.bench.kv_tiers_bench import format_kv_tiers, run_kv_tiers_bench
    from trtpaged.bench.noise import spread

    report = run_kv_tiers_bench(tiny_engine_dir, SPEC, 24, rounds=rounds, rows=["host"])
    off, host = report["rows"]["off"]["rounds"], report["rows"]["host"]["rounds"]
    ratios = [a["p50_ttft_ms"] / b["p50_ttft_ms"] for a, b in zip(off, host)]  # round by round, from the rows
    assert report["rows"]["host"]["ttft_p50_vs_off_rounds"] == pytest.approx(ratios)
    noise = report["noise"]
    assert noise["max_spread"] == (None if rounds == 1 else pytest.approx(spread(ratios)))
    text = format_kv_tiers(report)
    assert "noise: worst spread " in text
    indicative = "TTFT p50 vs off: indicative only" in text
    assert indicative == (rounds == 1 or not noise["trustworthy"]), text


def test_a_run_of_several_rounds_is_not_called_one_round(tiny_engine_dir):
    """With --rounds 2 and no row beside off (nothing to take a ratio's spread of), a quiet run's ratios were
    'indicative only (one round, whose spread is unknown: --rounds 3 or more)': it had run two."""
    from trtpaged.bench.kv_tiers_bench import format_kv_tiers, run_kv_tiers_bench
    from trtpaged.bench.noise import assess

    report = run_kv_tiers_bench(tiny_engine_dir, SPEC, 24, rounds=2, rows=["off"])
    assert report["rounds"] == 2 and len(report["rows"]["off"]["rounds"]) == 2 and report["noise"]["max_spread"] is None
    quiet = dict(report, noise=assess(None, 0.0, cpus=2).to_dict())  # this run's figures, a quiet machine's load
    text = format_kv_tiers(quiet)
    assert "one round" not in text and "TTFT p50 vs off: indicative only (no row beside off has two rounds" in text

"""`trtpaged bench kv-tiers ENGINE`: the same multi-turn traffic against servers with and without KV tiers.

One run, one engine, one small pool (`--num-kv-blocks`; a first row has the engine's whole budget: the hit rate
an unbounded cache would reach), servers started in this process one after
another (loopback, the official HTTP path): tiers off, host memory, local disk, a restart on that
disk (new conversations under the same system prompt), Redis, and a second replica on that Redis
(the first one's conversations again, with an empty pool). Each row: TTFT p50/p99, prompt tokens
computed, prefix hit rate, tokens restored from a tier, throughput, and whether every greedy reply
equals the tiers-off run's.
"""

from __future__ import annotations

import asyncio
import secrets
import shutil
import statistics
import tempfile
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from trtpaged.bench.multi_turn import MultiTurnSpec, conversation_words, request_body, run_multi_turn
from trtpaged.bench.noise import Noise, NoiseMonitor
from trtpaged.bench.redis_process import RedisProcess

ROW_GROUPS = ("unbounded", "off", "host", "disk", "remote")
COLUMNS = (("p50_ttft_ms", "TTFT p50 ms", "{:.0f}"), ("p99_ttft_ms", "TTFT p99 ms", "{:.0f}"),
           ("prefill_tokens_computed", "prefill computed", "{}"), ("prefix_hit_rate", "hit rate", "{:.2f}"),
           ("prefix_tier_hit_tokens", "tier-hit tokens", "{}"),
           ("first_turn_mean_ttft_ms", "1st-turn TTFT ms", "{:.0f}"),
           ("request_throughput", "req/s", "{:.2f}"), ("ttft_p50_vs_off", "TTFT p50 vs off", "{:.2f}x"),
           ("same_replies", "replies = off", "{}"))  # fmt: skip


def _warm_up(url: str) -> None:
    """One short request on words the conversations never use: first-request costs stay out of the figures."""
    import httpx

    body = {"prompt": "zebra quartz " * 8, "max_tokens": 2, "temperature": 0.0}
    httpx.post(url.rstrip("/") + "/v1/completions", json=body, timeout=600.0).raise_for_status()


def run_kv_tiers_bench(
    engine: Path, spec: MultiTurnSpec, num_kv_blocks: int, host_memory: str | int = "1GiB",
    disk_size: str | int = "4GiB",
    remote: Optional[str] = None, llm_kwargs: Optional[dict[str, Any]] = None, seed: int = 0, rounds: int = 1,
    progress: Optional[Callable[[str], None]] = None, rows: Optional[Sequence[str]] = None,
) -> dict[str, Any]:  # fmt: skip
    """Runs every row (remote rows when `remote` is given or redis-server is installed; only the groups named
    in `rows`, among ROW_GROUPS, when given; "off" always) `rounds` times; returns the report.

    Rows that depend on each other run together as a group (disk then its restart, Redis then the second
    replica). Round r uses seed + r (other conversations: nothing cached in one round helps another), a
    fresh disk directory, and the groups rotated by r, so that each row runs early and late on a machine
    whose load drifts; times are the median over rounds, token counts the sum.
    """
    say = progress or (lambda _msg: None)
    wanted = set(check_rows(rows) if rows is not None else ROW_GROUPS) | {"off"}
    if "remote" not in wanted:
        remote = ""
    # refused before any server starts: a size or a pool the run can never use failed after whole rows had run
    check_tier_sizes(engine, host_memory if "host" in wanted else None, disk_size if "disk" in wanted else None)
    check_turns_fit(engine, spec, num_kv_blocks, seeds=[seed + r for r in range(min(rounds, CHECKED_ROUNDS))],
                    variants=(0, 1) if "disk" in wanted else (0,), say=say)
    runs: dict[str, list[dict[str, Any]]] = {}
    # every request of this run carries one salt: a Redis given with --remote may hold an earlier run's blocks,
    # which would make the "remote" row (a cold first replica) warm; the second replica still finds the first's
    salt = f"bench-{secrets.token_hex(8)}"
    redis = None
    monitor = NoiseMonitor().start()  # the servers run in this process, redis-server is its child: both ours
    try:
        if remote is None and shutil.which("redis-server"):  # "": no remote rows
            redis = RedisProcess()
            remote = redis.url
        for r in range(rounds):
            disk_dir = Path(tempfile.mkdtemp(prefix="trtpaged-kv-disk-"))
            try:
                disk = {"path": str(disk_dir), "size": disk_size}
                named: dict[str, list[tuple[str, Optional[dict[str, Any]], int]]] = {
                    "unbounded": [("off, unbounded pool", None, 0)], "off": [("off", None, 0)],
                    "host": [("host", {"host_memory": host_memory}, 0)],
                    "disk": [("disk", {"disk": disk}, 0), ("disk, restarted", {"disk": disk}, 1)],
                }
                if remote:
                    named["remote"] = [("remote", {"remote": remote}, 0),
                                       ("remote, 2nd replica", {"remote": remote}, 0)]  # fmt: skip
                groups = [group for name, group in named.items() if name in wanted]
                for group in groups[r % len(groups):] + groups[:r % len(groups)]:
                    for name, tiers, variant in group:
                        report = _run_row(engine, spec, num_kv_blocks, name, tiers, seed + r, variant, llm_kwargs,
                                          say, salt)  # fmt: skip
                        runs.setdefault(name, []).append(report)
            finally:
                shutil.rmtree(disk_dir, ignore_errors=True)
    finally:
        if redis is not None:
            redis.kill()
    monitor.stop()
    rows = {name: _combine(name, runs[name], runs["off"]) for name in runs}
    for name, row in rows.items():  # the TTFT ratios' rounds: their spread is the run's (one round: unmeasured)
        if name != "off":
            monitor.add_samples([r for r in row["ttft_p50_vs_off_rounds"] if r])
    return {"engine": str(engine), "num_kv_blocks": num_kv_blocks, "conversations": spec.conversations,
            "turns": spec.turns, "think_time_s": spec.think_time_s, "stagger": spec.stagger, "rounds": rounds,
            "rows": rows, "noise": monitor.result().to_dict()}


def check_rows(rows: Sequence[str]) -> list[str]:
    """`--rows` as given (each once, among ROW_GROUPS); ValueError naming the flag. A name given twice was run
    once without a word (each row runs once per round; --rounds repeats them)."""
    rows = [r.strip() for r in rows]
    if "" in rows:
        raise ValueError(f"--rows: an empty name in {','.join(rows)!r}; expected some of {', '.join(ROW_GROUPS)}, "
                         "comma-separated")
    unknown = sorted(set(rows) - set(ROW_GROUPS))
    if unknown:
        raise ValueError(f"--rows: unknown {', '.join(unknown)}; expected some of {', '.join(ROW_GROUPS)}")
    twice = sorted({r for r in rows if rows.count(r) > 1}, key=ROW_GROUPS.index)
    if twice:
        raise ValueError(f"--rows: {', '.join(twice)} given more than once; each row runs once a round (--rounds N "
                         "repeats every row)")
    return rows


def check_tier_sizes(engine: Path, host_memory: Any, disk_size: Any) -> None:
    """Refuses (ValueError naming --host-memory or --disk-size) a tier size that is no size or holds no block of
    this engine, as a server with that tier would, before any row runs (None: that row does not run)."""
    from trtpaged.config import parse_size
    from trtpaged.manifest import read_manifest
    from trtpaged.runtime.kv_tiers.entry import entry_bytes

    manifest = read_manifest(engine)
    one = entry_bytes(manifest.limits.block_size, manifest.tensor_parallel * manifest.kv_bytes_per_block_per_rank)
    for flag, value in (("--host-memory", host_memory), ("--disk-size", disk_size)):
        if value is None:
            continue
        try:
            size = parse_size(value)
        except ValueError as exc:
            raise ValueError(f"{flag}: {exc}") from None
        if size < one:
            raise ValueError(f"{flag}: {size} bytes hold no block; one block's entry is {one} bytes")


CHECKED_ROUNDS = 4  # rounds whose conversations check_turns_fit tokenizes (later ones: other words, same counts)


def conversation_prompts(spec: MultiTurnSpec, seed: int, variant: int) -> list[list[str]]:
    """Each conversation's prompt text at each turn as `run_multi_turn` sends it (plain text), with every earlier
    reply empty: the replies are not known before the run, so each is a lower bound of the prompt it stands for."""
    system, users = conversation_words(spec, seed, variant)
    prompts = []
    for conversation in users:
        history = [{"role": "system", "content": system}] if system else []
        texts = []
        for user in conversation:
            history.append({"role": "user", "content": user})
            texts.append(request_body(history, spec, None, False)["prompt"])
            history.append({"role": "assistant", "content": ""})
        prompts.append(texts)
    return prompts


def check_turns_fit(engine: Path, spec: MultiTurnSpec, num_kv_blocks: int, seeds: Sequence[int],
                    variants: Sequence[int] = (0,), say: Callable[[str], None] = lambda _msg: None) -> None:
    """Refuses (ValueError naming the flags) traffic of which some turn can never run: its prompt and reply need
    more tokens than the pool of `num_kv_blocks` holds or max_seq_len allows. Such turns failed in every row (HTTP
    400: the prompt needs more blocks than the whole pool), a whole run of them a table of zeros. A turn's prompt
    is counted with its history's replies empty (a lower bound: the refusal is certain); when the estimate with
    each reply `output_tokens` long passes the limit, `say` warns that those turns will likely fail."""
    from trtpaged.manifest import read_manifest
    from trtpaged.runtime.llm import load_tokenizer

    manifest = read_manifest(engine)
    tokenizer = load_tokenizer(engine, manifest)
    block_size, max_seq_len = manifest.limits.block_size, manifest.limits.max_seq_len
    pool_tokens = num_kv_blocks * block_size
    longest = [0] * spec.turns  # per turn: the longest prompt (replies empty) of any conversation, seed, variant
    for seed in seeds:
        for variant in variants:
            for texts in conversation_prompts(spec, seed, variant):
                for turn, text in enumerate(texts):
                    longest[turn] = max(longest[turn], len(tokenizer.encode(text)))
    out = spec.output_tokens
    needs = [prompt + out for prompt in longest]  # prompt + this turn's reply (the history's replies not counted)

    def what(turn: int) -> str:
        text = (f"turn 1's prompt has {longest[0]} tokens" if turn == 0 else
                f"turn {turn + 1}'s prompt (the history of {turn} turn{'s' if turn > 1 else ''} before it) has at "
                f"least {longest[turn]} tokens")
        return (f"{text}, {needs[turn]} with its reply (--system-words {spec.system_words}, --user-words "
                f"{spec.user_words}, --output-len {out})")

    fix = "fewer words, fewer turns (--multi-turn N:K) or a shorter --output-len"
    over = [turn for turn, need in enumerate(needs) if need > max_seq_len]
    if over:  # no pool helps: the engine's limit
        raise ValueError(f"{what(over[0])}: more than the engine's max_seq_len {max_seq_len}, so that turn fails in "
                         f"every row; use {fix}")
    over = [turn for turn, need in enumerate(needs) if need > pool_tokens]
    if over:
        blocks = -(-max(needs) // block_size)
        raise ValueError(f"--num-kv-blocks {num_kv_blocks}: the pool holds {pool_tokens} tokens ({num_kv_blocks} "
                         f"blocks of {block_size}) and {what(over[0])}, so that turn fails in every row (the prompt "
                         f"needs more blocks than the whole pool); give at least {blocks} blocks, or {fix}")
    estimate = longest[-1] + spec.turns * out  # the last turn with every reply `out` tokens long
    room, bound = min((pool_tokens, "the pool"), (max_seq_len, "max_seq_len"))
    if estimate > room:
        say(f"warning: turn {spec.turns}'s prompt and reply come to about {estimate} tokens with the replies before "
            f"it, more than {bound} ({room} tokens): such turns will likely fail in every row")


def _run_row(engine: Path, spec: MultiTurnSpec, num_kv_blocks: int, name: str, tiers: Optional[dict[str, Any]],
             seed: int, variant: int, llm_kwargs: Optional[dict[str, Any]], say: Callable[[str], None],
             cache_salt: Optional[str] = None) -> dict:
    from trtpaged.server import start_server

    blocks = None if name == "off, unbounded pool" else num_kv_blocks  # None: the engine's whole budget
    say(f"{name}: starting a server ({blocks or 'all'} KV blocks, seed {seed})")
    handle = start_server(engine, port=0, num_kv_blocks=blocks, kv_tiers=tiers, **(llm_kwargs or {}))
    try:
        _warm_up(handle.url)
        skip = len(handle.loop.call(lambda e: e.ttft_breakdown()))  # the warm-up's
        report = asyncio.run(run_multi_turn(handle.url, spec, seed=seed, variant=variant, cache_salt=cache_salt))
        report["ttft_breakdown"] = summarize_ttft(handle.loop.call(lambda e: e.ttft_breakdown())[skip:])
        report["live_history_blocks"] = live_history_blocks(report, spec, handle.llm.config.block_size)
    finally:
        handle.shutdown()  # flushes the pool's cached prefixes to the tiers
    say(f"{name}: {report['completed']} turns ({report['failed']} failed), TTFT p50/p99 "
        f"{report['p50_ttft_ms']:.0f}/{report['p99_ttft_ms']:.0f} ms, prefill computed "
        f"{report['prefill_tokens_computed']}, hit rate {report['prefix_hit_rate']}, tier-hit tokens "
        f"{report['prefix_tier_hit_tokens']}")
    return report


def live_history_blocks(report: dict[str, Any], spec: MultiTurnSpec, block_size: int) -> float:
    """KV blocks of every conversation's history (its last prompt and reply) at a mean turn: the mean prompt
    plus a reply, in blocks, times the conversations. The pool's share of the live histories is the pool's
    blocks over this."""
    if not report.get("completed"):
        return 0.0
    mean_prompt = report["total_input_tokens"] / report["completed"]
    return spec.conversations * (mean_prompt + spec.output_tokens) / block_size


BREAKDOWN = (("ttft_ms", "server TTFT"), ("submit_wait_ms", "until the engine takes it"), ("tier_wait_ms", "tier wait"),
             ("admission_wait_ms", "admission wait"),
             ("prefill_ms", "prefill"), ("own_compute_ms", "own tokens' share"), ("computed_tokens", "tokens computed"),
             ("shared_tokens", "others' tokens in its steps"), ("prefill_steps", "steps"))  # fmt: skip


def summarize_ttft(records: list[dict[str, float]]) -> dict[str, float]:
    """Medians over requests of `LLMEngine.ttft_breakdown` (ms; tokens; steps). `own_compute_ms`: the part of
    its prefill steps' time that its own prompt tokens account for, pro rata of the steps' tokens."""
    if not records:
        return {}
    def med(fn: Callable[[dict[str, float]], float]) -> float:
        return statistics.median(fn(r) for r in records)

    def own(r: dict[str, float]) -> float:
        computed = r["prompt_tokens"] - r["cached_tokens"]
        return 1000.0 * r["prefill_step_s"] * computed / max(1.0, computed + r["shared_tokens"])

    return {"ttft_ms": med(lambda r: 1000.0 * r["ttft_s"]), "tier_wait_ms": med(lambda r: 1000.0 * r["tier_wait_s"]),
            "submit_wait_ms": med(lambda r: 1000.0 * r.get("submit_wait_s", 0.0)),
            "admission_wait_ms": med(lambda r: 1000.0 * r["admission_wait_s"]),
            "prefill_ms": med(lambda r: 1000.0 * r["prefill_s"]), "own_compute_ms": med(own),
            "computed_tokens": med(lambda r: r["prompt_tokens"] - r["cached_tokens"]),
            "shared_tokens": med(lambda r: r["shared_tokens"]), "prefill_steps": med(lambda r: r["prefill_steps"])}


def _combine(name: str, runs: list[dict[str, Any]], off: list[dict[str, Any]]) -> dict[str, Any]:
    """One row from its rounds: medians of times, sums of tokens, and whether every reply equals tiers-off's."""
    row: dict[str, Any] = {}
    for key in ("p50_ttft_ms", "p99_ttft_ms", "first_turn_mean_ttft_ms", "request_throughput"):
        row[key] = statistics.median(run[key] for run in runs)
    parts = [run["ttft_breakdown"] for run in runs if run.get("ttft_breakdown")]
    row["ttft_breakdown"] = {k: statistics.median(p[k] for p in parts) for k, _ in BREAKDOWN} if parts else {}
    for key in ("prefill_tokens_computed", "prefix_tier_hit_tokens", "failed", "completed"):
        values = [run[key] for run in runs]
        row[key] = None if None in values else sum(values)
    row["error_examples"] = sorted({e for run in runs for e in run.get("error_examples", [])})[:3]
    row["live_history_blocks"] = statistics.median(run.get("live_history_blocks", 0.0) for run in runs)
    row["ttft_p50_vs_off_rounds"] = [ref["p50_ttft_ms"] / run["p50_ttft_ms"] if run["p50_ttft_ms"] else 0.0
                                     for run, ref in zip(runs, off)]  # round by round  # fmt: skip
    row["ttft_p50_vs_off"] = statistics.median(row["ttft_p50_vs_off_rounds"])
    rates = [run["prefix_hit_rate"] for run in runs]
    row["prefix_hit_rate"] = None if None in rates else statistics.mean(rates)
    # the restarted server runs other conversations: nothing to compare
    same = all(run["replies"] == ref["replies"] for run, ref in zip(runs, off))
    row["same_replies"] = "-" if name == "disk, restarted" else ("yes" if same else "NO")
    row["rounds"] = [{k: v for k, v in run.items() if k != "replies"} for run in runs]
    return row


def format_kv_tiers(report: dict[str, Any]) -> str:
    """The rows as a markdown table."""
    head = ["tiers"] + [title for _, title, _ in COLUMNS]
    live = (report["rows"].get("off") or {}).get("live_history_blocks") or 0.0
    share = report["num_kv_blocks"] / live if live else 0.0
    lines = [f"{report['conversations']} conversations x {report['turns']} turns, think time "
             f"{report['think_time_s']} s, pool of {report['num_kv_blocks']} blocks ({report['engine']}); "
             f"{report['rounds']} rounds: times are medians, token counts sums; "
             f"{'staggered' if report.get('stagger') else 'lockstep'} conversations; live histories at a mean turn "
             f"{live:.0f} blocks: the pool holds {share:.0%} of them", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, row in report["rows"].items():
        cells = [name] + ["n/a" if row.get(key) is None else fmt.format(row[key]) for key, _, fmt in COLUMNS]
        if row.get("failed"):
            cells[0] += f" ({row['failed']} failed)"
        lines.append("| " + " | ".join(cells) + " |")
    if "noise" in report:
        noise = Noise(**report["noise"])
        lines += ["", noise.describe()]
        if not noise.trustworthy or noise.max_spread is None:
            why = ("a noisy run" if not noise.trustworthy else
                   "one round, whose spread is unknown: --rounds 3 or more" if report["rounds"] == 1 else
                   "no row beside off has two rounds' ratios to compare: their spread is unknown")  # fmt: skip
            lines.append(f"TTFT p50 vs off: indicative only ({why})")
    lines += ["", "TTFT from the server's side (the request submitted to its first token; the client's TTFT adds HTTP "
              "and tokenizing), medians over requests, each column on its own (ms, tokens; `own tokens' share`: the "
              "prefill steps' time pro rata of the request's own computed tokens, the rest is other requests' tokens "
              "in those steps)",
              "", "| tiers | " + " | ".join(title for _, title in BREAKDOWN) + " |",
              "|" + "---|" * (len(BREAKDOWN) + 1)]
    for name, row in report["rows"].items():
        parts = row.get("ttft_breakdown") or {}
        cells = [f"{parts[k]:.0f}" if k in parts else "n/a" for k, _ in BREAKDOWN]
        lines.append("| " + " | ".join([name] + cells) + " |")
    failed = {name: row for name, row in report["rows"].items() if row.get("failed")}
    if failed:  # the figures above are over the turns that completed: say which did not, and why
        lines += ["", "failed turns (the figures above are over the completed ones; compare rows with care):"]
        lines += [f"- {name}: {row['failed']} failed: {'; '.join(row.get('error_examples') or ['(no message)'])}"
                  for name, row in failed.items()]
    return "\n".join(lines)

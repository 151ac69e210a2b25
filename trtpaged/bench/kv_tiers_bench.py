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
import shutil
import statistics
import tempfile
from pathlib import Path
from typing import Any, Callable, Optional

from trtpaged.bench.multi_turn import MultiTurnSpec, run_multi_turn
from trtpaged.bench.redis_process import RedisProcess

COLUMNS = (("p50_ttft_ms", "TTFT p50 ms", "{:.0f}"), ("p99_ttft_ms", "TTFT p99 ms", "{:.0f}"),
           ("prefill_tokens_computed", "prefill computed", "{}"), ("prefix_hit_rate", "hit rate", "{:.2f}"),
           ("prefix_tier_hit_tokens", "tier-hit tokens", "{}"),
           ("first_turn_mean_ttft_ms", "1st-turn TTFT ms", "{:.0f}"),
           ("request_throughput", "req/s", "{:.2f}"), ("same_replies", "replies = off", "{}"))  # fmt: skip


def _warm_up(url: str) -> None:
    """One short request on words the conversations never use: first-request costs stay out of the figures."""
    import httpx

    body = {"prompt": "zebra quartz " * 8, "max_tokens": 2, "temperature": 0.0}
    httpx.post(url.rstrip("/") + "/v1/completions", json=body, timeout=600.0).raise_for_status()


def run_kv_tiers_bench(
    engine: Path, spec: MultiTurnSpec, num_kv_blocks: int, host_memory: str = "1GiB", disk_size: str = "4GiB",
    remote: Optional[str] = None, llm_kwargs: Optional[dict[str, Any]] = None, seed: int = 0, rounds: int = 1,
    progress: Optional[Callable[[str], None]] = None,
) -> dict[str, Any]:  # fmt: skip
    """Runs every row (remote rows when `remote` is given or redis-server is installed) `rounds` times;
    returns the report.

    Rows that depend on each other run together as a group (disk then its restart, Redis then the second
    replica). Round r uses seed + r (other conversations: nothing cached in one round helps another), a
    fresh disk directory, and the groups rotated by r, so that each row runs early and late on a machine
    whose load drifts; times are the median over rounds, token counts the sum.
    """
    say = progress or (lambda _msg: None)
    runs: dict[str, list[dict[str, Any]]] = {}
    redis = None
    try:
        if remote is None and shutil.which("redis-server"):
            redis = RedisProcess()
            remote = redis.url
        for r in range(rounds):
            disk_dir = Path(tempfile.mkdtemp(prefix="trtpaged-kv-disk-"))
            try:
                disk = {"path": str(disk_dir), "size": disk_size}
                groups: list[list[tuple[str, Optional[dict[str, Any]], int]]] = [
                    [("off, unbounded pool", None, 0)], [("off", None, 0)], [("host", {"host_memory": host_memory}, 0)],
                    [("disk", {"disk": disk}, 0), ("disk, restarted", {"disk": disk}, 1)],
                ]
                if remote:
                    groups.append([("remote", {"remote": remote}, 0), ("remote, 2nd replica", {"remote": remote}, 0)])
                for group in groups[r % len(groups):] + groups[:r % len(groups)]:
                    for name, tiers, variant in group:
                        report = _run_row(engine, spec, num_kv_blocks, name, tiers, seed + r, variant, llm_kwargs, say)
                        runs.setdefault(name, []).append(report)
            finally:
                shutil.rmtree(disk_dir, ignore_errors=True)
    finally:
        if redis is not None:
            redis.kill()
    rows = {name: _combine(name, runs[name], runs["off"]) for name in runs}
    return {"engine": str(engine), "num_kv_blocks": num_kv_blocks, "conversations": spec.conversations,
            "turns": spec.turns, "think_time_s": spec.think_time_s, "rounds": rounds, "rows": rows}


def _run_row(engine: Path, spec: MultiTurnSpec, num_kv_blocks: int, name: str, tiers: Optional[dict[str, Any]],
             seed: int, variant: int, llm_kwargs: Optional[dict[str, Any]], say: Callable[[str], None]) -> dict:
    from trtpaged.server import start_server

    blocks = None if name == "off, unbounded pool" else num_kv_blocks  # None: the engine's whole budget
    say(f"{name}: starting a server ({blocks or 'all'} KV blocks, seed {seed})")
    handle = start_server(engine, port=0, num_kv_blocks=blocks, kv_tiers=tiers, **(llm_kwargs or {}))
    try:
        _warm_up(handle.url)
        report = asyncio.run(run_multi_turn(handle.url, spec, seed=seed, variant=variant))
    finally:
        handle.shutdown()  # flushes the pool's cached prefixes to the tiers
    say(f"{name}: {report['completed']} turns ({report['failed']} failed), TTFT p50/p99 "
        f"{report['p50_ttft_ms']:.0f}/{report['p99_ttft_ms']:.0f} ms, prefill computed "
        f"{report['prefill_tokens_computed']}, hit rate {report['prefix_hit_rate']}, tier-hit tokens "
        f"{report['prefix_tier_hit_tokens']}")
    return report


def _combine(name: str, runs: list[dict[str, Any]], off: list[dict[str, Any]]) -> dict[str, Any]:
    """One row from its rounds: medians of times, sums of tokens, and whether every reply equals tiers-off's."""
    row: dict[str, Any] = {}
    for key in ("p50_ttft_ms", "p99_ttft_ms", "first_turn_mean_ttft_ms", "request_throughput"):
        row[key] = statistics.median(run[key] for run in runs)
    for key in ("prefill_tokens_computed", "prefix_tier_hit_tokens", "failed", "completed"):
        values = [run[key] for run in runs]
        row[key] = None if None in values else sum(values)
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
    lines = [f"{report['conversations']} conversations x {report['turns']} turns, think time "
             f"{report['think_time_s']} s, pool of {report['num_kv_blocks']} blocks ({report['engine']}); "
             f"{report['rounds']} rounds: times are medians, token counts sums", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, row in report["rows"].items():
        cells = [name] + ["n/a" if row.get(key) is None else fmt.format(row[key]) for key, _, fmt in COLUMNS]
        if row.get("failed"):
            cells[0] += f" ({row['failed']} failed)"
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)

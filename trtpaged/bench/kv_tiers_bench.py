"""`trtpaged bench kv-tiers ENGINE`: the same multi-turn traffic against servers with and without KV tiers.

One run, one engine, one small pool (`--kv-blocks`; a first row has the engine's whole budget: the hit rate
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
    engine: Path, spec: MultiTurnSpec, kv_blocks: int, host_memory: str = "1GiB", disk_size: str = "4GiB",
    remote: Optional[str] = None, llm_kwargs: Optional[dict[str, Any]] = None, seed: int = 0,
    progress: Optional[Callable[[str], None]] = None,
) -> dict[str, Any]:  # fmt: skip
    """Runs every row (remote rows when `remote` is given or redis-server is installed); returns the report."""
    from trtpaged.server import start_server

    say = progress or (lambda _msg: None)
    rows: dict[str, dict[str, Any]] = {}
    redis = None
    disk_dir = Path(tempfile.mkdtemp(prefix="trtpaged-kv-disk-"))
    try:
        if remote is None and shutil.which("redis-server"):
            redis = RedisProcess()
            remote = redis.url
        disk = {"path": str(disk_dir), "size": disk_size}
        plan: list[tuple[str, Optional[dict[str, Any]], int]] = [
            ("off, unbounded pool", None, 0), ("off", None, 0), ("host", {"host_memory": host_memory}, 0),
            ("disk", {"disk": disk}, 0),
            ("disk, restarted", {"disk": disk}, 1),
        ]
        if remote:
            plan += [("remote", {"remote": remote}, 0), ("remote, 2nd replica", {"remote": remote}, 0)]
        for name, tiers, variant in plan:
            blocks = None if name == "off, unbounded pool" else kv_blocks  # None: the engine's whole budget
            say(f"{name}: starting a server ({blocks or 'all'} KV blocks)")
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
            rows[name] = report
    finally:
        if redis is not None:
            redis.kill()
        shutil.rmtree(disk_dir, ignore_errors=True)
    for name, report in rows.items():  # the restarted server runs other conversations: nothing to compare
        same = report["replies"] == rows["off"]["replies"]
        report["same_replies"] = "-" if name == "disk, restarted" else ("yes" if same else "NO")
    return {"engine": str(engine), "kv_blocks": kv_blocks, "conversations": spec.conversations,
            "turns": spec.turns, "think_time_s": spec.think_time_s, "rows": rows}


def format_kv_tiers(report: dict[str, Any]) -> str:
    """The rows as a markdown table."""
    head = ["tiers"] + [title for _, title, _ in COLUMNS]
    lines = [f"{report['conversations']} conversations x {report['turns']} turns, think time "
             f"{report['think_time_s']} s, pool of {report['kv_blocks']} blocks ({report['engine']})", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, row in report["rows"].items():
        cells = [name] + ["n/a" if row.get(key) is None else fmt.format(row[key]) for key, _, fmt in COLUMNS]
        if row.get("failed"):
            cells[0] += f" ({row['failed']} failed)"
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)

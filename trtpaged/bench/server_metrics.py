"""Reading a live server's Prometheus metrics (trtpaged's own names, or vLLM's) for `trtpaged diagnose`."""

from __future__ import annotations

import time
import urllib.request
from typing import Optional

# gauge -> accepted metric names, trtpaged's first, then vLLM's (v0 and v1 spellings); running and waiting count
# sequences (each sample or beam, as max_batch_size and vLLM's max_num_seqs do), an older trtpaged's requests
GAUGES = {
    "running": ("trtpaged:num_sequences_running", "trtpaged:num_requests_running", "vllm:num_requests_running"),
    "waiting": ("trtpaged:num_sequences_waiting", "trtpaged:num_requests_waiting", "vllm:num_requests_waiting"),
    "kv_usage": ("trtpaged:kv_cache_usage_perc", "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
}
KV_FULL = 0.90  # KV usage at or above this counts as full


def parse_prometheus(text: str) -> dict[str, float]:
    """Metric name -> value (labelled series of one name are summed; comments skipped)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_part, _, value = line.rpartition(" ")
        name = name_part.split("{", 1)[0].strip()
        try:
            out[name] = out.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return out


def gauges(metrics: dict[str, float]) -> dict[str, Optional[float]]:
    return {key: next((metrics[n] for n in names if n in metrics), None) for key, names in GAUGES.items()}


def observe(url: str, samples: int = 3, interval_s: float = 1.0, max_batch_size: Optional[int] = None) -> dict:
    """Samples the server's gauges; classifies each sample with requests waiting as memory- or scheduler-bound."""
    snaps = []
    for i in range(samples):
        with urllib.request.urlopen(url, timeout=10) as resp:
            snaps.append(gauges(parse_prometheus(resp.read().decode())))
        if i + 1 < samples:
            time.sleep(interval_s)
    return classify(snaps, max_batch_size)


def classify(snaps: list[dict[str, Optional[float]]], max_batch_size: Optional[int] = None) -> dict:
    if all(s["running"] is None and s["waiting"] is None for s in snaps):
        return {"samples": snaps, "verdict": "The metrics have no running/waiting gauges (trtpaged:* or vllm:*)."}
    queued = [s for s in snaps if (s["waiting"] or 0) > 0]
    full = [s for s in queued if s["kv_usage"] is not None and s["kv_usage"] >= KV_FULL]
    at_limit = [s for s in queued if max_batch_size and (s["running"] or 0) >= max_batch_size]
    if not queued:
        verdict = f"Live server: nothing waiting in {len(snaps)} samples (not saturated)."
    elif len(full) >= len(queued) / 2:
        verdict = (f"Live server: requests waiting in {len(queued)} of {len(snaps)} samples, "
                   f"KV usage >= {KV_FULL:.0%} in "
                   f"{len(full)} of them: memory-bound.")  # fmt: skip
    else:
        verdict = (f"Live server: requests waiting in {len(queued)} of {len(snaps)} samples "
                   f"with KV below {KV_FULL:.0%} "
                   f"({len(at_limit)} at max_batch_size): scheduler-bound.")  # fmt: skip
    return {"samples": snaps, "queued_samples": len(queued), "kv_full_samples": len(full), "verdict": verdict}

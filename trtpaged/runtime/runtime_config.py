"""The runtime's one frozen configuration: limits and KV pool size for serving an engine."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from trtpaged.runtime.speculative import SpeculativeConfig

PREEMPTION_MODES = ("recompute", "swap")
# vLLM's two: first come first served, or by each request's priority (lower first), then arrival
SCHEDULING_POLICIES = ("fcfs", "priority")


@dataclass(frozen=True)
class RuntimeConfig:
    """Scheduler and KV-cache settings. Built from the manifest's limits, optionally tightened."""

    block_size: int
    num_kv_blocks: int
    max_batch_size: int  # sequences per step
    max_num_tokens: int  # tokens per step (prefill chunks + decode tokens)
    max_seq_len: int  # prompt + output tokens of one sequence
    enable_prefix_caching: bool = True
    preemption_mode: str = "recompute"
    scheduling_policy: str = "fcfs"  # "priority": requests may carry a priority other than 0
    num_host_blocks: int = 0  # host-memory blocks for swap preemption
    speculative: Optional[SpeculativeConfig] = None  # speculative decoding (docs/speculative.md); None: off
    # > 0: every layer of the model has a sliding window of at most this many tokens, and blocks wholly
    # before a sequence's window go back to the pool as it advances (KVCacheManager.reclaim); 0: never
    reclaim_window: int = 0
    # the most top log-probs a request may ask for per token (logprobs, prompt_logprobs); -1: the whole
    # vocabulary. vLLM's default: each entry is a Python dict entry per token, so an unbounded k on a large
    # vocabulary would build gigabytes of them.
    max_logprobs: int = 20

    def __post_init__(self) -> None:
        positive = ("block_size", "num_kv_blocks", "max_batch_size", "max_num_tokens", "max_seq_len")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"RuntimeConfig.{name}: must be >= 1, got {getattr(self, name)}")
        if self.max_num_tokens < self.max_batch_size:
            raise ValueError(
                f"RuntimeConfig.max_num_tokens: must be >= max_batch_size ({self.max_batch_size}), "
                f"got {self.max_num_tokens}"
            )
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"RuntimeConfig.preemption_mode: one of {PREEMPTION_MODES}, got {self.preemption_mode!r}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"RuntimeConfig.scheduling_policy: one of {SCHEDULING_POLICIES}, got "
                             f"{self.scheduling_policy!r}")
        if self.reclaim_window < 0:
            raise ValueError(f"RuntimeConfig.reclaim_window: must be >= 0, got {self.reclaim_window}")
        if isinstance(self.max_logprobs, bool) or not isinstance(self.max_logprobs, int) or self.max_logprobs < -1:
            raise ValueError(f"RuntimeConfig.max_logprobs: must be >= 0, or -1 (the whole vocabulary), got "
                             f"{self.max_logprobs!r}")
        if self.num_host_blocks < 0:
            raise ValueError(f"RuntimeConfig.num_host_blocks: must be >= 0, got {self.num_host_blocks}")
        if self.preemption_mode == "swap" and self.num_host_blocks == 0:
            raise ValueError("RuntimeConfig.num_host_blocks: must be > 0 when preemption_mode is 'swap'")

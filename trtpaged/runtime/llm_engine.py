"""The step loop: schedule -> move blocks -> run the engine -> sample and update."""

from __future__ import annotations

import itertools
from typing import Any, Optional, Sequence as Seq, Union

from trtpaged.runtime.batch_builder import build_step_batch
from trtpaged.runtime.beam_search import BeamSearch
from trtpaged.runtime.engines.base import Engine
from trtpaged.runtime.kv_cache_manager import KVCacheManager
from trtpaged.runtime.output_processor import OutputProcessor
from trtpaged.runtime.outputs import RequestOutput
from trtpaged.runtime.runtime_config import RuntimeConfig
from trtpaged.runtime.sampling_params import SamplingParams
from trtpaged.runtime.scheduler import Scheduler
from trtpaged.runtime.sequence import Sequence
from trtpaged.runtime.sequence_group import SequenceGroup

Prompt = Union[str, Seq[int]]


class LLMEngine:
    """Owns the requests, the scheduler and the KV-cache manager; drives one `Engine`.

    Nothing here knows which backend runs the step. `step()` returns the
    outputs of requests that advanced (or finished) in that step, which is
    what streaming consumers print.
    """

    def __init__(
        self, engine: Engine, config: RuntimeConfig, tokenizer: Optional[Any] = None, eos_token_ids: Seq[int] = ()
    ) -> None:
        if engine.num_blocks != config.num_blocks:
            raise ValueError(f"num_blocks: engine pool has {engine.num_blocks} blocks, config says {config.num_blocks}")
        self.engine = engine
        self.config = config
        self.tokenizer = tokenizer
        self.eos_token_ids = list(eos_token_ids)
        self.kv = KVCacheManager(
            config.num_blocks, config.block_size, config.enable_prefix_caching, config.num_host_blocks
        )
        self.scheduler = Scheduler(config, self.kv)
        self._seq_ids = itertools.count()
        self._arrivals = itertools.count()
        self._request_ids = itertools.count()
        self.processor = OutputProcessor(
            self.scheduler, tokenizer, self.eos_token_ids, config.max_seq_len, lambda: next(self._seq_ids)
        )
        self.groups: dict[str, SequenceGroup] = {}
        self.num_steps = 0
        self.num_block_copies = 0
        self.num_tokens_computed = 0

    def encode(self, prompt: Prompt) -> tuple[Optional[str], list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt: text prompts need a tokenizer; pass token ids")
            return prompt, list(self.tokenizer.encode(prompt))
        return None, [int(t) for t in prompt]

    def add_request(self, prompt: Prompt, params: Optional[SamplingParams] = None, request_id: Optional[str] = None) -> str:
        """Queues a request; raises ValueError (naming the limit) if it can never run."""
        params = params or SamplingParams()
        text, token_ids = self.encode(prompt)
        request_id = request_id if request_id is not None else f"req-{next(self._request_ids)}"
        if request_id in self.groups:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        self.scheduler.check_request(len(token_ids), params.num_seqs)
        beam = None
        if params.use_beam_search:
            room = self.config.max_seq_len - len(token_ids)
            beam = BeamSearch(params, self.eos_token_ids, max(1, min(params.max_tokens or room, room)))
        seq = Sequence(next(self._seq_ids), token_ids)
        group = SequenceGroup(request_id, next(self._arrivals), text, seq, params, beam)
        self.scheduler.add(group)
        self.groups[request_id] = group
        return request_id

    def abort(self, request_id: str) -> bool:
        """Stops a request now; its blocks return to the pool. False if it is unknown or done."""
        group = self.scheduler.abort(request_id)
        self.groups.pop(request_id, None)
        return group is not None

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """One iteration: returns outputs of the requests that advanced or finished."""
        out = self.scheduler.schedule()
        touched = list(out.refused)
        self.engine.swap_out(out.swap_out)  # a preemption may move blocks even when nothing runs
        self.engine.swap_in(out.swap_in)
        if not out.is_empty:
            self.engine.copy_blocks(out.block_copies)
            batch, rows = build_step_batch(out, self.kv)
            logits = self.engine.step(batch).cpu()
            self.scheduler.update_after_step(out)
            self.processor.process(out.sampled_groups, logits, rows)
            touched += out.sampled_groups
            self.num_steps += 1
            self.num_block_copies += len(out.block_copies)
            self.num_tokens_computed += out.num_tokens
        results = [self.processor.make_output(g) for g in touched]
        for g in touched:
            if g.is_finished:
                self.groups.pop(g.request_id, None)
        return results

    def output(self, request_id: str) -> Optional[RequestOutput]:
        group = self.groups.get(request_id)
        return self.processor.make_output(group) if group is not None else None

    def stats(self) -> dict[str, float]:
        """KV-cache, sharing, prefix-cache and scheduling counters."""
        stats: dict[str, float] = dict(self.kv.stats(self.scheduler.live_seqs()))
        stats.update(
            num_preemptions=self.scheduler.num_preemptions,
            num_swap_outs=self.scheduler.num_swap_outs,
            num_steps=self.num_steps,
            num_block_copies=self.num_block_copies,
            num_tokens_computed=self.num_tokens_computed,
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_swapped=len(self.scheduler.swapped),
        )
        return stats

"""The step loop: schedule -> run -> sample -> update -> outputs, in a straight line (docs/architecture.md)."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import numbers
from collections import deque
import operator
import time
from collections.abc import Iterable, Mapping
from typing import Any, Optional, Sequence as Seq, Union

from trtpaged.errors import RequestError, check_unicode, is_out_of_memory
from trtpaged.models.execution_plan import LAYER_MODES
from trtpaged.runtime.batch_builder import PromptRows, build_step_batch
from trtpaged.runtime.beam_search import BeamSearch
from trtpaged.runtime.draft import DraftProposer
from trtpaged.runtime.runners.base import ModelRunner
from trtpaged.runtime.kv_cache_manager import KVCacheManager, TierSave
from trtpaged.runtime.kv_tiers.stack import TierStack
from trtpaged.runtime.output_processor import OutputProcessor
from trtpaged.runtime.outputs import RequestOutput
from trtpaged.runtime.runtime_config import RuntimeConfig
from trtpaged.runtime.sampler import greedy_kernel, sample_groups
from trtpaged.runtime.sampling_params import SamplingParams
from trtpaged.runtime.scheduler import Scheduler, SchedulerOutput
from trtpaged.runtime.scoring import score_prompts
from trtpaged.runtime.speculative import METHODS
from trtpaged.runtime.reasoning import ReasoningReader, ThinkingBudget
from trtpaged.runtime.structured import GatedMatcher, GrammarCache
from trtpaged.runtime.sequence import Sequence, SequenceGroup

Prompt = Union[str, Seq[int]]
log = logging.getLogger("trtpaged.runtime")

PHASES = ("schedule", "prepare", "model", "sample", "update", "output")
LOAD_POLL_S = 0.02  # an idle step's longest wait for a tier read (new requests are taken between steps)
TTFT_RECORDS = 4096  # the most recent requests `ttft_breakdown` keeps


_PROMPT_KEYS = {"prompt", "prompt_token_ids", "cache_salt"}


PRIORITY_BOUND = 1 << 63  # priorities are in [-2**63, 2**63): what a client's int64 holds


def check_priority(priority: Any, policy: str) -> int:
    """`priority` as an int; RequestError naming it unless it is an integer (numpy's too) in int64's range, and 0
    where the policy is not "priority"."""
    if isinstance(priority, bool) or not isinstance(priority, numbers.Integral) or \
            not -PRIORITY_BOUND <= priority < PRIORITY_BOUND:  # fmt: skip
        raise RequestError("priority", f"must be an integer in [-2**63, 2**63), got {priority!r:.40}")
    if priority != 0 and policy != "priority":
        raise RequestError("priority", f"{priority} needs priority scheduling (scheduling_policy \"priority\", serve "
                                       f"--scheduling-policy priority); under {policy!r} only 0 is accepted")
    return int(priority)


def prompt_salt(prompt: Any) -> Optional[str]:
    """A vLLM prompt dict's cache_salt (None without one)."""
    return prompt.get("cache_salt") if isinstance(prompt, Mapping) else None


def unwrap_prompt(prompt: Any) -> Any:
    """vLLM's prompt dicts as what they hold: {"prompt_token_ids": ids} (TokensPrompt) or {"prompt": text}
    (TextPrompt), either with an optional "cache_salt" (`prompt_salt`); an array or tensor of token ids as a list;
    anything else as it is."""
    if isinstance(prompt, Mapping):
        if not {"prompt", "prompt_token_ids"} & set(prompt) or set(prompt) - _PROMPT_KEYS:
            raise RequestError("prompt", "a prompt dict holds 'prompt' (text) or 'prompt_token_ids', and maybe "
                               f"'cache_salt', got keys {sorted(map(repr, prompt))!r:.120}")
        prompt = prompt["prompt_token_ids"] if "prompt_token_ids" in prompt else prompt["prompt"]
    if hasattr(prompt, "tolist") and not isinstance(prompt, (str, list, tuple)):
        prompt = prompt.tolist()  # an array or tensor of token ids (or a 2-D one of several prompts)
    return prompt


def encode_prompt(tokenizer: Optional[Any], vocab_size: Optional[int], prompt: Prompt,
                  add_special_tokens: bool = True) -> tuple[Optional[str], list[int]]:
    """(text or None, token ids) of a text or token-id prompt: text through `tokenizer` (`add_special_tokens`: what
    it adds, a BOS, as `tokenizer.encode` does by default), token ids checked against `vocab_size` (when known).
    `LLMEngine.encode` with the engine's tokenizer; the server calls it with its own copy, off the engine thread."""
    text = prompt if isinstance(prompt, str) else None
    if text is not None:
        if tokenizer is None:
            raise RequestError("prompt", "text prompts need a tokenizer; pass token ids")
        ids = list(tokenizer.encode(check_unicode("prompt", text), add_special_tokens=add_special_tokens))
    else:
        ids = _token_ids(prompt)
    # one check for both: a tokenizer may hold ids past the embedding too (Gemma 3's image token at vocab_size)
    bad = next((t for t in ids if t < 0 or (vocab_size is not None and t >= vocab_size)), None)
    if bad is not None:
        what = (f"the text encodes to token id {bad} ({tokenizer.convert_ids_to_tokens(bad)!r:.40}), outside the "
                f"model's vocabulary" if text is not None else f"token id {bad} is outside the vocabulary")
        raise RequestError("prompt", f"{what} [0, {vocab_size})", vocab_size)
    return text, ids


def _token_ids(prompt: Any) -> list[int]:
    """A token-id prompt as a list of ints (numpy ints too; not bools)."""
    try:
        tokens = iter(prompt)
    except TypeError:
        raise RequestError("prompt", f"must be text or a list of token ids, got {type(prompt).__name__}") from None
    ids = []
    for t in tokens:
        try:
            if isinstance(t, bool):
                raise TypeError(t)
            ids.append(operator.index(t))  # ints, numpy ints
        except TypeError:
            raise RequestError("prompt", "a token-id prompt must be a list of ints") from None
    return ids


class LLMEngine:
    """Owns the requests, the scheduler and the KV-cache manager; drives one `ModelRunner`.

    Nothing here knows which backend runs the step. `step()` returns the
    outputs of requests that advanced (or finished) in that step, shaped by each
    request's `SamplingParams.output_kind`. `phase_seconds` accumulates the
    wall time of each phase of `step()` over all steps (keys: `PHASES`).

    A request whose own rows fail in a step (non-finite logits, its sampling or beam
    scoring raising) finishes in that step with finish_reason "error" and
    `RequestOutput.error` saying why, its blocks freed; the step's other requests go on.
    A failure that belongs to no one request (the runner raising) propagates from `step()`.
    """

    def __init__(
        self, runner: ModelRunner, config: RuntimeConfig, tokenizer: Optional[Any] = None,
        eos_token_ids: Seq[int] = (), vocab_size: Optional[int] = None, tiers: Optional[TierStack] = None,
        draft: Optional[DraftProposer] = None,
    ) -> None:  # fmt: skip
        if runner.num_kv_blocks != config.num_kv_blocks:
            raise ValueError(f"num_kv_blocks: runner pool has {runner.num_kv_blocks} blocks, "
                             f"config says {config.num_kv_blocks}")
        self.runner = runner
        self.config = config
        self.tokenizer = tokenizer
        self.eos_token_ids = list(eos_token_ids)
        self.vocab_size = vocab_size  # token-id prompts are checked against it when known
        self._tier_memory_warned = False  # a write-back that ran out of memory was logged
        self.kv = KVCacheManager(
            config.num_kv_blocks, config.block_size, config.enable_prefix_caching, config.num_host_blocks, tiers=tiers,
            reclaim_window=config.reclaim_window,
        )
        spec = config.speculative
        if (draft is not None) != (spec is not None and spec.method == "draft_model"):
            raise ValueError("speculative_config.model: a draft proposer goes with method draft_model, only")
        self.scheduler = Scheduler(config, self.kv, self.eos_token_ids, draft)
        self.processor = OutputProcessor(tokenizer)
        self.greedy_kernel = greedy_kernel()  # plain-greedy steps in one kernel pass: decided here, once
        self.grammars = GrammarCache(tokenizer, vocab_size or 0, self.eos_token_ids)
        self.num_constrained_requests = 0  # requests added with an output grammar
        self.reasoning: Optional[ReasoningReader] = None  # a reasoning model's tags (LLM(reasoning_parser=...))
        self._arrivals = itertools.count()
        self._request_ids = itertools.count()
        self.groups: dict[str, SequenceGroup] = {}
        self.num_steps = 0
        self.num_block_copies = 0
        self.num_tokens_computed = 0
        self.phase_seconds: dict[str, float] = dict.fromkeys(PHASES, 0.0)
        self._ttft: deque[dict[str, float]] = deque(maxlen=TTFT_RECORDS)

    def encode(self, prompt: Prompt, add_special_tokens: bool = True) -> tuple[Optional[str], list[int]]:
        """(text or None, token ids) of a text or token-id prompt; `add_special_tokens`: what the tokenizer adds to
        a text (a BOS), as `tokenizer.encode` does by default."""
        return encode_prompt(self.tokenizer, self.vocab_size, prompt, add_special_tokens)

    def add_request(self, prompt: Union[Prompt, Mapping[str, Any]], params: Optional[SamplingParams] = None,
                    request_id: Optional[str] = None, arrival_time: Optional[float] = None,
                    fit_max_tokens: bool = False, priority: int = 0,
                    starts_in_reasoning: Optional[bool] = None) -> str:  # fmt: skip
        """Queues a request; raises `RequestError` (naming the field and limit) if it can never run. `prompt`: text,
        token ids, or vLLM's {"prompt": text} / {"prompt_token_ids": ids} with an optional "cache_salt" (which
        wins over params.cache_salt, as in `LLM.generate`).
        `arrival_time` (time.monotonic()): when it reached the server, for `ttft_breakdown`. `fit_max_tokens`: a
        max_tokens past the room the prompt leaves in max_seq_len is cut to that room (vLLM's offline API), where
        it is otherwise refused (its server). `priority` (vLLM's): under the "priority" scheduling policy, lower is
        served first (admitted first, preempted last); only 0 otherwise. `starts_in_reasoning`: whether the answer
        starts inside a reasoning model's thinking (the server reads it from the chat template's generation prompt);
        None: read from the prompt's tags (`ReasoningReader.starts_in_reasoning`), for thinking_token_budget.
        vLLM's order, `add_request(request_id, prompt, params)` (its llm_engine_example.py), is taken too: it is
        told apart by the SamplingParams in third place."""
        priority = check_priority(priority, self.config.scheduling_policy)
        if isinstance(request_id, SamplingParams) and not isinstance(params, SamplingParams):
            prompt, params, request_id = params, request_id, prompt  # type: ignore[assignment]
            if not isinstance(request_id, str):
                raise RequestError("request_id", f"must be a string, got {type(request_id).__name__}")
        if params is not None and not isinstance(params, SamplingParams):
            raise TypeError(f"params: a SamplingParams, got {type(params).__name__} (the arguments are prompt, "
                            "params, request_id, or vLLM's request_id, prompt, params)")  # fmt: skip
        # a copy checked again: SamplingParams can be changed after it is made (as vLLM's), unchecked, and the
        # request must not see the caller's later changes
        params = dataclasses.replace(params) if params is not None else SamplingParams()
        salt = prompt_salt(prompt)  # a prompt dict's salt is the request's, over the params' (as in LLM.generate)
        if salt is not None:
            params = dataclasses.replace(params, cache_salt=salt)
        text, token_ids = self.encode(unwrap_prompt(prompt))
        if params.truncate_prompt_tokens is not None:  # vLLM's: the last k tokens (-1: all that leave max_tokens room)
            k = params.truncate_prompt_tokens
            k = k if k > 0 else max(1, self.config.max_seq_len - (params.max_tokens or 1))
            token_ids = token_ids[-k:]
        changes: dict[str, Any] = {}
        if self.vocab_size is not None:  # vLLM's -1: the whole vocabulary (max_logprobs permitting)
            changes = {name: self.vocab_size for name in ("logprobs", "prompt_logprobs") if getattr(params, name) == -1}
        room = self.config.max_seq_len - len(token_ids)
        if fit_max_tokens and params.max_tokens is not None and 1 <= room < params.max_tokens:
            changes.update(max_tokens=room, min_tokens=min(params.min_tokens, room))
        if changes:
            params = dataclasses.replace(params, **changes)
        request_id = request_id if request_id is not None else f"req-{next(self._request_ids)}"
        if request_id in self.groups:
            raise RequestError("request_id", f"{request_id!r} is already in use")
        # Before anything proportional to the request (its n generators, beams, sequences) is built.
        self.scheduler.check_request(len(token_ids), params)
        bad_words = self._token_filters(params)
        if params.thinking_token_budget is not None and self.reasoning is None:
            raise RequestError("thinking_token_budget", "needs a reasoning parser to know where the thinking ends "
                               "(serve --reasoning-parser, LLM(reasoning_parser=...))")  # fmt: skip
        compiled = self.grammars.compile(params.structured_outputs) if params.structured_outputs else None
        beam = None
        if params.use_beam_search:
            room = self.config.max_seq_len - len(token_ids)
            beam = BeamSearch(params, self.eos_token_ids, max(1, min(params.max_tokens or room, room)))
        seq = Sequence(self.scheduler.new_seq_id(), token_ids, cache_salt=params.cache_salt)
        group = SequenceGroup(request_id, next(self._arrivals), text, seq, params, beam, priority)
        group.bad_words = bad_words
        if params.min_tokens:  # EOS too under ignore_eos, as vLLM masks it: min_tokens says when it may come
            group.min_tokens_banned = tuple(sorted(set(params.stop_token_ids) | set(self.eos_token_ids)))
        if params.thinking_token_budget is not None and self.reasoning is not None:  # (refused above without one)
            r = self.reasoning
            thinking = r.starts_in_reasoning(token_ids) if starts_in_reasoning is None else starts_in_reasoning
            seq.thinking = ThinkingBudget(params.thinking_token_budget, r.start_id, r.end_id, thinking, r.blank_ids)
        if compiled is not None:
            seq.grammar = self.grammars.matcher(compiled)
            if params.structured_outputs.starts_after is not None:
                seq.grammar = GatedMatcher(seq.grammar, params.structured_outputs.starts_after)
            self.num_constrained_requests += 1
        self.scheduler.add(group)
        if arrival_time is not None:
            group.times["arrived"] = min(arrival_time, group.times["queued"])
        self.groups[request_id] = group
        return request_id

    def _token_filters(self, params: SamplingParams) -> tuple[tuple[int, ...], ...]:
        """Checks logit_bias, allowed_token_ids and stop_token_ids against the vocabulary; returns the bad words'
        token ids (each word as the tokenizer spells it alone and after a space, as vLLM does)."""
        vocab = self.vocab_size
        checked = (("logit_bias", params.logit_bias or ()), ("allowed_token_ids", params.allowed_token_ids or ()),
                   ("stop_token_ids", params.stop_token_ids),
                   ("structured_outputs.starts_after",
                    (params.structured_outputs.starts_after,) if params.structured_outputs and
                    params.structured_outputs.starts_after is not None else ()))  # fmt: skip
        for name, ids in checked:
            bad = next((t for t in ids if t < 0 or (vocab is not None and t >= vocab)), None)
            if bad is not None:
                raise RequestError(name, f"token id {bad} is outside the vocabulary [0, {vocab})", vocab)
        if not params.bad_words:
            return ()
        if self.tokenizer is None:
            raise RequestError("bad_words", "needs the engine's tokenizer")
        # vLLM's spellings: the word without its leading spaces, alone and after one space
        words = [check_unicode("bad_words", word).lstrip() or word for word in params.bad_words]
        spellings = {tuple(self.tokenizer.encode(prefix + word, add_special_tokens=False))
                     for word in words for prefix in ("", " ")}  # fmt: skip
        return tuple(sorted(s for s in spellings if s))

    def abort(self, request_id: str) -> bool:
        """Stops a request now; its blocks return to the pool. False if it is unknown or done."""
        group = self.groups.pop(request_id, None)
        return group is not None and self.scheduler.abort(group)

    def abort_request(self, request_ids: Union[str, Iterable[str]]) -> None:
        """vLLM's call: `abort` for each of `request_ids` (one id, or a list as vLLM's V1 engine takes)."""
        for request_id in [request_ids] if isinstance(request_ids, str) else list(request_ids):
            self.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def has_unfinished_requests(self) -> bool:
        """vLLM's name of `has_unfinished`."""
        return self.has_unfinished()

    def get_num_unfinished_requests(self) -> int:
        """vLLM's call: how many requests are queued or running."""
        return len(self.groups)

    def get_tokenizer(self) -> Optional[Any]:
        """vLLM's accessor: the engine's tokenizer (None without one)."""
        return self.tokenizer

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """vLLM's call: forgets every cached prefix in the KV pool, so that the next requests compute theirs again
        (or find them in the KV tiers: the pool's cached blocks are written back to them first, as the pool's
        evictions would have). False, and nothing changed, while requests are unfinished: here
        `reset_running_requests` does not preempt them."""
        if self.scheduler.has_unfinished():
            log.warning("reset_prefix_cache: %d requests unfinished; the prefix cache was not reset",
                        len(self.groups))
            return False
        self._save_to_tiers(self.kv.cached_records())  # read before the pool forgets them
        return self.kv.reset_prefix_cache()

    def step(self) -> list[RequestOutput]:
        """One iteration: returns outputs of the requests that advanced or finished."""
        clock = _PhaseClock(self.phase_seconds)
        out = self.scheduler.schedule()
        clock.lap("schedule")
        results = self.run_scheduled(out, clock)
        if out.is_empty and self.kv.loads_pending():  # nothing to compute until a tier read lands
            self.kv.wait_for_loads(LOAD_POLL_S)
        return results

    def run_scheduled(self, out: SchedulerOutput, clock: Optional[_PhaseClock] = None) -> list[RequestOutput]:
        """The rest of `step()` for a plan that `scheduler.schedule()` just returned."""
        clock = clock or _PhaseClock(self.phase_seconds)
        self._save_to_tiers(out.tier_saves)  # before anything overwrites the evicted blocks
        self.runner.swap_out(out.swap_out)  # a preemption may move blocks even when nothing runs
        self.runner.swap_in(out.swap_in)
        if out.tier_loads:
            self.runner.write_blocks(out.tier_loads)
        touched = list(out.refused)
        if not out.is_empty:
            started = time.perf_counter()
            self.runner.copy_blocks(out.block_copies)
            batch, rows, scored = build_step_batch(out, self.kv)
            clock.lap("prepare")
            logits = self.runner.step(batch).cpu()
            clock.lap("model")
            drafts = {item.seq.seq_id: item.draft for item in out.scheduled if item.draft}
            probs = {item.seq.seq_id: item.draft_probs for item in out.scheduled if item.draft_probs is not None}
            samples = sample_groups(out.sampled_groups, logits, rows, self.greedy_kernel, drafts, probs)
            prompt_scores = score_prompts(logits, scored, self._scored_prompts(scored)) if scored else {}
            clock.lap("sample")
            self.scheduler.update_from_output(out, samples, prompt_scores)
            clock.lap("update")
            self.scheduler.finish_stopped(self.processor.detokenize(out.sampled_groups))
            self._note_prefill(out, time.perf_counter() - started)
            touched += out.sampled_groups
            self.num_steps += 1
            self.num_block_copies += len(out.block_copies)
            self.num_tokens_computed += out.num_tokens
        results = self.processor.make_outputs(touched)
        for group in touched:
            if group.is_finished:
                self.groups.pop(group.request_id, None)
        clock.lap("output")
        return results

    def _note_prefill(self, out: SchedulerOutput, seconds: float) -> None:
        """Per request until its first token: the steps that computed its prompt, what else they computed and
        their time; at the first token, one `ttft_breakdown` record."""
        total = out.num_tokens
        seen: set[str] = set()
        for item in out.scheduled:
            group = item.group
            if "first_token" in group.times or group.request_id in seen:
                continue
            seen.add(group.request_id)
            own = sum(s.num_tokens for s in out.scheduled if s.group is group)
            group.prefill_steps += 1
            group.prefill_shared_tokens += total - own
            group.prefill_step_seconds += seconds
        now = time.monotonic()
        for group in out.sampled_groups:
            if "first_token" in group.times:
                continue
            group.times["first_token"] = now
            t = group.times
            ready, arrived = t.get("ready", t["queued"]), t.get("arrived", t["queued"])
            self._ttft.append({
                "ttft_s": now - arrived, "submit_wait_s": t["queued"] - arrived, "tier_wait_s": ready - t["queued"],
                "admission_wait_s": t["scheduled"] - ready, "prefill_s": now - t["scheduled"],
                "prefill_steps": group.prefill_steps, "prompt_tokens": len(group.prompt_token_ids),
                "cached_tokens": group.num_cached_tokens or 0, "shared_tokens": group.prefill_shared_tokens,
                "prefill_step_s": group.prefill_step_seconds,
            })  # fmt: skip

    def ttft_breakdown(self) -> list[dict[str, float]]:
        """Where each recent request's time to first token went, from its arrival (seconds): `submit_wait_s`
        (from `arrival_time`, when given, until the engine took it: a server's engine thread takes requests
        between steps), `tier_wait_s` (its prefix loading from a KV tier), `admission_wait_s` (queued for
        blocks or the token budget), `prefill_s` (first scheduled to first token: `prefill_steps` steps that
        also computed `shared_tokens` of other requests). HTTP and tokenizing before the submission are not
        in it."""
        return list(self._ttft)

    def _scored_prompts(self, scored: Seq[PromptRows]) -> dict[str, tuple[list[int], int]]:
        return {s.request_id: (self.groups[s.request_id].prompt_token_ids,
                               self.groups[s.request_id].params.prompt_logprobs or 0) for s in scored}  # fmt: skip

    def _save_to_tiers(self, saves: Seq[TierSave], persistent_only: bool = False) -> None:
        tiers = self.kv.tiers
        if not saves or tiers is None:
            return
        ids = [where for _, where in saves if isinstance(where, int)]
        try:
            read = iter(self.runner.read_blocks(ids))
            tiers.save([(record, next(read) if isinstance(where, int) else where) for record, where in saves],
                       persistent_only)
        except (MemoryError, RuntimeError) as exc:  # a write-back is a cache's: given up (counted), never the step's
            if not is_out_of_memory(exc):
                raise
            tiers.drop(len(saves), persistent_only)
            if not self._tier_memory_warned:
                self._tier_memory_warned = True
                log.warning("kv tiers: out of memory reading %d evicted blocks for write-back; they are dropped "
                            "(and recomputed when asked for again); is --kv-host-memory beyond this process's "
                            "memory limit?", len(saves))  # fmt: skip

    def flush_tiers(self) -> None:
        """Writes every block still in the pool's prefix cache to the disk and remote tiers and waits for
        the writer: what a restart should find (write-back otherwise saves a block only when the pool
        evicts it; the host tier ends with this process, so it gets nothing here)."""
        tiers = self.kv.tiers
        if tiers is None or not tiers.has_persistent:
            return
        self._save_to_tiers(self.kv.cached_records(), persistent_only=True)
        tiers.flush()

    def close(self) -> None:
        """Flushes the pool's cached prefixes to the tiers and closes them; idempotent."""
        tiers = self.kv.tiers
        if tiers is not None:
            self.flush_tiers()
            tiers.close()
            self.kv.tiers = None

    def stats(self) -> dict[str, float]:
        """KV-cache (now and peak), sharing, prefix-cache and scheduling counters (oldest_waiting_s, oldest_running_s:
        seconds since the oldest waiting / running request arrived); speculative decoding's
        (spec_decode_*: drafts, draft tokens, accepted tokens, acceptance rate, mean acceptance length, the cost
        rule's verify_row_cost; a draft model's pool and steps) when on."""
        stats: dict[str, float] = dict(self.kv.stats(self.scheduler.live_seqs()))
        now = time.monotonic()
        stats.update(
            num_preemptions=self.scheduler.num_preemptions,
            num_swap_outs=self.scheduler.num_swap_outs,
            num_steps=self.num_steps,
            step_seconds=sum(self.phase_seconds.values()),
            num_block_copies=self.num_block_copies,
            num_tokens_computed=self.num_tokens_computed,
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_swapped=len(self.scheduler.swapped),
            # vLLM's gauges count its engine requests (each sample or beam), a preempted one as waiting
            num_running_seqs=sum(g.num_engine_requests for g in self.scheduler.running),
            num_waiting_seqs=sum(g.num_engine_requests for q in (self.scheduler.waiting, self.scheduler.swapped)
                                 for g in q),
            oldest_waiting_s=_oldest(now, (self.scheduler.waiting, self.scheduler.swapped)),
            oldest_running_s=_oldest(now, (self.scheduler.running,)),
            num_constrained_requests=self.num_constrained_requests,
            num_grammars_compiled=self.grammars.num_compiled,
            num_grammar_cache_hits=self.grammars.num_hits,
        )
        spec = self.config.speculative
        if spec is not None:
            stats.update(self.scheduler.spec_stats.to_stats(),
                         spec_decode_num_speculative_tokens=spec.num_speculative_tokens,
                         spec_decode_verify_row_cost=spec.row_cost)  # fmt: skip
            stats.update({f"spec_decode_method_{m}": float(m == spec.method) for m in METHODS})  # one-hot: numbers
            if self.scheduler.draft is not None:
                stats.update(self.scheduler.draft.stats())
        plan = getattr(getattr(self.runner, "model", None), "execution_plan", None)
        if plan is not None:  # the eager runner's plan, one-hot (stats are numbers): execution_plan_<layers> = 1
            stats.update({f"execution_plan_{mode}": float(plan.layers == mode) for mode in LAYER_MODES})
        return stats


def _oldest(now: float, queues: Iterable[Iterable[SequenceGroup]]) -> float:
    """Seconds since the oldest group in `queues` arrived (reached the server, else the engine's queue); 0 if none."""
    arrivals = [g.times.get("arrived", g.times["queued"]) for q in queues for g in q]
    return now - min(arrivals) if arrivals else 0.0


class _PhaseClock:
    """Adds the time since the previous lap to `totals[phase]`."""

    __slots__ = ("totals", "last")

    def __init__(self, totals: dict[str, float]) -> None:
        self.totals = totals
        self.last = time.perf_counter()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.totals[phase] += now - self.last
        self.last = now

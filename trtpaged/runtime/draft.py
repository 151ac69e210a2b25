"""The draft-engine proposer: a second (smaller or quantized) engine guesses the next k tokens.

The draft runs on the same runtime as the target, with its own runner, KV pool and block tables (a
`KVCacheManager` without prefix caching), keyed by the target's sequence ids. Per step, for the
sequences the scheduler lets speculate, it computes what its cache lacks of each sequence (the tokens
the target accepted and sampled since the last proposal; the whole prompt the first time) and samples
k tokens autoregressively, in k packed steps over all of them: greedily for greedy and seeded requests, else
from its own distribution q (the request's temperature, top-k, top-p and min-p over the draft's logits),
whose rows go with the draft to the target's verification (`sampler`: accept with min(1, p/q)).

Rollback: the draft's cache holds the sequence's tokens then d1..d(k-1) (dk is never computed).
`rollback` keeps the longest prefix of that which the sequence still has, so after a verification
that accepted a tokens it holds the sequence up to min(a, k-1) drafts, and the next proposal computes
the rest (the accepted dk, if any, and the target's bonus token) in its first step. See
docs/speculative.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence as Seq

import torch

from trtpaged.runtime.kv_cache_manager import KVCacheManager
from trtpaged.runtime.runners.base import ModelRunner, StepPacker
from trtpaged.runtime.sampler import filter_logits
from trtpaged.runtime.sampling_params import SamplingParams


@dataclass
class _Mirror:
    """The draft's view of one target sequence: the tokens its cache was computed for."""

    seq_id: int
    token_ids: list[int]
    num_computed_tokens: int = 0


@dataclass(frozen=True)
class DraftRequest:
    """One sequence to propose for: its id, its tokens so far, at most `k` tokens, under `params`."""

    seq_id: int
    token_ids: Seq[int]
    k: int
    params: SamplingParams


@dataclass(frozen=True)
class Proposal:
    """Proposed tokens and, for an unseeded sampled request, the draft's distribution at each ([len(tokens), vocab]);
    None for a greedy or seeded request (a deterministic proposal)."""

    tokens: tuple[int, ...]
    probs: Optional[torch.Tensor] = field(default=None, compare=False)


def common_prefix(a: Seq[int], b: Seq[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # the usual case, at C speed: the sequence only grew since
        return n
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class DraftProposer:
    """Proposes with a draft model on its own pool (`runner` owns `num_kv_blocks` blocks of `block_size` tokens).

    `max_num_tokens` bounds a draft step's tokens: a first proposal whose catch-up (the prompt) does not fit
    is computed in chunks over several steps and proposes nothing until it has caught up. `max_batch_size` bounds
    its sequences (the draft engine's build limit, which a TensorRT plan's profile enforces): past it, the other
    sequences do not speculate that step.
    """

    def __init__(self, runner: ModelRunner, num_kv_blocks: int, block_size: int, max_num_tokens: int,
                 max_seq_len: int, vocab_size: int, source: str = "", token_cost: float = 0.0,
                 max_batch_size: Optional[int] = None) -> None:  # fmt: skip
        if runner.num_kv_blocks != num_kv_blocks:
            raise ValueError(f"num_kv_blocks: the draft runner's pool has {runner.num_kv_blocks} blocks, "
                             f"not {num_kv_blocks}")  # fmt: skip
        self.runner = runner
        self.kv = KVCacheManager(num_kv_blocks, block_size, enable_prefix_caching=False)
        self.max_num_tokens = max_num_tokens
        self.max_batch_size = max_batch_size or max_num_tokens  # sequences in one draft step (a plan's profile)
        self.max_seq_len = max_seq_len
        self.vocab_size = vocab_size
        self.source = source  # the engine dir, for stats and errors
        self.token_cost = token_cost  # one draft step, in one-row target steps (the cost rule's draft_token_cost)
        self.mirrors: dict[int, _Mirror] = {}
        self.num_steps = 0
        self.num_tokens_computed = 0

    # ---- the scheduler's calls ------------------------------------------------------------------
    def propose(self, requests: Seq[DraftRequest]) -> dict[int, Proposal]:
        """Up to `k` tokens for each request (fewer, or none, when the draft's pool, token budget or
        max_seq_len do not allow them), by sequence id."""
        active: list[tuple[_Mirror, DraftRequest, int]] = []  # with the tokens of its catch-up computed now
        budget = self.max_num_tokens
        for req in requests:
            if len(active) == self.max_batch_size:
                break  # the draft engine's batch is full: the others do not speculate this step
            mirror = self._sync(req)
            catch_up = len(mirror.token_ids) - mirror.num_computed_tokens
            if req.k < 1 or budget < 1 or len(mirror.token_ids) + req.k > self.max_seq_len:
                continue
            n = min(catch_up, budget)  # d1 .. d(k-1) are computed too once it has caught up
            plan = self.kv.plan_allocation([(mirror, n + (req.k - 1 if n == catch_up else 0), [])])
            if plan.num_kv_blocks > self.kv.pool.num_free:
                self.forget(req.seq_id)  # the pool is full: this sequence does not speculate this step
                continue
            self.kv.allocate(plan)
            budget -= n
            active.append((mirror, req, n))
        return self._run(active)

    def rollback(self, seq_id: int, token_ids: Seq[int]) -> None:
        """After the target's step: the draft's cache keeps the longest prefix of what it computed that the
        sequence still has (accepted drafts; a rejected draft and what follows are dropped)."""
        mirror = self.mirrors.get(seq_id)
        if mirror is None:
            return
        keep = common_prefix(mirror.token_ids[: mirror.num_computed_tokens], token_ids)
        mirror.token_ids = list(token_ids[:keep])
        mirror.num_computed_tokens = keep
        self.kv.truncate(mirror)  # type: ignore[arg-type]

    def forget(self, seq_id: int) -> None:
        """The sequence finished, was preempted or cannot fit: its draft blocks go back."""
        mirror = self.mirrors.pop(seq_id, None)
        if mirror is not None:
            self.kv.free(mirror)  # type: ignore[arg-type]

    def stats(self) -> dict[str, float]:
        return {"spec_decode_draft_kv_blocks_total": self.kv.pool.num_kv_blocks,
                "spec_decode_draft_kv_blocks_free": self.kv.pool.num_free,
                "spec_decode_draft_num_steps": self.num_steps,
                "spec_decode_draft_num_tokens_computed": self.num_tokens_computed,
                "spec_decode_draft_token_cost": self.token_cost}  # fmt: skip

    # ---- internals -------------------------------------------------------------------------------
    def _sync(self, req: DraftRequest) -> _Mirror:
        """The sequence's mirror with its cache cut to the prefix it shares with `req.token_ids` (at least
        the last token is left to compute: its logits give the first proposal)."""
        mirror = self.mirrors.get(req.seq_id)
        if mirror is None:
            mirror = self.mirrors[req.seq_id] = _Mirror(req.seq_id, [], 0)
        keep = common_prefix(mirror.token_ids[: mirror.num_computed_tokens], req.token_ids)
        mirror.num_computed_tokens = min(keep, len(req.token_ids) - 1)
        self.kv.truncate(mirror)  # type: ignore[arg-type]
        mirror.token_ids = list(req.token_ids)
        return mirror

    def _run(self, active: list[tuple[_Mirror, DraftRequest, int]]) -> dict[int, Proposal]:
        """The catch-up step (`n` uncomputed tokens of each sequence, as `propose` budgeted them; those that
        caught up sample d1), then step r computes d_r and samples d_(r+1) for the sequences proposing more
        than r tokens."""
        if not active:
            return {}
        caught_up = [m.num_computed_tokens + n == len(m.token_ids) for m, _, n in active]
        logits = self._step([(m, n) for m, _, n in active], caught_up)
        live = [(m, r) for (m, r, _), done in zip(active, caught_up) if done]
        tokens: dict[int, list[int]] = {m.seq_id: [] for m, _ in live}
        probs: dict[int, list[torch.Tensor]] = {m.seq_id: [] for m, _ in live}
        for round_ in range(max((r.k for _, r in live), default=0)):
            if round_ > 0:
                live = [(m, r) for m, r in live if r.k > round_]
                logits = self._step([(m, 1) for m, _ in live], [True] * len(live))
            for row, (mirror, req) in enumerate(live):
                token, q = self._sample(logits[row], req.params)
                tokens[mirror.seq_id].append(token)
                if q is not None:
                    probs[mirror.seq_id].append(q)
                mirror.token_ids.append(token)  # computed by the next round's step, if there is one
        return {sid: Proposal(tuple(t), torch.stack(probs[sid]) if probs[sid] else None) for sid, t in tokens.items()}

    def _step(self, chunks: list[tuple[_Mirror, int]], wants_logits: list[bool]) -> torch.Tensor:
        """One packed draft step computing `n` tokens of each mirror; logits of the last position of the
        mirrors that want them, in order."""
        step = StepPacker()
        for (mirror, n), wants in zip(chunks, wants_logits):
            start = mirror.num_computed_tokens
            step.add(mirror.token_ids[start : start + n], start, self.kv.block_table(mirror))  # type: ignore[arg-type]
            if wants:
                step.logits_index.append(len(step.input_ids) - 1)
            mirror.num_computed_tokens = start + n
        batch = step.batch()
        self.num_steps += 1
        self.num_tokens_computed += len(step.input_ids)
        return self.runner.step(batch).float().cpu()

    @staticmethod
    def _sample(logits: torch.Tensor, params: SamplingParams) -> tuple[int, Optional[torch.Tensor]]:
        """The draft's token: argmax for a greedy or seeded request, else a draw from q (the request's
        temperature, top-k, top-p and min-p over the draft's logits), returned with q (one-hot on the argmax
        where the draft's logits are not finite: still a distribution the verification can use).

        A seeded request's deterministic proposal is verified with one draw of its own generator per output
        token (`sampler._Target.lazy`), so it returns the tokens it returns without speculation, whatever the
        batch; q and min(1, p/q) would consume the generator by how much it speculated, which the batch decides."""
        if params.greedy or params.seed is not None:
            return int(logits.argmax()), None
        if bool(torch.isfinite(logits).all()):
            q = torch.softmax(filter_logits(logits.unsqueeze(0), [params]), dim=1)[0]
            if float(q.sum()) > 0:
                return int(torch.multinomial(q, 1)), q
        token = int(torch.nan_to_num(logits, nan=float("-inf")).argmax())
        return token, torch.nn.functional.one_hot(torch.tensor(token), logits.shape[0]).float()


def _first_difference(draft: dict[str, int], target: dict[str, int]) -> str:
    """The first token (by the target's ids) whose id differs between two vocabularies, in words."""
    for token, token_id in sorted(target.items(), key=lambda item: item[1]):
        if draft.get(token) != token_id:
            other = draft.get(token)
            return (f"{token!r:.40} is id {token_id} in the target's, "
                    f"{'absent' if other is None else f'id {other}'} in the draft's")
    extra = next(iter(sorted(set(draft) - set(target), key=lambda t: draft[t])))
    return f"{extra!r:.40} (id {draft[extra]}) is in the draft's only"


def check_draft(model: str, target_manifest: Any, target_tokenizer: Any, max_seq_len: int) -> Any:
    """The draft engine dir `model`'s manifest, checked against a target with `target_manifest` and
    `target_tokenizer` before any weight loads: a verified engine dir, the same vocabulary (size and token
    ids), a max_seq_len that covers the target's (`max_seq_len`), one rank. A ValueError naming
    `speculative_config.model` otherwise."""
    from trtpaged.engine_files import verify_engine_dir
    from trtpaged.manifest import EngineDirError, read_manifest
    from trtpaged.runtime.llm import load_tokenizer

    name = "speculative_config.model"
    path = Path(model)
    try:
        manifest = read_manifest(path)
        verify_engine_dir(path, manifest)
        tokenizer = load_tokenizer(path, manifest)
    except (EngineDirError, OSError) as exc:
        raise ValueError(f"{name}: {model!r} is not a usable engine dir ({exc})") from None
    want, got = target_manifest.dims.vocab_size, manifest.dims.vocab_size
    if got != want:
        raise ValueError(f"{name}: the draft engine's vocab_size is {got}, the target's {want}; a draft must share "
                         "the target's tokenizer")  # fmt: skip
    if target_tokenizer is not None and tokenizer.get_vocab() != target_tokenizer.get_vocab():
        raise ValueError(f"{name}: the draft engine's tokenizer maps tokens to other ids than the target's "
                         f"({_first_difference(tokenizer.get_vocab(), target_tokenizer.get_vocab())}); a draft must "
                         "share the target's tokenizer")  # fmt: skip
    if manifest.limits.max_seq_len < max_seq_len:
        raise ValueError(f"{name}: the draft engine's max_seq_len ({manifest.limits.max_seq_len}) is below the "
                         f"target's ({max_seq_len})")  # fmt: skip
    if manifest.tensor_parallel != 1:
        raise ValueError(f"{name}: a draft engine must be built for one rank (tensor_parallel 1), this one has "
                         f"{manifest.tensor_parallel}")  # fmt: skip
    return manifest


def load_draft(model: str, target_dir: Path, target_manifest: Any, target_tokenizer: Any, backend: str, device: str,
               max_seq_len: int, token_cost: Optional[float] = None, checked: Any = None) -> DraftProposer:  # fmt: skip
    """The draft engine dir `model` (checked by `check_draft`, unless `checked` is the manifest it returned) as a
    proposer, its pool the draft's own KV budget. `token_cost`: `speculative_config.draft_token_cost`; None
    estimates it from the engines' weight bytes."""
    from trtpaged.engine_files import held_weight_bytes
    from trtpaged.runtime.runners import load_runner, resolve_num_kv_blocks
    from trtpaged.runtime.speculative import estimate_draft_token_cost

    manifest = checked if checked is not None else check_draft(model, target_manifest, target_tokenizer, max_seq_len)
    if token_cost is None:
        token_cost = estimate_draft_token_cost(held_weight_bytes(Path(model), manifest),
                                               held_weight_bytes(Path(target_dir), target_manifest))  # fmt: skip
    num_kv_blocks = resolve_num_kv_blocks(manifest, device, None)
    runner = load_runner(Path(model), manifest, num_kv_blocks, backend, device)
    limits = manifest.limits
    return DraftProposer(runner, num_kv_blocks, limits.block_size, limits.max_num_tokens, limits.max_seq_len,
                         manifest.dims.vocab_size, str(model), token_cost, limits.max_batch_size)

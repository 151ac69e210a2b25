"""Log-probabilities of a prompt's own tokens (prompt log-probs), from the logits rows of its prefill.

Like the sampler, this only computes: the scheduler stores the results on the request.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from trtpaged.runtime.batch_builder import PromptRows
from trtpaged.runtime.outputs import Logprob, ranked, vocab_ranks


class PromptLogprob(dict):
    """One scored prompt token: {token: `Logprob`} for the prompt token plus the top-k alternatives when asked for
    (a plain dict to every reader), and `rank`, the prompt token's rank in the model's distribution at that
    position (1: the most likely token; tokens of equal log-prob count as ahead, as vLLM counts them; a token
    among the top-k: its place there, as vLLM reports it, so that tied tokens never share a rank)."""

    def __init__(self, items: dict[int, float], rank: int) -> None:
        super().__init__(items)
        self.rank = rank

    def __reduce__(self) -> tuple:  # a copy or pickle keeps the rank
        return (PromptLogprob, (dict(self), self.rank))


def score_prompts(logits: torch.Tensor, spans: Sequence[PromptRows], prompts: dict[str, tuple[list[int], int]]
                  ) -> dict[str, list[Optional[PromptLogprob]]]:  # fmt: skip
    """For each span, one entry per scored token: {token: log-prob} plus the `k` most likely tokens, with the
    token's rank; None for a token whose logits are not finite (NaN is no log-prob to hand anyone; a request
    fails on such logits where it samples).

    `prompts[request_id]` is (prompt token ids, k). The log-softmax is over the raw logits (the model's
    distribution, as vLLM's prompt_logprobs and OpenAI's echo report it)."""
    out: dict[str, list[Optional[PromptLogprob]]] = {}
    for span in spans:
        token_ids, k = prompts[span.request_id]
        rows = logits[span.rows]
        logprobs = torch.log_softmax(rows.float(), dim=1)
        targets = torch.tensor(token_ids[span.first : span.first + len(span.rows)], dtype=torch.long)
        chosen = logprobs.gather(1, targets.unsqueeze(1))
        ranks = vocab_ranks(logprobs, chosen)
        tokens = targets.tolist()
        entries = [PromptLogprob({t: Logprob(lp, rank)}, rank)
                   for t, lp, rank in zip(tokens, chosen.squeeze(1).tolist(), ranks)]  # fmt: skip
        k = min(k, logprobs.shape[1])
        if k > 0:
            values, ids = torch.topk(logprobs, k, dim=1)
            for entry, token, row_ids, row_values in zip(entries, tokens, ids.tolist(), values.tolist()):
                entry.update(ranked(row_ids, row_values))
                if token in row_ids:
                    entry.rank = row_ids.index(token) + 1
        finite = torch.isfinite(rows).all(dim=1).tolist()
        out.setdefault(span.request_id, []).extend(e if ok else None for e, ok in zip(entries, finite))
    return out

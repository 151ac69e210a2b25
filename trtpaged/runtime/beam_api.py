"""vLLM's `LLM.beam_search` call: its parameters and outputs, over trtpaged's beam search (SamplingParams(beam_width)).

The beams are transformers' (ranked as `generate(num_beams=...)` ranks them: log-probability over the generated
length to the length_penalty; vLLM's own divides by the prompt's length too), returned in vLLM's shapes: each
sequence's `tokens` and `text` hold the prompt and the generated tokens, as vLLM's do.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

from trtpaged.errors import RequestError
from trtpaged.runtime.outputs import RequestOutput
from trtpaged.runtime.sampling_params import SamplingParams, python_value


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's beam search settings. Beams are deterministic: temperature must be 0."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):  # NumPy scalars as the Python values they hold, as SamplingParams takes them
            object.__setattr__(self, f.name, python_value(getattr(self, f.name)))
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise RequestError(name, f"must be an integer >= 1, got {value!r:.40}", 1)

    def sampling_params(self) -> SamplingParams:
        if self.temperature != 0.0:
            raise RequestError("temperature", f"beam search here is deterministic: must be 0, got {self.temperature!r}")
        # one beam runs as greedy sampling, whose cumulative_logprob (the beam's cum_logprob) needs logprobs
        return SamplingParams(beam_width=self.beam_width, n=self.beam_width, max_tokens=self.max_tokens,
                              temperature=0.0, ignore_eos=self.ignore_eos, length_penalty=self.length_penalty,
                              include_stop_str_in_output=self.include_stop_str_in_output,
                              logprobs=0 if self.beam_width == 1 else None)  # fmt: skip


@dataclass
class BeamSearchSequence:
    """One beam: `tokens` and `text` are the prompt's and the generated ones together (vLLM's layout)."""

    tokens: list[int]
    logprobs: list[Any] = field(default_factory=list)
    lora_request: None = None
    cum_logprob: float = 0.0
    text: Optional[str] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Any] = None


@dataclass
class BeamSearchOutput:
    """One prompt's beams, best first."""

    sequences: list[BeamSearchSequence]


def beam_outputs(outs: list[RequestOutput], params: BeamSearchParams, tokenizer: Any) -> list[BeamSearchOutput]:
    """`generate`'s beam-search outputs in the shapes of vLLM's offline `LLM.beam_search`: a beam that ended on its
    end token keeps it in `tokens` and `text` (as vLLM's offline call does; its server drops it unless
    include_stop_str_in_output, which is why that field is taken here), with finish_reason "stop" and the token as
    stop_reason (vLLM leaves both None). Per-token log-probs are not kept for beams here (`logprobs` is empty);
    `cum_logprob` is the beam's sum."""
    results = []
    for out in outs:
        sequences = []
        for c in out.outputs:
            ended = c.finish_reason == "stop" and bool(c.token_ids)
            tokens = list(out.prompt_token_ids) + list(c.token_ids)
            text = tokenizer.decode(tokens) if tokenizer is not None else None
            sequences.append(BeamSearchSequence(tokens=tokens, cum_logprob=c.cumulative_logprob, text=text,
                                                finish_reason=c.finish_reason,
                                                stop_reason=c.token_ids[-1] if ended else None))  # fmt: skip
        results.append(BeamSearchOutput(sequences))
    return results

"""Per-request generation settings."""

from __future__ import annotations

from dataclasses import dataclass
import math
from typing import Any, Optional, Union

from trtpaged.errors import RequestError
from trtpaged.runtime.outputs import RequestOutputKind

_GREEDY_EPS = 1e-5  # temperatures below this sample greedily (as vLLM does)

# Bounds on what one request may ask for; each keeps a step's work or arithmetic bounded.
MAX_STOP_STRINGS = 32  # stop strings per request: each is searched for after every token
MAX_STOP_STRING_CHARS = 128  # characters per stop string (and text held back while streaming)
MAX_STOP_TOKEN_IDS = 1024  # stop token ids per request: each sampled token is compared with them
LENGTH_PENALTY_RANGE = (-10.0, 10.0)  # gen_len ** length_penalty stays finite for any max_seq_len < 2**64
REPETITION_PENALTY_RANGE = (0.01, 100.0)  # logits scaled by <= 100x, then by 1/temperature <= 1e5: finite in fp32


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_finite_number(value: Any) -> bool:
    """An int or float that converts to a finite float (a 400-digit int does not)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:
        return False


def _within(value: float, bounds: tuple[float, float]) -> bool:
    return bounds[0] <= value <= bounds[1]


@dataclass(frozen=True)
class SamplingParams:
    """How to generate one request's completions. Invalid values raise `RequestError` naming the field.

    temperature 0 is greedy. `n` parallel samples share the prompt's KV blocks.
    `beam_width` > 1 switches to beam search (deterministic; returns the `n`
    best finished beams), scored like Hugging Face: sum of log-probs divided by
    generated_length ** length_penalty, with `early_stopping` True, False
    (heuristic) or "never".

    Accepted ranges (so that no value can overflow or go NaN inside a step):
    temperature >= 0 (below 1e-5: greedy); top_p in (0, 1]; min_p in [0, 1];
    top_k >= 0 (0 or -1: off); presence_penalty and frequency_penalty in [-2, 2]
    (OpenAI's); repetition_penalty in [0.01, 100]; length_penalty in [-10, 10];
    max_tokens, n, beam_width >= 1 (the engine then bounds them by max_seq_len and
    max_batch_size, before anything is allocated); logprobs >= 0; at most
    32 stop strings of 1..128 characters and 1024 stop token ids.
    """

    max_tokens: Optional[int] = 16  # None: until EOS/stop or max_seq_len
    temperature: float = 1.0
    top_k: int = 0  # 0 (or -1, as in vLLM): off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # HF-style, over prompt and output tokens
    presence_penalty: float = 0.0  # OpenAI-style, over output tokens
    frequency_penalty: float = 0.0
    seed: Optional[int] = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    n: int = 1
    beam_width: int = 1
    length_penalty: float = 1.0
    early_stopping: Union[bool, str] = False
    logprobs: Optional[int] = None  # top-k log-probs per generated token
    skip_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE  # what each step's RequestOutput holds

    def __post_init__(self) -> None:
        stop = () if self.stop is None else (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (list, tuple)):
            raise RequestError("stop", f"must be a str or a list of str, got {self.stop!r:.80}")
        if len(stop) > MAX_STOP_STRINGS:
            raise RequestError("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}", MAX_STOP_STRINGS)
        object.__setattr__(self, "stop", tuple(stop))
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise RequestError("stop", f"every stop string must be a non-empty str, got {s!r:.80}")
            if len(s) > MAX_STOP_STRING_CHARS:
                raise RequestError("stop", f"a stop string may have at most {MAX_STOP_STRING_CHARS} characters, "
                                   f"got {len(s)}", MAX_STOP_STRING_CHARS)  # fmt: skip
        stop_ids = () if self.stop_token_ids is None else self.stop_token_ids
        if isinstance(stop_ids, (list, tuple)) and len(stop_ids) > MAX_STOP_TOKEN_IDS:
            raise RequestError("stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} token ids, got {len(stop_ids)}",
                               MAX_STOP_TOKEN_IDS)  # fmt: skip
        if not isinstance(stop_ids, (list, tuple)) or not all(_is_int(t) for t in stop_ids):
            raise RequestError("stop_token_ids", f"must be token ids (ints), got {self.stop_token_ids!r:.80}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in stop_ids))
        if _is_int(self.top_k) and self.top_k == -1:  # vLLM's spelling of "off"
            object.__setattr__(self, "top_k", 0)
        for name in ("max_tokens", "n", "beam_width", "top_k", "seed", "logprobs"):
            value = getattr(self, name)
            if not _is_int(value) and not (value is None and name in ("max_tokens", "seed", "logprobs")):
                raise RequestError(name, f"must be an integer, got {value!r:.80}")
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty", "length_penalty"):
            value = getattr(self, name)
            if not _is_finite_number(value):
                raise RequestError(name, f"must be a finite number, got {value!r:.80}")
        checks = [  # (field, ok, rule, limit)
            ("max_tokens", self.max_tokens is None or self.max_tokens >= 1, "must be >= 1 (None: up to max_seq_len)", 1),
            ("temperature", self.temperature >= 0.0, "must be >= 0", 0.0),
            ("top_k", self.top_k >= 0, "must be >= 0 (0 or -1 disables it)", 0),
            ("top_p", 0.0 < self.top_p <= 1.0, "must be in (0, 1]", "(0, 1]"),
            ("min_p", 0.0 <= self.min_p <= 1.0, "must be in [0, 1]", "[0, 1]"),
            ("repetition_penalty", _within(self.repetition_penalty, REPETITION_PENALTY_RANGE), "must be in [0.01, 100]",
             "[0.01, 100]"),
            ("length_penalty", _within(self.length_penalty, LENGTH_PENALTY_RANGE), "must be in [-10, 10]",
             "[-10, 10]"),
            ("presence_penalty", -2.0 <= self.presence_penalty <= 2.0, "must be in [-2, 2]", "[-2, 2]"),
            ("frequency_penalty", -2.0 <= self.frequency_penalty <= 2.0, "must be in [-2, 2]", "[-2, 2]"),
            ("n", self.n >= 1, "must be >= 1", 1),
            ("beam_width", self.beam_width >= 1, "must be >= 1", 1),
            ("early_stopping", self.early_stopping in (True, False, "never"), "must be True, False or 'never'", None),
            ("logprobs", self.logprobs is None or self.logprobs >= 0, "must be >= 0", 0),
            ("output_kind", isinstance(self.output_kind, RequestOutputKind), "must be a RequestOutputKind", None),
        ]
        for name, ok, rule, limit in checks:
            if not ok:
                raise RequestError(name, f"{rule}, got {getattr(self, name)!r:.80}", limit)
        if self.use_beam_search:
            if self.n > self.beam_width:
                raise RequestError("n", f"at most beam_width ({self.beam_width}) with beam search, got {self.n}",
                                   self.beam_width)
            if self.stop:
                raise RequestError("stop", "stop strings are not supported with beam search")

    @property
    def use_beam_search(self) -> bool:
        return self.beam_width > 1

    @property
    def greedy(self) -> bool:
        """Temperature 0, or so close to it that dividing the logits by it would overflow (vLLM: < 1e-5)."""
        return self.temperature < _GREEDY_EPS

    @property
    def num_seqs(self) -> int:
        """Sequences the request runs at once after its prompt: beams or parallel samples."""
        return self.beam_width if self.use_beam_search else self.n

"""Per-request generation settings."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
import json
import math
import re
from typing import Any, Collection, Mapping, Optional, Union

import numpy as np

from trtpaged.errors import RequestError, check_no_nul, check_unicode
from trtpaged.runtime.outputs import RequestOutputKind
from trtpaged.runtime.schema_features import subschemas
from trtpaged.runtime.structural_tag import check_string_lengths, check_tag_strings, xgrammar_form
from trtpaged.sampling_defaults import FLOAT32_MAX, REPETITION_PENALTY_RANGE  # a model's defaults are held to them too

_GREEDY_EPS = 1e-5  # temperatures below this sample greedily (as vLLM does)

# Bounds on what one request may ask for; each keeps a step's work or arithmetic bounded.
MAX_STOP_STRINGS = 32  # stop strings per request: each is searched for after every token
MAX_STOP_STRING_CHARS = 128  # characters per stop string (and text held back while streaming)
MAX_STOP_TOKEN_IDS = 1024  # stop token ids per request: each sampled token is compared with them
LENGTH_PENALTY_RANGE = (-10.0, 10.0)  # gen_len ** length_penalty stays finite for any max_seq_len < 2**64
LOGIT_BIAS_RANGE = (-100.0, 100.0)  # OpenAI's
MAX_LOGIT_BIAS = 1024  # biased tokens per request (OpenAI allows 300; vLLM does not bound it)
MAX_ALLOWED_TOKEN_IDS = 1 << 20  # allowed_token_ids per request (a vocabulary's worth)
MAX_BAD_WORDS = 64  # bad words per request: each is matched against the output tail at every sample
MAX_BAD_WORD_CHARS = 128
MAX_GRAMMAR_CHARS = 64 * 1024  # a schema, regex or grammar's text, and the joined choices
# A JSON schema's nesting (objects and arrays): xgrammar's compile time grows faster than the depth (2 cores:
# arrays 64 deep 0.03 s, 256 deep 0.7 s, 900 deep 39 s, in a 25 KB body); real schemas nest under 20.
MAX_SCHEMA_DEPTH = 64
# A structural tag's nesting (objects and arrays), its schemas' included, each of those still at most MAX_SCHEMA_DEPTH:
# xgrammar refuses formats nested past 100, which take up to 200 of these levels (a sequence and its elements)
MAX_STRUCTURAL_TAG_DEPTH = 256
# a schema `pattern`'s repetition bound ({n}, {n,m}): xgrammar compiles a bounded repeat inside a JSON string in
# time about quadratic in it ({1,4000}: 1 s; {1,16000}: 27 s, on 2 cores), where the schema text is 60 bytes
MAX_PATTERN_REPEAT = 1000
_REPEAT = re.compile(r"\{(\d+)(?:,(\d*))?\}")
# and its groups' nesting: xgrammar converts a schema's pattern recursively with no bound of its own (a 60 KB pattern
# of 30000 nested groups overflowed the compiling thread's stack: the server died; 12000 nested alternatives took
# 18 s to compile); a regex (the regex kind, a tag's regex node) may nest 1000, xgrammar's bound there
MAX_PATTERN_NESTING = 1000
MAX_CACHE_SALT_CHARS = 128  # vLLM's limit on cache_salt


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


def python_value(value: Any) -> Any:
    """A NumPy scalar or 1-D array as the Python bool, int, float or list it holds (vLLM's msgspec fields take
    them as they are, and a value read out of an array is one); anything else as it is."""
    if isinstance(value, np.generic) and value.dtype.kind in "biuf":
        return value.item()
    if isinstance(value, np.ndarray) and value.ndim == 1 and value.dtype.kind in "iu":
        return value.tolist()
    return value


def _within(value: float, bounds: tuple[float, float]) -> bool:
    return bounds[0] <= value <= bounds[1]


_STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


def nesting_depth(schema: Union[str, Mapping[str, Any]], limit: int) -> int:
    """How deep objects and arrays nest in a JSON document (its text, or parsed), counted until past `limit`;
    text that does not parse counts 0 (the compile names what is wrong with it)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except RecursionError:  # deeper than the parser's stack: far past any limit
            return limit + 1
        except ValueError:
            return 0
    deepest, todo = 0, [(schema, 1)]
    while todo and deepest <= limit:
        value, depth = todo.pop()
        children = value.values() if isinstance(value, Mapping) else value if isinstance(value, list) else None
        if children is not None:
            deepest = max(deepest, depth)
            todo.extend((child, depth + 1) for child in children)
    return deepest


def _check_schema_depth(field_name: str, schema: Union[str, Mapping[str, Any]], where: str = "") -> None:
    """RequestError naming `field_name` (and the schema's place `where` in it, if any) when the schema nests objects
    and arrays past MAX_SCHEMA_DEPTH."""
    if nesting_depth(schema, MAX_SCHEMA_DEPTH) > MAX_SCHEMA_DEPTH:
        raise RequestError(field_name, f"json schema{' at ' if where else ''}{where} nests objects and arrays more "
                           f"than {MAX_SCHEMA_DEPTH} deep", MAX_SCHEMA_DEPTH)  # fmt: skip


def _check_schema_unicode(field_name: str, schema: Any, where: str = "") -> None:
    """RequestError naming `field_name` (and `where`, the schema's place in it, if any) for a string or name in the
    schema that is no Unicode text (a lone surrogate, as a JSON `\\ud800` escape gives): no output holds it, and
    the grammar compiler took it for malformed JSON. The nesting is bounded before this walk."""
    try:
        json.dumps(schema, ensure_ascii=False).encode("utf-8")
        return
    except UnicodeEncodeError:
        pass
    todo: list[tuple[str, Any]] = [("#", schema)]
    while todo:
        path, node = todo.pop()
        items = node.items() if isinstance(node, Mapping) else enumerate(node) if isinstance(node, list) else ()
        for key, child in items:
            place = f"{path}/{key}".encode("utf-8", "backslashreplace").decode()  # the name may be the fault
            for text in (key, child) if isinstance(key, str) else (child,):
                if isinstance(text, str):
                    check_unicode(field_name, text, f"json schema{' at ' if where else ''}{where} {place}")
            todo.append((place, child))


def _loads_or_none(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None  # the grammar compiler names what is wrong with it


def _group_nesting(pattern: str) -> int:
    """How deep a regex's groups nest: its unescaped parentheses, a "(" in a character class counted too (an
    overcount only for such classes, never an undercount)."""
    depth = deepest = 0
    escaped = False
    for ch in pattern:
        if escaped:
            escaped = False
        elif ch == "\\":
            escaped = True
        elif ch == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif ch == ")":
            depth = max(depth - 1, 0)
    return deepest


def _check_patterns(field_name: str, schema: Any, where: str = "") -> None:
    """RequestError naming `field_name` (and `where`, the schema's place in it, if any) for a `pattern` (or
    patternProperties key) whose repetition bound exceeds MAX_PATTERN_REPEAT or whose groups nest deeper than
    MAX_PATTERN_NESTING (the depth is bounded before this walk)."""
    for path, node in subschemas(schema):
        patterns = [node["pattern"]] if isinstance(node.get("pattern"), str) else []
        if isinstance(node.get("patternProperties"), Mapping):
            patterns += [k for k in node["patternProperties"] if isinstance(k, str)]
        for pattern in patterns:
            bound = max((int(n or 0) for m in _REPEAT.finditer(pattern) for n in m.groups()), default=0)
            if bound > MAX_PATTERN_REPEAT:
                raise RequestError(field_name, f"json schema{' at ' if where else ''}{where} pattern "
                                   f"{pattern[:60]!r} (at {path}) repeats up to {bound} times; at most "
                                   f"{MAX_PATTERN_REPEAT} (use maxLength without a pattern for long strings)",
                                   MAX_PATTERN_REPEAT)  # fmt: skip
            nesting = _group_nesting(pattern)
            if nesting > MAX_PATTERN_NESTING:
                raise RequestError(field_name, f"json schema{' at ' if where else ''}{where} pattern "
                                   f"{pattern[:60]!r} (at {path}) nests groups {nesting} deep; at most "
                                   f"{MAX_PATTERN_NESTING}", MAX_PATTERN_NESTING)  # fmt: skip


@dataclass(frozen=True)
class StructuredOutputsParams:
    """A grammar that constrains a request's output (vLLM's `StructuredOutputsParams`); set exactly one of:
    `json` (a JSON schema, as a dict or its JSON text), `regex`, `choice` (the output is one of these
    strings), `grammar` (EBNF, as xgrammar reads it), `json_object=True` (any JSON object) or `structural_tag`
    (xgrammar's structural tag, `{"type": "structural_tag", "format": {...}}`, or vLLM's legacy
    `{"type": "structural_tag", "structures": [{"begin", "schema", "end"}], "triggers": [...]}`; a mapping or its
    JSON text: `runtime/structural_tag.py`).
    `origin` is the request field that set it, named in errors (e.g. "response_format").
    `starts_after`: the token that opens the constrained part (a reasoning model's end-of-thinking tag, as the
    server's reasoning parser sets it): the output is free until it holds that token, and the grammar holds after.
    vLLM's flags `disable_fallback`, `disable_any_whitespace` and `disable_additional_properties` (bools) are taken
    and change nothing (the one backend is xgrammar; JSON grammars leave no free whitespace, xgrammar's
    any_whitespace=False, which disable_any_whitespace selects in vLLM; a schema's additionalProperties holds);
    `whitespace_pattern` is refused."""

    json: Optional[Union[str, Mapping[str, Any]]] = None
    regex: Optional[str] = None
    choice: Optional[tuple[str, ...]] = None
    grammar: Optional[str] = None
    json_object: bool = False
    structural_tag: Optional[Union[str, Mapping[str, Any]]] = None
    origin: str = field(default="structured_outputs", compare=False)
    starts_after: Optional[int] = None
    disable_fallback: bool = field(default=False, compare=False)
    disable_any_whitespace: bool = field(default=False, compare=False)
    disable_additional_properties: bool = field(default=False, compare=False)
    whitespace_pattern: Optional[str] = None
    # a structural tag as xgrammar's form (JSON text), and the JSON schemas in it with their places, set when checked
    _tag_json: Optional[str] = field(default=None, init=False, repr=False, compare=False)
    _tag_schemas: tuple[tuple[str, Any], ...] = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        name = self.origin
        after = self.starts_after
        if after is not None and not (_is_int(after) and after >= 0):
            raise RequestError(name, f"starts_after must be a token id, got {after!r:.80}")
        for flag in ("disable_fallback", "disable_any_whitespace", "disable_additional_properties"):
            if not isinstance(getattr(self, flag), bool):
                raise RequestError(f"{name}.{flag}", f"must be true or false, got {getattr(self, flag)!r:.40}")
        if self.whitespace_pattern is not None:
            raise RequestError(f"{name}.whitespace_pattern", "not supported: JSON grammars here leave no free "
                               "whitespace")  # fmt: skip
        given = [k for k in _STRUCTURED_KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise RequestError(name, f"set exactly one of {', '.join(_STRUCTURED_KINDS)}, got {given or 'none'}")
        if self.json is not None:
            if isinstance(self.json, Mapping):
                _check_schema_depth(name, self.json)  # first: json.dumps recurses through the nesting
                try:
                    text = json.dumps(self.json, sort_keys=True)
                except (TypeError, ValueError) as exc:
                    raise RequestError(name, f"json schema is not JSON ({exc})") from None
            elif isinstance(self.json, str):
                text = self.json
            else:
                raise RequestError(name, "json must be a schema object or its JSON text, "
                                         f"got {type(self.json).__name__}")
            if len(text) > MAX_GRAMMAR_CHARS:
                raise RequestError(name, f"json schema of {len(text)} characters exceeds {MAX_GRAMMAR_CHARS}",
                                   MAX_GRAMMAR_CHARS)
            if isinstance(self.json, str):
                _check_schema_depth(name, text)
            schema = self.json if isinstance(self.json, Mapping) else _loads_or_none(text)
            _check_schema_unicode(name, schema)
            _check_patterns(name, schema)
        for kind in ("regex", "grammar"):
            value = getattr(self, kind)
            if value is not None and (not isinstance(value, str) or not value):
                raise RequestError(name, f"{kind} must be a non-empty string, got {value!r:.80}")
            if value is not None and len(value) > MAX_GRAMMAR_CHARS:
                raise RequestError(name, f"{kind} of {len(value)} characters exceeds {MAX_GRAMMAR_CHARS}",
                                   MAX_GRAMMAR_CHARS)
        if self.grammar is not None:  # xgrammar's EBNF parser ends the text at a NUL, dropping the rest unread
            check_no_nul(name, self.grammar, "grammar")
        if self.choice is not None:
            choice = self.choice
            if not isinstance(choice, (list, tuple)) or not choice or not all(isinstance(c, str) and c for c in choice):
                raise RequestError(name, f"choice must be a non-empty list of non-empty strings, got {choice!r:.80}")
            if sum(len(c) for c in choice) > MAX_GRAMMAR_CHARS:
                raise RequestError(name, f"choices exceed {MAX_GRAMMAR_CHARS} characters in all", MAX_GRAMMAR_CHARS)
            for i, text in enumerate(choice):
                place = f"choice[{i}]"
                check_no_nul(name, check_unicode(name, text, place), place)
            object.__setattr__(self, "choice", tuple(choice))
        if not isinstance(self.json_object, bool):
            raise RequestError(name, f"json_object must be a bool, got {self.json_object!r:.80}")
        if self.structural_tag is not None:
            text, schemas = _checked_structural_tag(name, self.structural_tag)
            object.__setattr__(self, "_tag_json", text)
            object.__setattr__(self, "_tag_schemas", schemas)

    @property
    def kind(self) -> str:
        return next(k for k in _STRUCTURED_KINDS if getattr(self, k) not in (None, False))

    @property
    def structural_tag_json(self) -> Optional[str]:
        """The structural tag as xgrammar's `{"type": "structural_tag", "format": ...}` JSON text (the legacy form
        as the triggered_tags format it stands for); None for the other kinds."""
        return self._tag_json

    @property
    def structural_tag_schemas(self) -> tuple[tuple[str, Any], ...]:
        """The JSON schemas in the structural tag, each with its place in the tag as given
        (`format.elements[1].json_schema`, `structures[0].schema`)."""
        return self._tag_schemas

    def key(self) -> tuple[str, str]:
        """What identifies the compiled grammar (the grammar cache's key)."""
        kind = self.kind
        if kind == "json":  # in its own key order: the grammar generates properties in that order
            value = self.json if isinstance(self.json, str) else json.dumps(self.json)
        elif kind == "choice":
            value = json.dumps(self.choice)
        elif kind == "json_object":
            value = ""
        elif kind == "structural_tag":
            value = self._tag_json
        else:
            value = getattr(self, kind)
        return kind, value  # type: ignore[return-value]


def _checked_structural_tag(name: str, value: Any) -> tuple[str, tuple[tuple[str, Any], ...]]:
    """A structural tag (a mapping or its JSON text) checked as a JSON schema is (size, nesting, and each schema in it
    as the json kind's), as xgrammar's form: its JSON text and the schemas in it (`structural_tag.xgrammar_form`).
    Errors name `name`; what xgrammar refuses is found when it compiles."""
    if isinstance(value, Mapping):
        _check_tag_depth(name, value)  # first: json.dumps recurses
        try:
            text = json.dumps(value)
        except (TypeError, ValueError) as exc:
            raise RequestError(name, f"structural tag is not JSON ({exc})") from None
        document: Any = value
    elif isinstance(value, str):
        text = value
    else:
        raise RequestError(name, f"structural_tag must be a structural tag object or its JSON text, got "
                           f"{type(value).__name__}")  # fmt: skip
    if len(text) > MAX_GRAMMAR_CHARS:
        raise RequestError(name, f"structural tag of {len(text)} characters exceeds {MAX_GRAMMAR_CHARS}",
                           MAX_GRAMMAR_CHARS)  # fmt: skip
    if isinstance(value, str):
        try:
            document = json.loads(text)  # once: the depth is checked on the parsed tag
        except RecursionError:  # deeper than the parser's stack: far past the limit, which this names
            _check_tag_depth(name, text)
            raise
        except ValueError as exc:
            raise RequestError(name, f"invalid structural_tag: not JSON ({exc})") from None
        _check_tag_depth(name, document)
    tag, schemas = xgrammar_form(name, document)
    for where, schema in schemas:
        _check_schema_depth(name, schema, where)
        _check_schema_unicode(name, schema, where)
        _check_patterns(name, schema, where)
    check_string_lengths(name, tag["format"])
    check_tag_strings(name, tag["format"])
    return json.dumps(tag), tuple(schemas)


def _check_tag_depth(name: str, tag: Union[str, Mapping[str, Any]]) -> None:
    if nesting_depth(tag, MAX_STRUCTURAL_TAG_DEPTH) > MAX_STRUCTURAL_TAG_DEPTH:
        raise RequestError(name, f"structural tag nests objects and arrays more than {MAX_STRUCTURAL_TAG_DEPTH} deep",
                           MAX_STRUCTURAL_TAG_DEPTH)  # fmt: skip


def GuidedDecodingParams(json: Any = None, regex: Optional[str] = None, choice: Any = None,  # noqa: N802
                         grammar: Optional[str] = None, json_object: Optional[bool] = None,
                         backend: Optional[str] = None,
                         whitespace_pattern: Optional[str] = None,
                         structural_tag: Optional[Union[str, Mapping[str, Any]]] = None,
                         **flags: Any) -> StructuredOutputsParams:  # fmt: skip
    """vLLM <= 0.10's `GuidedDecodingParams` (for `SamplingParams(guided_decoding=...)`), as the
    `StructuredOutputsParams` it became: the backend is xgrammar ("auto" and "xgrammar" are taken), and
    whitespace_pattern is refused; its disable_* flags (bools) change nothing here (JSON is compact and a schema's
    additionalProperties holds)."""
    if whitespace_pattern is not None:
        raise RequestError("guided_decoding.whitespace_pattern", "not supported")
    if backend not in (None, "auto", "xgrammar"):
        raise RequestError("guided_decoding.backend", f"only xgrammar here, got {backend!r:.40}")
    for key, value in flags.items():
        if key not in ("disable_fallback", "disable_any_whitespace", "disable_additional_properties"):
            raise TypeError(f"GuidedDecodingParams got an unexpected argument {key!r}")
        if not isinstance(value, bool):
            raise RequestError(f"guided_decoding.{key}", f"must be true or false, got {value!r:.40}")
    return StructuredOutputsParams(json=json, regex=regex, choice=choice, grammar=grammar,
                                   json_object=bool(json_object), structural_tag=structural_tag,
                                   origin="guided_decoding")  # fmt: skip


@dataclass
class SamplingParams:
    """How to generate one request's completions. Invalid values raise `RequestError` naming the field.

    temperature 0 is greedy. `n` parallel samples share the prompt's KV blocks.
    `beam_width` > 1 switches to beam search (deterministic; returns the `n`
    best finished beams), scored like Hugging Face: sum of log-probs divided by
    generated_length ** length_penalty, with `early_stopping` True, False
    (heuristic) or "never".

    NumPy scalars (and 1-D integer arrays of token ids) are taken as the Python values they hold.

    Accepted ranges (so that no value can overflow or go NaN inside a step):
    temperature in [0, 3.4e38] (below 1e-5: greedy); top_p in (0, 1]; min_p in [0, 1];
    top_k >= 0 (0 or -1: off); presence_penalty and frequency_penalty in [-2, 2]
    (OpenAI's); repetition_penalty in [0.01, 100]; length_penalty in [-10, 10];
    max_tokens, n, beam_width >= 1 (the engine then bounds them by max_seq_len and
    max_batch_size, before anything is allocated); logprobs, prompt_logprobs >= 0 (or -1: the vocabulary); at most
    32 stop strings of 1..128 characters and 1024 stop token ids; logit_bias: at most 1024
    token ids, each biased by [-100, 100]; at most 64 bad words of 1..128 characters; `cache_salt`: 1..128
    characters; thinking_token_budget in [0, 2**31). The token filters, `thinking_token_budget`,
    `structured_outputs`, `top_k`, `top_p`, `min_p` and `logprobs` are refused with beam search; its penalties
    apply to the beams' log-probs, as HF's logits processors do; temperature and seed do not apply (beams are
    deterministic).
    """

    max_tokens: Optional[int] = 16  # None: until EOS/stop or max_seq_len
    temperature: float = 1.0
    top_k: int = 0  # 0 (or -1, as in vLLM): off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # HF-style, over prompt and output tokens
    presence_penalty: float = 0.0  # OpenAI-style, over output tokens
    frequency_penalty: float = 0.0
    seed: Optional[int] = None  # -1 (vLLM's spelling): None, the shared RNG
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    n: int = 1
    beam_width: int = 1
    length_penalty: float = 1.0
    early_stopping: Union[bool, str] = False
    logprobs: Optional[int] = None  # top-k log-probs per generated token
    prompt_logprobs: Optional[int] = None  # log-probs of the prompt's own tokens (+ top-k), from the prefill
    logit_bias: Optional[Mapping[int, float]] = None  # token id -> added to its logit, in [-100, 100]
    allowed_token_ids: Optional[tuple[int, ...]] = None  # only these may be sampled
    bad_words: tuple[str, ...] = ()  # never generated (their last token is masked where the rest matches)
    structured_outputs: Optional[StructuredOutputsParams] = None  # a grammar the output must follow
    skip_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE  # what each step's RequestOutput holds
    # DELTA outputs only: a running sequence's new tokens are handed over once it has this many (its first
    # token and its end at once); 1: every step. `trtpaged serve --stream-interval` sets it for streams.
    stream_interval: int = 1
    # vLLM's: EOS and the stop token ids cannot be sampled, and stop strings do not end the output, before this
    # many output tokens
    min_tokens: int = 0
    # vLLM's: after this many tokens of reasoning, the reasoning model's end tag is forced (an engine with a
    # reasoning parser: LLM(reasoning_parser=...), serve --reasoning-parser); None: no budget
    thinking_token_budget: Optional[int] = None
    # vLLM's: the request shares prefix-cache blocks (in the pool and the KV tiers) only with requests of the same
    # salt; None shares with the other unsalted ones. A secret per tenant keeps one from timing another's prompts.
    cache_salt: Optional[str] = None
    # vLLM's: keep only the prompt's last k tokens (-1: as many as max_seq_len holds beside max_tokens)
    truncate_prompt_tokens: Optional[int] = None
    detokenize: bool = True  # vLLM's: False leaves every output's text empty (token ids only; no stop strings)
    # vLLM's, taken for scripts that pass them: the tokenizers here are fast ones, whose decode puts no spaces
    # between special tokens either way; extra_args are for custom samplers (there are none here)
    spaces_between_special_tokens: bool = True
    extra_args: Optional[Mapping[str, Any]] = None
    best_of: Optional[int] = None  # vLLM's (V0): only None or n without beam search (vLLM V1 dropped best_of)
    logits_processors: Optional[tuple[Any, ...]] = None  # vLLM's: only None or empty (no Python hooks in a step)
    guided_decoding: Optional[StructuredOutputsParams] = None  # vLLM <= 0.10's name of structured_outputs

    @classmethod
    def from_optional(cls, **kwargs: Any) -> "SamplingParams":
        """vLLM's constructor in which None means the default."""
        return cls(**{k: v for k, v in kwargs.items() if v is not None})

    def clone(self) -> "SamplingParams":
        """A checked copy (vLLM's)."""
        return dataclasses.replace(self)

    def __post_init__(self) -> None:
        self._take_numpy_values()
        guided = self.guided_decoding
        if guided is not None:
            if not isinstance(guided, StructuredOutputsParams):
                raise RequestError("guided_decoding", f"must be a GuidedDecodingParams, got {type(guided).__name__}")
            given = self.structured_outputs
            if given is not None and given is not guided and given.origin != "guided_decoding":
                raise RequestError("guided_decoding", "give structured_outputs or guided_decoding (its old name), "
                                   "not both")  # fmt: skip
            object.__setattr__(self, "structured_outputs", guided)  # and guided_decoding still reads it, as in vLLM
        self._check_vllm_fields()
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
            check_unicode("stop", s)  # a lone surrogate, which no output text can hold
        stop_ids = () if self.stop_token_ids is None else self.stop_token_ids
        if isinstance(stop_ids, (list, tuple)) and len(stop_ids) > MAX_STOP_TOKEN_IDS:
            raise RequestError("stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} token ids, got {len(stop_ids)}",
                               MAX_STOP_TOKEN_IDS)  # fmt: skip
        if not isinstance(stop_ids, (list, tuple)) or not all(_is_int(t) for t in stop_ids):
            raise RequestError("stop_token_ids", f"must be token ids (ints), got {self.stop_token_ids!r:.80}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in stop_ids))
        if _is_int(self.top_k) and self.top_k == -1:  # vLLM's spelling of "off"
            object.__setattr__(self, "top_k", 0)
        if _is_int(self.seed) and self.seed == -1:  # vLLM's spelling of "no seed": the shared RNG
            object.__setattr__(self, "seed", None)
        if _is_int(self.thinking_token_budget) and self.thinking_token_budget == -1:  # vLLM's "no budget"
            object.__setattr__(self, "thinking_token_budget", None)
        self._check_token_filters()
        for name in ("max_tokens", "n", "beam_width", "top_k", "seed", "logprobs", "prompt_logprobs",
                     "stream_interval", "min_tokens", "thinking_token_budget"):
            value = getattr(self, name)
            if not _is_int(value) and not (value is None and name in ("max_tokens", "seed", "logprobs",
                                                                       "prompt_logprobs", "thinking_token_budget")):
                raise RequestError(name, f"must be an integer, got {value!r:.80}")
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty", "length_penalty"):
            value = getattr(self, name)
            if not _is_finite_number(value):
                raise RequestError(name, f"must be a finite number, got {value!r:.80}")
        checks = [  # (field, ok, rule, limit)
            ("max_tokens", self.max_tokens is None or self.max_tokens >= 1, "must be >= 1 (None: up to max_seq_len)",
             1),
            # the sampler divides float32 logits by it: a larger one is inf there, and every filter and mask NaN
            ("temperature", 0.0 <= self.temperature <= FLOAT32_MAX, "must be in [0, 3.4e38] (finite in float32)",
             "[0, 3.4e38]"),
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
            ("logprobs", self.logprobs is None or self.logprobs >= -1, "must be >= 0 (or -1: the whole vocabulary)", 0),
            ("prompt_logprobs", self.prompt_logprobs is None or self.prompt_logprobs >= -1,
             "must be >= 0 (or -1: the whole vocabulary)", 0),
            ("output_kind", isinstance(self.output_kind, RequestOutputKind), "must be a RequestOutputKind", None),
            ("stream_interval", self.stream_interval >= 1, "must be >= 1", 1),
            ("min_tokens", self.min_tokens >= 0 and (self.max_tokens is None or self.min_tokens <= self.max_tokens),
             "must be in [0, max_tokens]", "[0, max_tokens]"),
            ("thinking_token_budget", self.thinking_token_budget is None or 0 <= self.thinking_token_budget < 2**31,
             "must be in [0, 2**31) (or -1: no budget)", "[0, 2**31)"),
            # a 64-bit generator seed; wider values would wrap onto another seed's draws (vLLM's int64 range)
            ("seed", self.seed is None or -(2**63) <= self.seed < 2**63, "must be in [-2**63, 2**63)",
             "[-2**63, 2**63)"),
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
            if self.min_tokens:
                raise RequestError("min_tokens", "not supported with beam search")
            if self.thinking_token_budget is not None:
                raise RequestError("thinking_token_budget", "not supported with beam search")
            # beams follow the model's log-probs (HF's num_beams without sampling): a filter on which tokens may be
            # drawn would not change them, so it is refused rather than ignored (vLLM's beam search refused them too)
            for name, off in (("top_k", self.top_k == 0), ("top_p", self.top_p == 1.0),  # top_k -1 is 0 by now
                              ("min_p", self.min_p == 0.0)):
                if not off:
                    raise RequestError(name, f"not applied by beam search (deterministic), got {getattr(self, name)!r}"
                                       " (leave it at its default)")  # fmt: skip
            if self.logprobs is not None:
                raise RequestError("logprobs", "per-token log-probs are not kept for beams (each beam's "
                                   "cumulative_logprob is its score)")  # fmt: skip
            for name in ("structured_outputs", "logit_bias", "allowed_token_ids", "bad_words"):
                if getattr(self, name):
                    what = self.structured_outputs.origin if name == "structured_outputs" else name  # type: ignore
                    raise RequestError(what, "not supported with beam search (use n samples instead)")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise RequestError("structured_outputs", "must be a StructuredOutputsParams")
        salt = self.cache_salt
        if salt is not None:
            if not isinstance(salt, str) or not 1 <= len(salt) <= MAX_CACHE_SALT_CHARS:
                got = f"{len(salt)} characters" if isinstance(salt, str) else type(salt).__name__
                raise RequestError("cache_salt", f"must be a string of 1 to {MAX_CACHE_SALT_CHARS} characters (or "
                                   f"None), got {got}", MAX_CACHE_SALT_CHARS)  # fmt: skip
            check_unicode("cache_salt", salt)

    def _take_numpy_values(self) -> None:
        """NumPy scalars (and 1-D integer arrays of token ids) as the Python values the checks below take."""
        for f in dataclasses.fields(self):  # cheap tests first: every request's params pass here, most plain
            value = getattr(self, f.name)
            if isinstance(value, (np.generic, np.ndarray)):
                value = python_value(value)
            elif isinstance(value, (list, tuple)) and any(isinstance(v, np.generic) for v in value):
                value = type(value)(python_value(v) for v in value)
            elif f.name == "logit_bias" and isinstance(value, Mapping):
                value = {python_value(k): python_value(v) for k, v in value.items()}
            else:
                continue
            object.__setattr__(self, f.name, value)

    def _check_vllm_fields(self) -> None:
        for name in ("detokenize", "spaces_between_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise RequestError(name, f"must be true or false, got {getattr(self, name)!r:.80}")
        k = self.truncate_prompt_tokens
        if k is not None and (not _is_int(k) or not (k >= 1 or k == -1)):
            raise RequestError("truncate_prompt_tokens", f"must be an integer >= 1 or -1, got {k!r:.80}", 1)
        if not self.detokenize and self.stop:
            raise RequestError("stop", "stop strings need the text: not with detokenize=False")
        if self.extra_args is not None and not isinstance(self.extra_args, Mapping):
            raise RequestError("extra_args", f"must be a mapping, got {type(self.extra_args).__name__}")
        beams = _is_int(self.beam_width) and self.beam_width > 1
        wanted = self.beam_width if beams else self.n  # beam search: the beams (vLLM V0's best_of)
        if self.best_of is not None and (not _is_int(self.best_of) or self.best_of != wanted):
            raise RequestError("best_of", f"only {wanted} ({'beam_width' if beams else 'n'}) is "
                               f"supported, got {self.best_of!r:.80} (vLLM V1 dropped best_of; use n, or beam_width "
                               "for beam search)", wanted)  # fmt: skip
        if self.logits_processors:
            raise RequestError("logits_processors", "Python logits processors are not supported (use logit_bias, "
                               "allowed_token_ids, bad_words or structured_outputs)")  # fmt: skip

    def _check_token_filters(self) -> None:
        """logit_bias, allowed_token_ids and bad_words: types, counts and ranges (token ids against the
        vocabulary are checked by the engine, which knows it)."""
        bias = self.logit_bias
        if bias is not None:
            if not isinstance(bias, Mapping):
                raise RequestError("logit_bias", f"must map token ids to biases, got {type(bias).__name__}")
            if len(bias) > MAX_LOGIT_BIAS:
                raise RequestError("logit_bias", f"at most {MAX_LOGIT_BIAS} tokens, got {len(bias)}", MAX_LOGIT_BIAS)
            for token, value in bias.items():
                if not _is_int(token) or token < 0:
                    raise RequestError("logit_bias", f"keys must be token ids (ints >= 0), got {token!r:.80}")
                if not _is_finite_number(value) or not _within(float(value), LOGIT_BIAS_RANGE):
                    raise RequestError("logit_bias", f"biases must be numbers in [-100, 100], got {value!r:.80} "
                                       f"for token {token}", "[-100, 100]")  # fmt: skip
            object.__setattr__(self, "logit_bias", {int(t): float(v) for t, v in bias.items()} or None)
        allowed = self.allowed_token_ids
        if allowed is not None:
            if not isinstance(allowed, (list, tuple)) or not allowed or not all(_is_int(t) and t >= 0 for t in allowed):
                raise RequestError("allowed_token_ids", f"must be a non-empty list of token ids, got {allowed!r:.80}")
            if len(allowed) > MAX_ALLOWED_TOKEN_IDS:
                raise RequestError("allowed_token_ids", f"at most {MAX_ALLOWED_TOKEN_IDS} ids, got {len(allowed)}",
                                   MAX_ALLOWED_TOKEN_IDS)  # fmt: skip
            object.__setattr__(self, "allowed_token_ids", tuple(int(t) for t in allowed))
        words = (() if self.bad_words is None else (self.bad_words,) if isinstance(self.bad_words, str)
                 else self.bad_words)  # fmt: skip
        if not isinstance(words, (list, tuple)) or not all(isinstance(w, str) and w for w in words):
            raise RequestError("bad_words", f"must be a list of non-empty strings, got {self.bad_words!r:.80}")
        if len(words) > MAX_BAD_WORDS or any(len(w) > MAX_BAD_WORD_CHARS for w in words):
            raise RequestError("bad_words", f"at most {MAX_BAD_WORDS} words of at most {MAX_BAD_WORD_CHARS} "
                               "characters", MAX_BAD_WORDS)  # fmt: skip
        object.__setattr__(self, "bad_words", tuple(words))

    def stop_reason_of(self, token: int, eos_token_ids: Collection[int]) -> Optional[int]:
        """The stop reason of an output that ended on `token`: its id when it is one of stop_token_ids; none for
        the model's own end (EOS, also when listed in stop_token_ids; a grammar's end), as in vLLM, which looks
        for EOS first."""
        if not self.ignore_eos and token in eos_token_ids:
            return None
        return token if token in self.stop_token_ids else None

    def shows_end_token(self, finish_reason: Optional[str]) -> bool:
        """Whether an output's last token is part of its text: not when it ended on a token (finish "stop" before
        any stop string is looked for) unless include_stop_str_in_output, as in vLLM."""
        return finish_reason != "stop" or self.include_stop_str_in_output

    @property
    def filters_tokens(self) -> bool:
        """Whether something besides the model and penalties decides which tokens may be sampled."""
        return bool(self.logit_bias or self.allowed_token_ids is not None or self.bad_words
                    or self.structured_outputs is not None or self.min_tokens
                    or self.thinking_token_budget is not None)  # fmt: skip

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

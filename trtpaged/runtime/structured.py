"""Grammar-constrained decoding on xgrammar (the engine vLLM, SGLang and TensorRT-LLM use).

`GrammarCache` compiles a request's `StructuredOutputsParams` once per distinct grammar (LRU)
against the engine's tokenizer; each constrained sequence then holds its own
`xgrammar.GrammarMatcher`. The sampler only reads matchers (`mask_logits` fills the
allowed-token bitmask of the constrained rows and applies it); the scheduler advances
them with the tokens it appends. A preemption by recompute keeps a sequence's tokens, so
its matcher stays in step without a rollback. Matcher calls run on the engine thread, so each is timed
(`TimedMatcher`): an ambiguous grammar whose parser states multiply with every token (nested repeats such as
`(([a-z]{1,50}){50}){50}`, as a regex, EBNF or a structural tag) ends its request instead of stalling every other.
"""

from __future__ import annotations

import copy
import json
import re
import threading
import time
from collections import OrderedDict
from typing import Any, Mapping, Optional, Sequence

import torch

from trtpaged.errors import RequestError
from trtpaged.runtime.grammar_text import with_free_text_written_out, with_regexes_expanded, without_surrogates
from trtpaged.runtime.sampling_params import StructuredOutputsParams
from trtpaged.runtime.schema_features import has_string_length, subschemas, unenforced_feature
from trtpaged.runtime.schema_formats import FORMAT_PATTERNS, formats_as_patterns
from trtpaged.runtime.structural_tag import schema_nodes, schema_style, tag_strings

DEFAULT_CACHE_SIZE = 256  # distinct compiled grammars kept
# and their memory (xgrammar's memory_size_bytes): a 64 KiB schema compiles to up to about 5 MB for a 49k vocabulary,
# so 256 distinct ones could hold more than a GiB
DEFAULT_CACHE_BYTES = 256 << 20
# CPU seconds one matcher call (a token's allowed set, or accepting a token) may take: a JSON schema's take well under
# a millisecond; an ambiguous grammar's grow with each token (0.03 s, 0.2, 0.5, 1.4, 3.6, 5 s a call by the 18th for
# three nested 50-repeats), on the engine thread, holding up every running request. Thread CPU time, not wall time:
# a call the OS puts off is not the grammar's cost.
MATCHER_CALL_BUDGET_S = 0.25
# and on average over a request's calls, once they have spent a second (calls just under the budget, every token)
MATCHER_MEAN_BUDGET_S = 0.02
_XGR_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")
_UNREAD_TAG_DISPATCH = "Exclude string must not be a prefix of trigger string"  # xgrammar 0.2.9's grammar parser
_XGR_CHECK = re.compile(r"^Check failed: \(.*?\) is false:\s*")  # the assertion that carries a structural tag's reason


# xgrammar 0.2.9 writes a string with minLength / maxLength as a bounded repeat of this character class, which lets
# the control characters U+0000-U+001F through unescaped: the output is no JSON (its plain strings exclude them).
# Such a schema's grammar is compiled from its EBNF with the character class JSON allows there (escapes stay out, as
# that form has them); `without_surrogates` then takes the surrogate code points out of it, as out of every class.
_LENGTH_BOUNDED_CHARACTER = '[^\\"\\\\\\r\\n]'
_JSON_STRING_CHARACTER = '[^\\"\\\\\\0-\\x1f]'
# json_schema styles whose strings' patterns xgrammar writes as rules of its own (never the Regex macro): a Gemma
# string keeps its delimiter <|"|> out of the pattern's text; a hidden_pattern stand-in there became the value itself
_OWN_PATTERN_STYLES = ("gemma",)
# and the formats held as patterns there: hostname's pattern as such rules took 2.5 s to compile on SmolLM2's
# vocabulary (0.01 s as xgrammar's format, 0.35 s as the macro written out), so it keeps xgrammar's format there
_OWN_PATTERN_FORMATS = tuple(fmt for fmt in FORMAT_PATTERNS if fmt != "hostname")
# the rule of a length-bounded string's character, and the string (the rule between quotes): only there, since a regex
# or an EBNF grammar in a structural tag may write the same class and mean it. xgrammar names the rule after the
# string's place: a $defs name keeps its - and . (`defs_Short-Name_characters`), and a name a structural tag's
# earlier schema took gets a number (`root_characters_1`)
_CHARACTERS = r"[\w.-]+_characters(?:_\d+)?"
_LENGTH_BOUNDED_RULE = re.compile(rf"^({_CHARACTERS}) ::= \(\({re.escape(_LENGTH_BOUNDED_CHARACTER)}\)\)$", re.M)
_LENGTH_BOUNDED_STRING = re.compile(rf'"\\"" ({_CHARACTERS})\{{\d+, -?\d+\}} "\\""')


def mended_schema_grammar(schema: str, strict_mode: bool = True) -> str:
    """xgrammar's grammar (EBNF text) for a JSON schema, its length-bounded strings' character class replaced by
    `_JSON_STRING_CHARACTER`, every class without the surrogate code points, and the formats xgrammar writes too
    loosely compiled as their patterns (`schema_formats.formats_as_patterns`)."""
    import xgrammar as xgr

    schema = _schema_formats_as_patterns(schema)
    grammar = str(xgr.Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=strict_mode))
    return without_surrogates(with_regexes_expanded(_json_string_characters(grammar)))


def mended_structural_tag_grammar(tag: Mapping[str, Any]) -> str:
    """xgrammar's grammar (EBNF text) for a structural tag (xgrammar's form, parsed), its JSON schemas'
    length-bounded strings' character class replaced by `_JSON_STRING_CHARACTER`, its free text written out as
    classes (`with_free_text_written_out`) and every class without the surrogate code points (as
    `mended_schema_grammar`); its schemas' formats as `tag_formats_as_patterns` has them."""
    import xgrammar as xgr

    grammar = with_regexes_expanded(_json_string_characters(str(xgr.Grammar.from_structural_tag(json.dumps(tag)))),
                                    _tag_patterns(tag))  # fmt: skip
    return without_surrogates(with_free_text_written_out(grammar))


def _tag_patterns(tag: Mapping[str, Any]) -> set[str]:
    """The patterns of the JSON schemas in a parsed structural tag (their `hidden_pattern` stand-ins once
    `tag_formats_as_patterns` has rewritten it)."""
    fmt = tag.get("format")
    return {node["pattern"] for _, tagged in schema_nodes(fmt) for _, node in subschemas(tagged["json_schema"])
            if isinstance(node.get("pattern"), str)}  # fmt: skip


def _json_string_characters(grammar: str) -> str:
    """`grammar` with the character rule of each length-bounded JSON string (xgrammar's `"\\"" R{m, n} "\\""`, R
    the class `_LENGTH_BOUNDED_CHARACTER`) made `_JSON_STRING_CHARACTER`; the same class elsewhere (a regex, an EBNF
    grammar, a raw XML value) is left as written."""
    strings = set(_LENGTH_BOUNDED_STRING.findall(grammar))
    return _LENGTH_BOUNDED_RULE.sub(lambda rule: f"{rule.group(1)} ::= (({_JSON_STRING_CHARACTER}))"
                                    if rule.group(1) in strings else rule.group(0), grammar)  # fmt: skip


def _schema_formats_as_patterns(schema: str) -> str:
    """A JSON schema's text with its loose formats as patterns (`formats_as_patterns`); the text itself where it
    has none (or is no JSON: xgrammar names the fault)."""
    try:
        parsed = json.loads(schema)
    except ValueError:
        return schema
    rewritten = formats_as_patterns(parsed)
    return schema if rewritten is parsed else json.dumps(rewritten)


def tag_formats_as_patterns(tag: Mapping[str, Any]) -> Mapping[str, Any]:
    """A structural tag (xgrammar's form, parsed) with the loose formats and patterns of each JSON schema in it
    (`structural_tag.schema_nodes`: json_schema and qwen_xml_parameter nodes) rewritten by `formats_as_patterns`
    (the patterns of a style in `_OWN_PATTERN_STYLES` left as written, its formats but hostname as patterns): a
    copy, or the tag itself where they have none."""
    nodes = schema_nodes(tag.get("format"))
    rewritten = [formats_as_patterns(node["json_schema"], hidden=schema_style(node) not in _OWN_PATTERN_STYLES,
                                     formats=_OWN_PATTERN_FORMATS if schema_style(node) in _OWN_PATTERN_STYLES
                                     else FORMAT_PATTERNS) for _, node in nodes]  # fmt: skip
    if all(schema is node["json_schema"] for schema, (_, node) in zip(rewritten, nodes)):
        return tag
    tag = copy.deepcopy(tag)
    for schema, (_, node) in zip(rewritten, schema_nodes(tag.get("format"))):
        node["json_schema"] = schema  # type: ignore[index] - a copy, ours to change
    return tag


def special_token_ids(tokenizer: Any) -> set[int]:
    """The ids of `tokenizer`'s special tokens: its named ones (bos, eos, pad, ...) and every added token marked
    special (SmolLM2's `<file_sep>`), the ones a decode with skip_special_tokens drops."""
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return set(getattr(tokenizer, "all_special_ids", ()) or ()) | {i for i, token in added.items()
                                                                   if getattr(token, "special", False)}  # fmt: skip


# what a special token's text starts with in the compiler's vocabulary: a byte that no UTF-8 holds, so that no
# grammar of characters takes the token, where a token named by its id still does (one without text never is)
_NO_TEXT = b"\xff"


def _tokens_without_text(info: Any, vocab: list[bytes], special: set[int]) -> Any:
    """`info` with the text of its stop tokens taken out of the vocabulary (`vocab`: its decoded vocabulary, read
    once by the caller, as each read of `info.decoded_vocab` copies all of it) and that of the `special` ones made
    no UTF-8. xgrammar reads a stop token whose text is not empty (SmolLM2's `<|im_end|>`, the tiny model's
    `<|eos|>`) as that text too, and allows it wherever the text completes the grammar: `[^0-9]{8}` took `S` then
    the end, so the output finished "stop" as `S`. It found no special token in these vocabularies and took any as
    its text too (`<|pad|>` inside a JSON string), which the output's decode then dropped (skip_special_tokens, the
    default): `{"s": "<|pad|>Q"}` under minLength 8 came out `{"s": "Q"}`."""
    import xgrammar as xgr

    stops = set(info.stop_token_ids)
    special = {i for i in special - stops if i < len(vocab) and vocab[i]}
    if not special and not any(vocab[i] for i in stops if i < len(vocab)):
        return info
    vocab = [b"" if i in stops else _NO_TEXT + text if i in special else text for i, text in enumerate(vocab)]
    return xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=info.vocab_size, stop_token_ids=sorted(stops),
                             add_prefix_space=info.add_prefix_space)  # fmt: skip


def tokens_by_id(tag: Mapping[str, Any], ids: dict[bytes, int]) -> Mapping[str, Any]:
    """Structural tag `tag` (xgrammar's form, parsed) with each token it names by a stop or special token's text
    (`ids`: text -> id; a `token`, `exclude_tokens`, `trigger_tokens`, a token_dispatch's rule) named by that id:
    the compilers' vocabularies hold no text for stop tokens, and the one for the other kinds none for special
    tokens (`_tokens_without_text`), so xgrammar could not find them there by their text."""

    def by_id(name: Any) -> Any:
        return ids.get(name.encode("utf-8", "surrogatepass"), name) if isinstance(name, str) else name

    def walk(node: Any) -> Any:
        if isinstance(node, list):
            return [walk(item) for item in node]
        if not isinstance(node, dict):
            return node
        out = {}
        for key, value in node.items():
            if key == "token" and node.get("type", "token") == "token":
                out[key] = by_id(value)
            elif key in ("exclude_tokens", "trigger_tokens") and isinstance(value, list):
                out[key] = [by_id(name) for name in value]
            elif key == "rules" and node.get("type") == "token_dispatch" and isinstance(value, list):
                # each rule is [a token, its format]
                out[key] = [[by_id(rule[0]), *walk(rule[1:])] if isinstance(rule, list) and rule else walk(rule)
                            for rule in value]  # fmt: skip
            else:
                out[key] = value if key == "json_schema" else walk(value)
        return out

    if not ids:
        return tag
    walked = walk(tag)
    return tag if walked == tag else walked


def xgrammar_available() -> bool:
    try:
        import xgrammar  # noqa: F401
    except ImportError:
        return False
    return True


class GrammarCache:
    """Compiles grammars against one tokenizer; thread-safe (the server compiles off the engine thread).

    Keeps the most recently used compiled grammars, at most `max_entries` of them and `max_bytes` of their memory
    together (the newest is kept whatever its size). `num_compiled` / `num_hits` count compilations and cache hits
    (server metrics), `cached_bytes` the memory kept."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int],
                 max_entries: int = DEFAULT_CACHE_SIZE, max_bytes: int = DEFAULT_CACHE_BYTES) -> None:  # fmt: skip
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.cached_bytes = 0
        self._compilers: dict[bool, Any] = {}  # for structural tags or not -> its compiler (_xgr_compiler)
        self._vocab: Any = None  # (xgrammar's tokenizer info, its decoded vocabulary, the special tokens' ids)
        self.ids_by_text: dict[bytes, int] = {}  # each stop or special token's text -> its id (read with the vocab)
        self._cache: OrderedDict[tuple[str, str], tuple[Any, int]] = OrderedDict()  # key -> (compiled, its bytes)
        self._lock = threading.Lock()
        self.num_compiled = 0
        self.num_hits = 0

    def _xgr_compiler(self, for_tags: bool = False) -> Any:
        """The compiler of structural tags that name a special token by its text (`for_tags`) or of the rest. For
        the rest a special token has no text (`_tokens_without_text`): none is taken as its text inside a JSON
        string or a regex. A structural tag's begin, end or trigger is often a special token's text
        (`<|python_tag|>`, `[TOOL_CALLS]`), which the model writes as that token: there it keeps its text, as
        xgrammar (and vLLM) read it (and so a JSON string or regex in that tag may take one as its text too)."""
        if self._vocab is None:
            try:
                import xgrammar as xgr
            except ImportError:
                raise RequestError("structured_outputs", "needs the xgrammar package (pip install xgrammar)") from None
            if self.tokenizer is None:
                raise RequestError("structured_outputs", "needs the engine's tokenizer")
            info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                      stop_token_ids=self.stop_token_ids or None)  # fmt: skip
            vocab = info.decoded_vocab  # a copy of the whole vocabulary (0.25 s for SmolLM2's 49152): read it once
            special = special_token_ids(self.tokenizer)
            # a text another token has too stays that token's
            self.ids_by_text = {vocab[i]: i for i in set(info.stop_token_ids) | special
                                if i < len(vocab) and vocab[i] and vocab.count(vocab[i]) == 1}  # fmt: skip
            self._vocab = (info, vocab, special)
        if for_tags not in self._compilers:
            import xgrammar as xgr

            info, vocab, special = self._vocab
            self._compilers[for_tags] = xgr.GrammarCompiler(
                _tokens_without_text(info, vocab, set() if for_tags else special), max_threads=1, cache_enabled=False)
        return self._compilers[for_tags]

    def _names_special_text(self, params: StructuredOutputsParams) -> bool:
        """Whether a structural tag's own strings (its begin, end, triggers, values: `tag_strings`) hold a special
        token's text, so that it compiles against the vocabulary that keeps that text (`_xgr_compiler`)."""
        if self._vocab is None:
            self._xgr_compiler()  # reads the vocabulary
        _, vocab, special = self._vocab
        texts = [vocab[i].decode("utf-8", "replace") for i in special if i < len(vocab) and vocab[i]]
        strings = tag_strings(json.loads(params.structural_tag_json)["format"]) if texts else []
        return any(text in string for string in strings for text in texts)

    def prepare(self) -> None:
        """Reads the tokenizer's vocabulary into xgrammar (once); call it on the thread that owns the tokenizer."""
        with self._lock:
            self._xgr_compiler()

    def compile(self, params: StructuredOutputsParams) -> Any:
        """The compiled grammar; an invalid schema, regex or grammar raises RequestError naming `params.origin`."""
        key = params.key()
        with self._lock:
            found = self._cache.get(key)
            if found is not None:
                self._cache.move_to_end(key)
                self.num_hits += 1
                return found[0]
            compiler = self._xgr_compiler(params.kind == "structural_tag" and self._names_special_text(params))
        compiled = self._compile(compiler, params, self.ids_by_text)
        size = int(getattr(compiled, "memory_size_bytes", 0))
        with self._lock:
            replaced = self._cache.pop(key, None)  # compiled meanwhile by another thread
            self.cached_bytes += size - (replaced[1] if replaced else 0)
            self._cache[key] = (compiled, size)
            self.num_compiled += 1
            while len(self._cache) > self.max_entries or (self.cached_bytes > self.max_bytes and len(self._cache) > 1):
                self.cached_bytes -= self._cache.popitem(last=False)[1][1]
        return compiled

    @staticmethod
    def _compile(compiler: Any, params: StructuredOutputsParams, token_ids: dict[bytes, int]) -> Any:
        kind = params.kind
        if kind == "json":
            schema = params.json if isinstance(params.json, str) else json.dumps(params.json)
            try:
                parsed = json.loads(schema) if isinstance(params.json, str) else params.json
            except ValueError as exc:  # xgrammar's message for malformed JSON names no field
                raise RequestError(params.origin, f"invalid json: {exc}") from None
            why = unenforced_feature(parsed)  # an iterative walk: the nesting is bounded by StructuredOutputsParams
            if why is not None:
                raise RequestError(params.origin, f"the JSON schema's {why}")
        if kind == "structural_tag":
            return GrammarCache._compile_structural_tag(compiler, params, token_ids)
        import xgrammar as xgr

        # each grammar compiles from its text, without the surrogate code points (grammar_text.without_surrogates)
        try:
            if kind == "json":
                return compiler.compile_grammar(mended_schema_grammar(schema))
            if kind == "json_object":  # an object with any members (xgrammar's builtin JSON also allows arrays)
                return compiler.compile_grammar(mended_schema_grammar('{"type": "object"}', strict_mode=False))
            if kind in ("regex", "choice"):
                regex = params.regex if kind == "regex" else "|".join(_regex_literal(c) for c in params.choice or ())
                return compiler.compile_grammar(without_surrogates(str(xgr.Grammar.from_regex(regex))))
            return compiler.compile_grammar(without_surrogates(str(xgr.Grammar.from_ebnf(params.grammar))))
        except Exception as exc:  # noqa: BLE001 - whatever xgrammar raises for a grammar is the request's fault
            raise RequestError(params.origin, f"invalid {kind}: {_xgrammar_reason(exc)}") from None

    @staticmethod
    def _compile_structural_tag(compiler: Any, params: StructuredOutputsParams, token_ids: dict[bytes, int]) -> Any:
        """A structural tag's grammar: each JSON schema in it held to the json kind's rules (a keyword the grammar
        would not enforce is refused; length-bounded strings compile from the mended grammar text); a stop token
        named by its text named by its id (`tokens_by_id`), as a special token."""
        for where, schema in params.structural_tag_schemas:
            why = unenforced_feature(schema)  # iterative; each schema's nesting is bounded by StructuredOutputsParams
            if why is not None:
                raise RequestError(params.origin, f"the JSON schema at {where}: {why}")
        document = json.loads(params.structural_tag_json)  # parsed once here, passed along
        given = tokens_by_id(document, token_ids)
        try:
            grammar = mended_structural_tag_grammar(tag_formats_as_patterns(given))
        except Exception:  # noqa: BLE001 - a tag xgrammar refuses (named below), or one that needs the vocabulary
            grammar, why = None, "beside a token named by its text is not supported: name the token by its id"
        if grammar is not None:
            try:
                return compiler.compile_grammar(grammar)
            except Exception as exc:  # noqa: BLE001 - narrowed here
                if not _unread_tag_dispatch(grammar, exc):
                    raise _tag_refused(params.origin, exc) from None  # named as xgrammar names it (the mends kept)
                why = "is not supported beside a free text whose exclude starts a trigger"
        # the tag as given (its patterns' stand-ins are written out only in the mended text), where xgrammar names
        # what it refuses
        try:
            compiled = compiler.compile_structural_tag(json.dumps(given))
        except Exception as exc:  # noqa: BLE001 - whatever xgrammar raises for a tag is the request's fault
            raise _tag_refused(params.origin, exc) from None
        if not any(has_string_length(schema) for _, schema in params.structural_tag_schemas):
            return compiled  # the classes and formats as xgrammar writes them
        raise RequestError(params.origin, f"a JSON schema with minLength / maxLength {why}")

    def matcher(self, compiled: Any) -> Any:
        """A fresh matcher for one sequence."""
        import xgrammar as xgr

        return TimedMatcher(xgr.GrammarMatcher(compiled))


class TimedMatcher:
    """A matcher whose calls are timed (thread CPU time): once one takes longer than `budget_s`, or they average
    more than `mean_budget_s` after a second in all, it is stalled: it computes nothing more (every token allowed, no
    token accepted), so the scheduler ends its request with `stall`, the reason, as the error."""

    def __init__(self, matcher: Any, budget_s: float = MATCHER_CALL_BUDGET_S,
                 mean_budget_s: float = MATCHER_MEAN_BUDGET_S) -> None:  # fmt: skip
        self.matcher = matcher
        self.budget_s, self.mean_budget_s = budget_s, mean_budget_s
        self.spent_s, self.calls = 0.0, 0
        self.stall: Optional[str] = None

    def _timed(self, what: str, call: Any, *args: Any) -> Any:
        start = time.thread_time()
        out = call(*args)
        spent = time.thread_time() - start
        self.spent_s += spent
        self.calls += 1
        why = None
        if spent > self.budget_s:
            why = f"{spent:.2f} s of CPU time for {what}, past the {self.budget_s:g} s a step may spend on it"
        elif self.spent_s > 1.0 and self.spent_s > self.mean_budget_s * self.calls:
            why = (f"{self.spent_s:.2f} s of CPU time over {self.calls} calls, more than the {self.mean_budget_s:g} "
                   "s a call may take on average")  # fmt: skip
        if why is not None:
            self.stall = (f"its output grammar took {why} (an ambiguous grammar, such as nested repeats, whose "
                          "parser states multiply with every token): it would hold up every running request")
        return out

    def fill_next_token_bitmask(self, bitmask: Any, index: int = 0) -> bool:
        if self.stall is not None:
            bitmask[index].fill_(-1)
            return False
        return bool(self._timed("one token's allowed set", self.matcher.fill_next_token_bitmask, bitmask, index))

    def accept_token(self, token_id: int) -> bool:
        # False once stalled, by this call or the mask's before it: the token (drawn from a mask the grammar
        # computed) ends the output, which stays one the grammar allows
        if self.stall is not None:
            return False
        accepted = bool(self._timed("accepting one token", self.matcher.accept_token, token_id))
        return accepted and self.stall is None

    def is_terminated(self) -> bool:
        return bool(self.matcher.is_terminated())

    def fork(self) -> "TimedMatcher":
        child = TimedMatcher(self.matcher.fork(), self.budget_s, self.mean_budget_s)
        child.spent_s, child.calls, child.stall = self.spent_s, self.calls, self.stall
        return child


def grammar_stall(matcher: Any) -> Optional[str]:
    """Why a sequence's matcher stopped (`TimedMatcher.stall`, also under a `GatedMatcher`), or None."""
    while matcher is not None and not isinstance(matcher, TimedMatcher):
        matcher = getattr(matcher, "matcher", None)
    return matcher.stall if matcher is not None else None


class GatedMatcher:
    """A matcher that holds only once the output has written `starts_after` (a reasoning model's end-of-thinking
    token): before, every token is allowed and none is fed to the grammar, that token included. It answers the
    calls the sampler and the scheduler make of a matcher."""

    def __init__(self, matcher: Any, starts_after: int) -> None:
        self.matcher = matcher
        self.starts_after = starts_after
        self.open = False

    def fill_next_token_bitmask(self, bitmask: Any, index: int = 0) -> bool:
        if self.open:
            return bool(self.matcher.fill_next_token_bitmask(bitmask, index))
        bitmask[index].fill_(-1)  # every token allowed
        return False

    def accept_token(self, token_id: int) -> bool:
        if self.open:
            return bool(self.matcher.accept_token(token_id))
        self.open = token_id == self.starts_after
        return True

    def is_terminated(self) -> bool:
        return self.open and bool(self.matcher.is_terminated())

    def fork(self) -> "GatedMatcher":
        child = GatedMatcher(self.matcher.fork(), self.starts_after)
        child.open = self.open
        return child


def _unread_tag_dispatch(grammar: str, exc: BaseException) -> bool:
    """Whether `exc` is xgrammar refusing to read back its own printed TagDispatch whose exclude starts a trigger
    (left in `grammar` as written past MAX_FREE_TEXT_STATES): a grammar text it prints and does not read."""
    return " ::= TagDispatch(" in grammar and _UNREAD_TAG_DISPATCH in str(exc)


def _tag_refused(origin: str, exc: Exception) -> RequestError:
    """What a structural tag's failed compile is answered with: a RequestError as raised, else what xgrammar
    raised as the request's fault, named as xgrammar names it."""
    if isinstance(exc, RequestError):
        return exc
    reason = _xgrammar_reason(exc).removeprefix("Invalid structural tag error: ")
    return RequestError(origin, f"invalid structural_tag: {reason}")


def _xgrammar_reason(exc: BaseException) -> str:
    """The first line of what xgrammar raised, less its log prefix ("[time] file.cc:line: ") and its failed
    assertion's text, which say nothing to a client."""
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return _XGR_CHECK.sub("", _XGR_PREFIX.sub("", first))[:300]


def _regex_literal(text: str) -> str:
    """`text` as a regex matching exactly it (xgrammar's regex dialect is ECMAScript-like)."""
    special = set("\\^$.|?*+()[]{}/")
    return "".join("\\" + ch if ch in special else ch for ch in text)


def mask_logits(logits: torch.Tensor, rows: Sequence[tuple[int, Any]]) -> None:
    """Sets to -inf, in place, every token that the matcher of each (row, matcher) does not allow next."""
    if not rows:
        return
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(len(rows), logits.shape[1])
    for j, (_, matcher) in enumerate(rows):
        matcher.fill_next_token_bitmask(bitmask, j)
    picked = logits[[r for r, _ in rows]]
    xgr.apply_token_bitmask_inplace(picked, bitmask, vocab_size=logits.shape[1])
    logits[[r for r, _ in rows]] = picked


def accepts(matcher: Optional[Any], token_id: int) -> bool:
    """Advances a matcher by one token (the scheduler's call); False when the grammar forbids it."""
    return matcher is None or bool(matcher.accept_token(token_id))

"""xgrammar's grammar text (its EBNF, as `str(xgrammar.Grammar)` prints it) with every character class made to leave
out the surrogate code points U+D800-U+DFFF, a schema's patterns and a structural tag's free text written out as
rules first.

xgrammar matches UTF-8 bytes and takes a surrogate's three bytes (ED A0..BF xx) as one character wherever a class
covers its code point: `[^0-9]`, a regex's `.`, `\\S`, a JSON string's characters. They are no UTF-8, so the text
shows three U+FFFD, and the output breaks the grammar it was held to (a length, a pattern). A JSON schema's
`pattern`, printed as `Regex("...", json_string=true)`, is first written out as rules (`with_regexes_expanded`).
"""

from __future__ import annotations

import re
from typing import Collection

SURROGATES = (0xD800, 0xDFFF)
# what a JSON string may not hold unescaped: the control characters, the quote and the backslash
_JSON_UNESCAPED_OUT = [(0x00, 0x1F), (0x22, 0x22), (0x5C, 0x5C)]
_REGEX_CALL = re.compile(r'Regex\(("(?:[^"\\]|\\.)*")(, json_string=true)?\)')
_HIDDEN_PATTERN = "trtpagedpattern"
# the stand-in as xgrammar writes a plain-text regex of it: one literal per character
_HIDDEN_AS_TEXT = re.compile(" ".join(f'"{c}"' for c in _HIDDEN_PATTERN) + '((?: "[0-9a-f]")+)')
_RULE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_NO_CHARACTER = "[^\\u0000-\\U0010ffff]"  # a class no UTF-8 character matches
_CHAR_ESCAPES = {"0": 0, "b": 8, "f": 12, "n": 10, "r": 13, "t": 9, "v": 11, "e": 27}
_HEX_DIGITS = {"x": 2, "u": 4, "U": 8}


def with_regexes_expanded(grammar: str, stand_ins: Collection[str] = ()) -> str:
    """`grammar` (xgrammar's printed EBNF) with each `Regex("...", json_string=true)` (a JSON schema's `pattern`)
    written out as rules of its own: xgrammar's grammar for the regex (`Grammar.from_regex`), its classes less the
    characters a JSON string may not hold unescaped and its literals JSON-escaped, so that `without_surrogates` then
    reaches its classes. xgrammar 0.2.9 compiles the macro wrongly where an optional group holds a repeat
    (`^a(x[0-9]+)?$` took `"a5"`) and leaves its classes as they are; a string holds no escapes there (as in a
    length-bounded string), and `"` or `\\` in the pattern's literals are written escaped. The same call twice
    (a format on many fields) is written out once: xgrammar compiles each copy's masks (20 hostnames took 2 s).
    A `hidden_pattern` stand-in that xgrammar wrote as plain text (a qwen_xml_parameter's top-level value, raw
    text rather than a JSON string) is written out as the regex's rules as they are, where it is one of
    `stand_ins` (the patterns of the grammar's schemas): a regex or EBNF node that spells one keeps its text."""
    import xgrammar as xgr

    added: dict[tuple[str, bool], tuple[str, str]] = {}  # (regex, inside a JSON string): its rules' prefix and text

    def expanded(regex: str, json_string: bool) -> str:
        if (regex, json_string) not in added:
            prefix = f"pattern{len(added)}_"
            while prefix in grammar:
                prefix = "x" + prefix
            text = _renamed(str(xgr.Grammar.from_regex(regex)), prefix)
            added[regex, json_string] = prefix, _json_escaped(text) if json_string else text
        return f"({added[regex, json_string][0]}root)"

    text = _REGEX_CALL.sub(lambda call: expanded(_unhidden("".join(map(chr, _literal_code_points(call.group(1))))),
                                                 bool(call.group(2))), grammar)  # fmt: skip

    def as_text(hidden: re.Match) -> str:
        stand_in = _HIDDEN_PATTERN + hidden.group(1).replace('"', "").replace(" ", "")
        return expanded(_unhidden(stand_in), False) if stand_in in stand_ins else hidden.group(0)

    text = _HIDDEN_AS_TEXT.sub(as_text, text)
    return text if not added else text.rstrip("\n") + "\n" + "".join(rules for _, rules in added.values())


def hidden_pattern(regex: str) -> str:
    """A stand-in for a JSON schema's `pattern` that xgrammar always writes as the Regex macro, which
    `with_regexes_expanded` writes out as `regex`'s rules. xgrammar writes some patterns' grammar itself (one with a
    non-ASCII or an escaped literal: a backslash, a newline, a quote as x22), its literals not JSON-escaped, so the
    string it took was no JSON or another string (a backslash then b: a backspace) and the right one was refused."""
    return _HIDDEN_PATTERN + regex.encode("utf-8", "surrogatepass").hex()


def _unhidden(regex: str) -> str:
    if not regex.startswith(_HIDDEN_PATTERN):
        return regex
    return bytes.fromhex(regex[len(_HIDDEN_PATTERN):]).decode("utf-8", "surrogatepass")


def _literal_code_points(literal: str) -> list[int]:
    """The code points of an EBNF string literal (quotes included)."""
    points, i = [], 1
    while i < len(literal) - 1:
        cp, i = _read_char(literal, i)
        points.append(cp)
    return points


def _renamed(grammar: str, prefix: str) -> str:
    """`grammar` with `prefix` before every rule name (outside its string literals and classes)."""
    return _outside_literals(grammar, lambda part: _RULE_NAME.sub(lambda m: prefix + m.group(0), part),
                             lambda literal: literal, lambda text, negated, ranges: text)  # fmt: skip


def _json_escaped(grammar: str) -> str:
    """`grammar` (a regex's, for the inside of a JSON string) with each class less the characters JSON keeps out of
    a string unescaped, and each literal written as JSON writes it (`"` as `\\"`)."""

    def literal(text: str) -> str:
        escaped = "".join(f"\\u{cp:04x}" if cp < 0x20 else ("\\" + chr(cp) if cp in (0x22, 0x5C) else chr(cp))
                          for cp in _literal_code_points(text))  # fmt: skip
        return '"' + escaped.replace("\\", "\\\\").replace('"', '\\"') + '"'

    return _outside_literals(grammar, lambda part: part, literal,
                             lambda text, negated, ranges: _class_text(text, negated, ranges, _JSON_UNESCAPED_OUT))


def without_surrogates(grammar: str) -> str:
    """`grammar` (xgrammar's printed EBNF) with each character class less U+D800-U+DFFF; string literals and the
    rest unchanged."""
    return _outside_literals(grammar, lambda part: part, lambda literal: literal,
                             lambda text, negated, ranges: _class_text(text, negated, ranges, [SURROGATES]))


def _outside_literals(grammar: str, plain, literal, char_class) -> str:  # type: ignore[no-untyped-def]
    """`grammar` with its plain text, string literals and character classes each rewritten by its function
    (`char_class` is given the class's text, whether it is negated and its ranges)."""
    out: list[str] = []
    i, n, start = 0, len(grammar), 0
    while i < n:
        c = grammar[i]
        if c in '"[':
            out.append(plain(grammar[start:i]))
            if c == '"':
                end = _string_end(grammar, i)
                out.append(literal(grammar[i:end]))
            else:
                end, negated, ranges = _read_class(grammar, i)
                out.append(char_class(grammar[i:end], negated, ranges))
            i = start = end
        else:
            i += 1
    out.append(plain(grammar[start:]))
    return "".join(out)


def _string_end(text: str, start: int) -> int:
    """The index just past the string literal that opens at `start`."""
    i = start + 1
    while i < len(text):
        if text[i] == "\\":
            i += 2
        elif text[i] == '"':
            return i + 1
        else:
            i += 1
    raise ValueError(f"unterminated string literal at {start} in the grammar text")


def _read_char(text: str, i: int) -> tuple[int, int]:
    """The code point at `i` in a character class (an escape or a literal character) and the index after it."""
    if text[i] != "\\":
        return ord(text[i]), i + 1
    e = text[i + 1]
    if e in _HEX_DIGITS:
        digits = _HEX_DIGITS[e]
        return int(text[i + 2:i + 2 + digits], 16), i + 2 + digits
    return _CHAR_ESCAPES.get(e, ord(e)), i + 2


def _read_class(text: str, start: int) -> tuple[int, bool, list[tuple[int, int]]]:
    """The class that opens at `start`: the index just past its `]`, whether it is negated, its ranges."""
    i = start + 1
    negated = text.startswith("^", i)
    i += negated
    ranges: list[tuple[int, int]] = []
    while text[i] != "]":
        lo, i = _read_char(text, i)
        hi = lo
        if text[i] == "-" and text[i + 1] != "]":
            hi, i = _read_char(text, i + 1)
        ranges.append((lo, hi))
    return i + 1, negated, ranges


def _escaped(cp: int) -> str:
    return f"\\u{cp:04x}" if cp <= 0xFFFF else f"\\U{cp:08x}"


def _class_text(original: str, negated: bool, ranges: list[tuple[int, int]], removed: list[tuple[int, int]]) -> str:
    """The class `original` less the code points in `removed`."""
    if negated:  # the complement takes every code point the class leaves out: leave the removed ones out too
        return original[:-1] + "".join(f"{_escaped(low)}-{_escaped(high)}" for low, high in removed) + "]"
    if not any(lo <= high and hi >= low for lo, hi in ranges for low, high in removed):
        return original
    kept = ranges
    for low, high in removed:
        kept = [(a, b) for lo, hi in kept for a, b in ((lo, min(hi, low - 1)), (max(lo, high + 1), hi)) if a <= b]
    if not kept:  # removed ones only: a class no UTF-8 character matches
        return _NO_CHARACTER
    return "[" + "".join(_escaped(a) if a == b else f"{_escaped(a)}-{_escaped(b)}" for a, b in kept) + "]"


# a free text's rules, one for each prefix of its triggers and excludes: xgrammar compiles each one's masks, about
# 11 ms on SmolLM2's vocabulary (an end of 500 characters took 5.5 s, one of 2000 past 5 minutes, where TagDispatch
# takes 0.1 s); past this the TagDispatch stays (its free text may then hold a surrogate's bytes)
MAX_FREE_TEXT_STATES = 128
_TAG_DISPATCH = re.compile(r"^(\w+) ::= TagDispatch\(\n(.*?)\n\)$", re.M | re.S)
_TRIGGER = re.compile(r'\(("(?:[^"\\]|\\.)*"), (\w+)\)')
_LITERAL = re.compile(r'"(?:[^"\\]|\\.)*"')


def with_free_text_written_out(grammar: str) -> str:
    """`grammar` (xgrammar's printed EBNF) with each TagDispatch (a structural tag's free text: `any_text` inside a
    tag, the text around `triggered_tags`) written out as rules with character classes: xgrammar's TagDispatch
    takes any bytes (a surrogate's three, `\\xff`), which `without_surrogates` cannot reach. The rules follow the
    text with xgrammar's automaton over its strings: an exclude (a tag's end) never appears in it; a trigger is met
    where the longest suffix of the text that starts a trigger or an exclude is that trigger (so "b" is no trigger
    inside "<ba" while the text may still become it), and goes on with its tag's rule and back to free text (or to
    the end, after a `stop_after_first` one's), or, where it starts a longer one, with that one's text. A
    TagDispatch of another form, or whose triggers and excludes have more than MAX_FREE_TEXT_STATES prefixes, is
    left as xgrammar writes it."""
    return _TAG_DISPATCH.sub(lambda match: _free_text_rules(match.group(1), match.group(2), grammar)
                             or match.group(0), grammar)  # fmt: skip


def _free_text_rules(name: str, body: str, grammar: str) -> str | None:
    """The rules for TagDispatch `name` (its `body` as xgrammar prints it), named apart from `grammar`'s rules (a
    TagDispatch any_text's states were any_text_1, ..., beside xgrammar's own any_text_1); None for another form."""
    triggers: list[tuple[str, str]] = []
    loop, excludes = None, None
    for item in (line.strip().removesuffix(",") for line in body.split("\n")):
        trigger = _TRIGGER.fullmatch(item)
        if trigger:
            triggers.append(("".join(map(chr, _literal_code_points(trigger.group(1)))), trigger.group(2)))
        elif item in ("loop_after_dispatch=true", "loop_after_dispatch=false"):
            loop = item.endswith("true")
        elif item.startswith("excludes=("):
            excludes = ["".join(map(chr, _literal_code_points(text))) for text in _LITERAL.findall(item)]
        else:
            return None
    if excludes is None or loop is None or (loop and not triggers) or not all(triggers) or "" in excludes:
        return None
    ends = {text: rule for text, rule in triggers} | {text: None for text in excludes}
    prefixes = sorted({text[:k] for text in ends for k in range(len(text))}, key=lambda p: (len(p), p))
    if len(prefixes) > MAX_FREE_TEXT_STATES:
        return None
    base = f"{name}_text"
    while re.search(rf"\b{base}", grammar):
        base += "x"
    state = {prefix: f"{base}{k}" for k, prefix in enumerate(prefixes)}
    chars = sorted({ord(c) for text in ends for c in text})
    after_tag = f" {state['']}" if loop else ""

    def steps(prefix: str, cp: int) -> list[str]:
        text = prefix + chr(cp)
        if any(text.endswith(exclude) for exclude in excludes):
            return []  # an exclude that ends here refuses it, even where a trigger ends here too
        while text not in state and text not in ends:  # the longest suffix that is a prefix or an end
            text = text[1:]
        if text not in ends:
            return [f"({_char_literal(cp)} {state[text]})"]
        # a trigger: its tag (then free text again if loop), or, where it starts a longer end, that end's text on
        continued = [f"({_char_literal(cp)} {state[text]}_on)"] if text in state else []
        return [f"({_char_literal(cp)} {ends[text]}{after_tag})", *continued]

    rules = [f"{name} ::= (({state['']}))"]
    others = "".join(_escaped(cp) for cp in chars)
    for prefix in prefixes:
        alternatives = ['""', *(step for cp in chars for step in steps(prefix, cp)), f"([^{others}] {state['']})"]
        rules.append(f"{state[prefix]} ::= ({' | '.join(alternatives)})")
        if prefix in ends:  # a trigger that starts a longer end goes on by that end's characters only
            alternatives = [step for cp in chars if prefix + chr(cp) in state or prefix + chr(cp) in ends
                            for step in steps(prefix, cp)]  # fmt: skip
            rules.append(f"{state[prefix]}_on ::= ({' | '.join(alternatives) or _NO_CHARACTER})")
    return "\n".join(rules)


def _char_literal(cp: int) -> str:
    return f'"{chr(cp)}"' if 0x20 <= cp < 0x7F and chr(cp) not in '"\\' else f'"{_escaped(cp)}"'

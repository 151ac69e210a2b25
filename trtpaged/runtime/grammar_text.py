"""xgrammar's grammar text (its EBNF, as `str(xgrammar.Grammar)` prints it) with every character class made to leave
out the surrogate code points U+D800-U+DFFF.

xgrammar matches UTF-8 bytes and takes a surrogate's three bytes (ED A0..BF xx) as one character wherever a class
covers its code point: `[^0-9]`, a regex's `.`, `\\S`, a JSON string's characters. They are no UTF-8, so the text
shows three U+FFFD, and the output breaks the grammar it was held to (a length, a pattern). A class written inside a
string argument (a JSON schema's `pattern`, printed as `Regex("...")`) is left as it is.
"""

from __future__ import annotations

SURROGATES = (0xD800, 0xDFFF)
_CHAR_ESCAPES = {"0": 0, "b": 8, "f": 12, "n": 10, "r": 13, "t": 9, "v": 11, "e": 27}
_HEX_DIGITS = {"x": 2, "u": 4, "U": 8}


def without_surrogates(grammar: str) -> str:
    """`grammar` (xgrammar's printed EBNF) with each character class less U+D800-U+DFFF; string literals and the
    rest unchanged."""
    out: list[str] = []
    i, n = 0, len(grammar)
    while i < n:
        c = grammar[i]
        if c == '"':
            end = _string_end(grammar, i)
            out.append(grammar[i:end])
            i = end
        elif c == "[":
            end, negated, ranges = _read_class(grammar, i)
            out.append(_class_text(grammar[i:end], negated, ranges))
            i = end
        else:
            out.append(c)
            i += 1
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


def _class_text(original: str, negated: bool, ranges: list[tuple[int, int]]) -> str:
    low, high = SURROGATES
    if negated:  # the complement takes every code point the class leaves out: leave the surrogates out too
        return original[:-1] + f"{_escaped(low)}-{_escaped(high)}]"
    if not any(lo <= high and hi >= low for lo, hi in ranges):
        return original
    kept: list[tuple[int, int]] = []
    for lo, hi in ranges:
        kept += [(a, b) for a, b in ((lo, min(hi, low - 1)), (max(lo, high + 1), hi)) if a <= b]
    if not kept:  # surrogates only: a class no UTF-8 character matches
        return "[^\\u0000-\\U0010ffff]"
    return "[" + "".join(_escaped(a) if a == b else f"{_escaped(a)}-{_escaped(b)}" for a, b in kept) + "]"

"""A JSON object from user input, checked in one place: JSON text (or an already parsed value) that must be
an object whose fields are all known. Used by the speculative config, trace and request-log lines; the server's
bodies and run-batch's lines are read by its strict `loads`."""

from __future__ import annotations

import json
import sys
from typing import Any, Iterable, Mapping, Optional


def json_object(value: Any, where: str, allowed: Iterable[str]) -> dict[str, Any]:
    """`value` (JSON text, or a parsed value) as a dict whose fields are all in `allowed`; ValueError starting
    with `where` (a field name or "file:line") for text that is not JSON, a non-object, or an unknown field."""
    if isinstance(value, (str, bytes)):
        try:
            value = json.loads(value, object_pairs_hook=without_repeats)
        except RepeatedField as exc:
            raise ValueError(f"{where}: {exc}") from None
        except ValueError as exc:
            raise ValueError(f"{where}: not JSON ({exc})") from None
        except RecursionError:
            raise ValueError(f"{where}: not JSON this reader takes (nested too deeply)") from None
    if not isinstance(value, Mapping):
        raise ValueError(f"{where}: expected a JSON object, got {type(value).__name__}")
    allowed = set(allowed)
    unknown = set(value) - allowed
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {sorted(unknown)}; allowed: {sorted(allowed)}")
    return dict(value)


class RepeatedField(ValueError):
    """A JSON object gives one field twice (`args[0]`: the field's name); its text is the refusal's words."""

    def __str__(self) -> str:
        return f"field {self.args[0]!r:.80} given twice in one object (which one was meant?)"


def without_repeats(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """json.loads' object_pairs_hook: a field given twice is refused (RepeatedField); json keeps the last silently,
    where another reader of the same text (a proxy that checked it) may have kept the first."""
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise RepeatedField(key)
            seen.add(key)
    return out


def json_kind(value: Any) -> str:
    """A parsed JSON value's type in JSON's words ("an object", "an array", "null"), for messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    for kind, name in ((Mapping, "an object"), (list, "an array"), (str, "a string"), ((int, float), "a number")):
        if isinstance(value, kind):
            return name
    return type(value).__name__


class LongNumber(ValueError):
    """A JSON integer of more digits than Python converts (sys.get_int_max_str_digits); `path`: where it is
    ("max_tokens", "prompt[0]"; "[0]" in an array that is the whole text, "" for the text itself), `field`: the
    path's first name ("" where there is none)."""

    def __init__(self, path: str, digits: int) -> None:
        super().__init__(path, digits)
        self.path, self.digits = path, digits
        self.field = path.split("[", 1)[0].split(".", 1)[0]

    @property
    def message(self) -> str:
        """The refusal without the place."""
        return f"a number of {self.digits} digits; at most {sys.get_int_max_str_digits()} digits are read"

    def __str__(self) -> str:
        return f"{self.path}: {self.message}" if self.path else self.message


class _Digits(str):
    """An integer's text too long to convert, kept as found while its place is looked for."""


def loads(text: str) -> Any:
    """json.loads, strict as RFC 8259 is: NaN and Infinity are refused (ValueError), and so is a field given twice in
    one object (RepeatedField, a ValueError naming it) and an integer of more digits than Python converts
    (LongNumber, naming where it is: json's own message names neither the place nor anything but the setting)."""
    try:
        return json.loads(text, parse_constant=_reject_constant, object_pairs_hook=without_repeats)
    except ValueError as exc:
        if "integer string conversion" not in str(exc) or isinstance(exc, RepeatedField):
            raise
        limit = sys.get_int_max_str_digits()
        kept = json.loads(text, parse_constant=_reject_constant, object_pairs_hook=without_repeats,
                          parse_int=lambda digits: _Digits(digits) if len(digits.lstrip("-")) > limit else int(digits))
        found = _first_long(kept, "")
        if found is None:
            raise
        raise LongNumber(found[0], len(found[1].lstrip("-"))) from None


def _first_long(value: Any, path: str) -> Optional[tuple[str, str]]:
    """(path, text) of the first _Digits in `value`, depth first; None where there is none."""
    if isinstance(value, _Digits):
        return path, value
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        found = _first_long(item, f"{path}[{key}]" if isinstance(key, int) else f"{path}.{key}" if path else key)
        if found is not None:
            return found
    return None


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")

"""A JSON object from user input, checked in one place: JSON text (or an already parsed value) that must be
an object whose fields are all known. Used by the speculative config, trace and request-log lines; the server's
bodies and run-batch's lines are read by its strict `loads`."""

from __future__ import annotations

import json
from typing import Any, Iterable, Mapping


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


def loads(text: str) -> Any:
    """json.loads, strict as RFC 8259 is: NaN and Infinity are refused (ValueError), and so is a field given twice in
    one object (RepeatedField, a ValueError naming it)."""
    return json.loads(text, parse_constant=_reject_constant, object_pairs_hook=without_repeats)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")

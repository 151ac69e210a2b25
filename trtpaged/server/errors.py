"""Errors answered as OpenAI error bodies, and the mapping from validation and runtime errors to them.

Nothing here reads an error's message to find the field: pydantic reports a location,
the runtime's `RequestError` carries `field` and `limit`.
"""

from __future__ import annotations

import re
from typing import Any, Mapping, Optional

from pydantic import ValidationError

from trtpaged.errors import CONTEXT_LENGTH_EXCEEDED, ContextOverflow, RequestError, mentions_renamed
from trtpaged.server.schemas import ErrorDetail, ErrorResponse


class ApiError(Exception):
    """An answer other than success: HTTP status, OpenAI error type, the offending field, extra headers."""

    def __init__(
        self,
        message: str,
        param: Optional[str] = None,
        status: int = 400,
        kind: str = "invalid_request_error",
        code: Optional[str] = None,
        headers: Optional[Mapping[str, str]] = None,
        details: Optional[Mapping[str, Any]] = None,
        anthropic_status: Optional[int] = None,
        overflow: Optional[ContextOverflow] = None,
    ) -> None:
        super().__init__(message)
        # a request longer than the model's context (overflow): OpenAI's context_length_exceeded
        code = CONTEXT_LENGTH_EXCEEDED if code is None and overflow is not None else code
        self.message, self.param, self.status, self.kind, self.code = message, param, status, kind, code
        self.headers = dict(headers or {})
        self.details = dict(details) if details else None  # Anthropic's error.details (its error_code), if any
        self.anthropic_status = anthropic_status  # the status on Anthropic's routes, where it is not `status`
        self.overflow = overflow  # a context-length refusal's numbers, which Anthropic's routes word their own way

    def status_on(self, anthropic: bool) -> int:
        """The HTTP status of the answer: on Anthropic's routes (/v1/messages) their own where it differs."""
        return self.anthropic_status if anthropic and self.anthropic_status is not None else self.status

    def body(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorDetail(message=self.message, type=self.kind, param=self.param, code=self.code))


ANTHROPIC_OVERLOADED = 529  # Anthropic's status for overloaded_error (its SDK raises OverloadedError on it)


def overloaded(message: str, retry_after_s: int = 1, *, busy: bool) -> ApiError:
    """503 with Retry-After: the server is full (`busy`: a waiting queue holds max_waiting requests) or draining; the
    client may try again later. On Anthropic's routes a full server is 529, Anthropic's "overloaded" status (a
    draining one stays 503, the service unavailable that a proxy in front reads)."""
    return ApiError(message, None, 503, "server_overloaded", "overloaded", {"Retry-After": str(retry_after_s)},
                    anthropic_status=ANTHROPIC_OVERLOADED if busy else None)  # fmt: skip


# how pydantic names a union's member in an error's location (str, list[int], literal['never'], function-after[...]),
# as opposed to a field name, a list index or a dict key, where several errors are several bad values
_UNION_FORM = re.compile(r"^((str|int|float|bool|none|bytes|any|list|dict|tuple|set|union|literal)"
                         r"(\[.*\])?|function-.*)$")


def from_validation_error(exc: ValidationError) -> ApiError:
    """The first schema violation as a 400 naming the top-level request field and the rule it broke."""
    errors = exc.errors(include_url=False)
    first = errors[0]
    forms_of = [e for e in errors if e.get("type") != "extra_forbidden"]  # an unknown key is no union's form
    loc = [str(p) for p in first.get("loc", ())]
    param = loc[0] if loc else "body"
    got = first.get("input")
    shown = repr(got) if isinstance(got, (int, float, str, bool, type(None))) else type(got).__name__
    # a value of a union type: pydantic reports one error per accepted form, each under the form's name at the same
    # place (prompt.str, prompt.list[int], ...); naming only the first form's rule told the client the wrong thing
    for i in range(1, len(loc)):
        forms = list(dict.fromkeys(str(e["loc"][i]) for e in forms_of
                                   if len(e["loc"]) > i and [str(p) for p in e["loc"][:i]] == loc[:i]))
        if len(forms) > 1 and all(_UNION_FORM.match(form) for form in forms):
            return ApiError(f"{_where(loc[:i])}: expected one of {', '.join(forms)}, got {shown[:80]}", param)
    if first.get("type") == "extra_forbidden":
        return ApiError(f"{_where(loc)}: unknown field (not part of this API)", param)
    return ApiError(f"{_where(loc)}: {first.get('msg', 'invalid')}, got {shown[:80]}", param)


def _where(loc: list[str]) -> str:
    """A field's path as a request names it: messages[0].content."""
    if not loc:
        return "body"
    return loc[0] + "".join(f"[{p}]" if p.isdigit() else f".{p}" for p in loc[1:])


# fields a runtime refusal of another field names in its text, renamed there too when the request spelled them
# otherwise (not "prompt": a chat's is "messages", but "the prompt" in a message is the prompt)
MENTIONED = ("max_tokens", "beam_width")


def from_runtime_error(exc: ValueError, names: Mapping[str, str]) -> ApiError:
    """A runtime refusal as a 400. `RequestError` names its field (renamed to the request's spelling via
    `names`, e.g. max_tokens -> max_completion_tokens; MENTIONED fields in its text too); any other ValueError has
    no field to name."""
    if isinstance(exc, RequestError):
        param = names.get(exc.field, exc.field)
        why = str(exc).removeprefix(exc.field + ": ")
        # other fields its text names ("n: at most beam_width (2)"), not the values it quotes
        why = mentions_renamed(why, {runtime: names[runtime] for runtime in MENTIONED if runtime in names})
        return ApiError(f"{param}: {why}", param, code=exc.code, overflow=exc.overflow)
    return ApiError(str(exc))

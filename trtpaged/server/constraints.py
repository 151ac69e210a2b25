"""Request fields that constrain which tokens may be sampled -> SamplingParams fields.

OpenAI's `response_format` (json_object, json_schema; vLLM's structural_tag) and `logit_bias`; vLLM's
`structured_outputs` (json, regex, choice, grammar, structural_tag), its older `guided_*` spellings and chat's
`structural_tag`, `allowed_token_ids` and `bad_words`. At most one grammar per request; each error names the request
field that carries it.
"""

from __future__ import annotations

from typing import Any, Optional

from trtpaged.runtime.sampling_params import StructuredOutputsParams
from trtpaged.runtime.structural_tag import is_legacy
from trtpaged.server.errors import ApiError
from trtpaged.server.tools import OPENAI_NAME

_STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
_STRUCTURED_OPTIONS = ("disable_fallback", "disable_any_whitespace", "disable_additional_properties",
                       "whitespace_pattern")  # vLLM's, beside the grammar in structured_outputs
_TGI_GRAMMARS = ("json", "json_object", "regex")  # TGI's response_format types that carry a value
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def _response_format(value: dict[str, Any]) -> Optional[StructuredOutputsParams]:
    """OpenAI's response_format: {"type": "text" | "json_object" | "json_schema", "json_schema": {name, schema}};
    or TGI's grammar {"type": "json" | "json_object" | "regex", "value": ...}, which huggingface_hub's InferenceClient
    sends (it rewrites OpenAI's json_schema form to json_object with the schema as value)."""
    kind = value.get("type")
    if kind in _TGI_GRAMMARS and value.get("value") is not None:
        return _tgi_grammar(value)
    if kind == "structural_tag":
        return _structural_tag_format(value)
    extra = set(value) - {"type", "json_schema"} - ({"value"} if kind == "json_object" else set())
    if extra:
        raise ApiError(f"response_format: unknown keys {sorted(extra)}", "response_format")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True, origin="response_format")
    if kind == "json_schema":
        return StructuredOutputsParams(json=_json_schema(value.get("json_schema")), origin="response_format")
    if kind in _TGI_GRAMMARS:
        raise ApiError(f"response_format.value: required with type {kind!r} (TGI's grammar form)", "response_format")
    raise ApiError(f"response_format.type: must be 'text', 'json_object', 'json_schema' or 'structural_tag' (or TGI's "
                   f"'json' or 'regex' with a value), got {kind!r:.80}", "response_format")  # fmt: skip


def _structural_tag_format(value: dict[str, Any]) -> StructuredOutputsParams:
    """vLLM's structural tag response formats: xgrammar's {"type": "structural_tag", "format": {...}}, or the legacy
    {"type": "structural_tag", "structures": [{begin, schema, end}], "triggers": [...]} (it has structures: vLLM's
    test). Either is the tag itself, checked and compiled as `runtime/structural_tag.py` reads it (the legacy form's
    keys there too); errors name response_format.format, or response_format for the legacy form."""
    if is_legacy(value):
        return StructuredOutputsParams(structural_tag=value, origin="response_format")
    extra = set(value) - {"type", "format"}
    if extra:
        raise ApiError(f"response_format: unknown keys {sorted(extra)} (a structural tag takes type and format, or "
                       "structures and triggers)", "response_format")  # fmt: skip
    fmt = value.get("format")
    if fmt is None:
        raise ApiError("response_format.format: required with type 'structural_tag' (xgrammar's structural tag format; "
                       "or the legacy structures and triggers)", "response_format.format")  # fmt: skip
    if not isinstance(fmt, dict):
        raise ApiError(f"response_format.format: must be a structural tag format object, got {type(fmt).__name__}",
                       "response_format.format")  # fmt: skip
    return StructuredOutputsParams(structural_tag=value, origin="response_format.format")


def _tgi_grammar(value: dict[str, Any]) -> StructuredOutputsParams:
    """TGI's {"type": "json" | "json_object", "value": JSON schema} or {"type": "regex", "value": pattern}."""
    extra = set(value) - {"type", "value"}
    if extra:
        raise ApiError(f"response_format: unknown keys {sorted(extra)} (TGI's grammar form takes type and value)",
                       "response_format")  # fmt: skip
    kind, grammar = value["type"], value["value"]
    if kind == "regex":
        if not isinstance(grammar, str):
            raise ApiError(f"response_format.value: must be a regex string, got {type(grammar).__name__}",
                           "response_format")  # fmt: skip
        return StructuredOutputsParams(regex=grammar, origin="response_format")
    if not isinstance(grammar, dict):
        raise ApiError(f"response_format.value: must be a JSON schema object, got {type(grammar).__name__}",
                       "response_format")  # fmt: skip
    return StructuredOutputsParams(json=grammar, origin="response_format")


def _json_schema(spec: Any) -> Any:
    """The schema of OpenAI's `json_schema: {name, schema?, strict?, description?}`, each key checked as OpenAI
    checks it. An absent schema is any JSON object (the response is JSON, as json_object's); a given one is
    enforced as written (`{}`, the empty schema, is any JSON value, as vLLM and the JSON Schema spec read it)."""
    where = "response_format.json_schema"
    if not isinstance(spec, dict):
        raise ApiError(f"{where}: must be an object {{name, schema?, strict?, description?}}, got "
                       f"{type(spec).__name__}", "response_format")  # fmt: skip
    extra = set(spec) - {"name", "schema", "strict", "description"}
    if extra:
        raise ApiError(f"{where}: unknown keys {sorted(extra)} (it takes name, schema, strict, description)",
                       "response_format")  # fmt: skip
    name = spec.get("name")
    if not isinstance(name, str) or not OPENAI_NAME.fullmatch(name):
        raise ApiError(f"{where}.name: required, must match [A-Za-z0-9_-]{{1,64}}, got {name!r:.80}",
                       "response_format")  # fmt: skip
    for key, kind in (("strict", bool), ("description", str)):
        if spec.get(key) is not None and not isinstance(spec[key], kind):
            raise ApiError(f"{where}.{key}: must be a {kind.__name__}, got {type(spec[key]).__name__}",
                           "response_format")  # fmt: skip
    schema = spec.get("schema")
    if schema is None:
        return {"type": "object"}
    if not isinstance(schema, dict):
        raise ApiError(f"{where}.schema: must be a JSON schema object, got {type(schema).__name__}",
                       "response_format")  # fmt: skip
    return schema


def _structured_outputs(value: dict[str, Any]) -> StructuredOutputsParams:
    extra = set(value) - set(_STRUCTURED_KEYS) - set(_STRUCTURED_OPTIONS)
    if extra:
        raise ApiError(f"structured_outputs: unknown keys {sorted(extra)} (use one of {', '.join(_STRUCTURED_KEYS)}; "
                       f"options beside it: {', '.join(_STRUCTURED_OPTIONS)})", "structured_outputs")  # fmt: skip
    given = {k: value[k] for k in _STRUCTURED_KEYS if value.get(k) not in (None, False)}
    origin = "structured_outputs.structural_tag" if list(given) == ["structural_tag"] else "structured_outputs"
    # the options go along to be checked there (were dropped here: whitespace_pattern, refused there, ran without it)
    options = {k: value[k] for k in _STRUCTURED_OPTIONS if value.get(k) is not None}
    return StructuredOutputsParams(**given, **options, origin=origin)  # type: ignore[arg-type]


def structured_outputs(req: Any) -> Optional[StructuredOutputsParams]:
    """The request's grammar, or None; two grammar fields in one request is a 400 naming the second."""
    found: list[tuple[str, Optional[StructuredOutputsParams]]] = []
    if req.response_format is not None:
        found.append(("response_format", _response_format(req.response_format)))
    if req.structured_outputs is not None:
        found.append(("structured_outputs", _structured_outputs(req.structured_outputs)))
    for name, kind in _GUIDED.items():
        value = getattr(req, name)
        if value is not None:
            found.append((name, StructuredOutputsParams(**{kind: value}, origin=name)))  # type: ignore[arg-type]
    tag = getattr(req, "structural_tag", None)  # chat's (vLLM's older spelling beside guided_*)
    if tag is not None:
        found.append(("structural_tag", StructuredOutputsParams(structural_tag=tag, origin="structural_tag")))
    grammars = [(name, p) for name, p in found if p is not None]
    if len(grammars) > 1:
        raise ApiError(f"{grammars[1][0]}: only one of response_format, structured_outputs, guided_* and "
                       f"structural_tag may set an output grammar (already set by {grammars[0][0]})",
                       grammars[1][0])  # fmt: skip
    return grammars[0][1] if grammars else None


def logit_bias(value: Optional[dict[str, Any]], vocab_size: int) -> Optional[dict[int, float]]:
    """OpenAI's logit_bias: keys are token ids as strings, each in the vocabulary (biases: SamplingParams)."""
    if not value:
        return None
    out: dict[int, float] = {}
    keys: dict[int, str] = {}
    for key, bias in value.items():
        digits = key.lstrip("0") or "0"  # int() of more than 4300 digits raises, naming no field
        if not (key.isascii() and key.isdigit()) or len(digits) > len(str(vocab_size)) or int(digits) >= vocab_size:
            raise ApiError(f"logit_bias: key {key!r:.40} is not a token id in [0, {vocab_size})", "logit_bias")
        token = int(digits)
        if token in keys:  # "5" and "05": one bias would be dropped without a word
            raise ApiError(f"logit_bias: token {token} given twice (keys {keys[token]!r:.40} and {key!r:.40})",
                           "logit_bias")  # fmt: skip
        out[token], keys[token] = bias, key
    return out


def token_ids_in_vocab(name: str, ids: Optional[list[int]], vocab_size: int) -> Optional[tuple[int, ...]]:
    if ids is None:
        return None
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ApiError(f"{name}: token id {bad} is outside the vocabulary [0, {vocab_size})", name)
    return tuple(ids)

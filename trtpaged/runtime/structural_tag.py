"""Structural tags: xgrammar's JSON description of an output's format, as vLLM takes it.

Two forms reach the grammar compiler (vLLM tells them apart the same way: a document with `structures` is the
legacy one):

- xgrammar's `{"type": "structural_tag", "format": {...}}`, the format a tree of `const_string`, `json_schema`,
  `regex`, `grammar`, `any_text`, `sequence`, `or`, `tag`, `triggered_tags`, `tags_with_separator`, ... nodes;
- the legacy `{"type": "structural_tag", "structures": [{"begin", "schema", "end"}, ...], "triggers": [...]}`:
  any text, in which each trigger opens one of the structures (its begin, JSON following its schema, its end).
  It is read here as the `triggered_tags` format it stands for, so both forms compile through one call.

This module checks the shape that the conversion and the server's own checks need and finds the JSON schemas
inside a tag; the format's semantics (node types, their fields, triggers matching begins) are xgrammar's to check
when it compiles. It imports no xgrammar.
"""

from __future__ import annotations

import copy
from typing import Any, Mapping

from trtpaged.errors import RequestError, check_no_nul, check_unicode
from trtpaged.json_input import json_kind
from trtpaged.runtime.schema_features import has_string_length

TAG_TYPE = "structural_tag"
LEGACY_KEYS = frozenset({"type", "structures", "triggers"})
_STRUCTURE_KEYS = frozenset({"begin", "schema", "end"})
# format nodes whose `json_schema` holds a JSON schema (qwen_xml_parameter: xgrammar's older spelling of a
# json_schema node with style "qwen_xml")
_SCHEMA_NODES = ("json_schema", "qwen_xml_parameter")


def is_legacy(document: Mapping[str, Any]) -> bool:
    """Whether a structural tag is the legacy structures + triggers form (vLLM's test: it has `structures`)."""
    return "structures" in document


def xgrammar_form(field: str, document: Any) -> tuple[dict[str, Any], list[tuple[str, Any]]]:
    """A structural tag (parsed JSON) as xgrammar's `{"type": "structural_tag", "format": ...}`, and the JSON schemas
    in it, each with where it is in the document as given (`format.elements[1].json_schema`,
    `structures[0].schema`). A document of neither form raises RequestError naming `field`."""
    if not isinstance(document, Mapping):
        raise RequestError(field, f"a structural tag is a JSON object, got {json_kind(document)}")
    if is_legacy(document):
        return _from_legacy(field, document)
    if document.get("type") != TAG_TYPE or "format" not in document:
        raise RequestError(field, f'a structural tag is {{"type": "{TAG_TYPE}", "format": {{...}}}} (or the legacy '
                           f'{{"type": "{TAG_TYPE}", "structures": [...], "triggers": [...]}}), got the keys '
                           f"{sorted(map(str, document))[:8]} with type {document.get('type')!r:.40}")  # fmt: skip
    if not isinstance(document["format"], Mapping):
        raise RequestError(field, f"structural tag format: must be a format object, got "
                           f"{json_kind(document['format'])}")  # fmt: skip
    tag = {**document, "format": with_forms_written(document["format"])}
    return tag, list(_schemas_in(tag["format"], "format"))


def _from_legacy(field: str, document: Mapping[str, Any]) -> tuple[dict[str, Any], list[tuple[str, Any]]]:
    """The legacy form as the triggered_tags format it describes: any text, each trigger opening a structure."""
    extra = sorted(map(str, set(document) - LEGACY_KEYS))
    if extra:
        raise RequestError(field, f"structural tag: unknown keys {extra} beside structures (the legacy form takes "
                           "type, structures and triggers)")  # fmt: skip
    if document.get("type", TAG_TYPE) != TAG_TYPE:
        raise RequestError(field, f"structural tag type: must be {TAG_TYPE!r}, got {document.get('type')!r:.40}")
    structures, triggers = document.get("structures"), document.get("triggers")
    if not isinstance(structures, list) or not structures:
        raise RequestError(field, f"structural tag structures: must be a non-empty list of {{begin, schema, end}}, "
                           f"got {json_kind(structures)}")  # fmt: skip
    if not isinstance(triggers, list) or not triggers or not all(isinstance(t, str) and t for t in triggers):
        raise RequestError(field, "structural tag triggers: must be a non-empty list of non-empty strings (each "
                           f"structure's begin starts with one), got {triggers!r:.80}")  # fmt: skip
    for i, trigger in enumerate(triggers):
        _check_tag_string(field, trigger, f"triggers[{i}]")
    tags, schemas = [], []
    for i, item in enumerate(structures):
        where = f"structures[{i}]"
        if not isinstance(item, Mapping) or set(item) != _STRUCTURE_KEYS:
            keys = sorted(map(str, item)) if isinstance(item, Mapping) else json_kind(item)
            raise RequestError(field, f"structural tag {where}: must have exactly begin, schema and end, got {keys}")
        begin, schema, end = item["begin"], item["schema"], item["end"]
        if not isinstance(begin, str) or not begin or not isinstance(end, str):
            raise RequestError(field, f"structural tag {where}: begin must be a non-empty string and end a string, "
                               f"got {begin!r:.40} and {end!r:.40}")  # fmt: skip
        _check_tag_string(field, begin, f"{where}.begin")  # named as given, not as the triggered_tags below
        _check_tag_string(field, end, f"{where}.end")
        if not isinstance(schema, (Mapping, bool)):
            raise RequestError(field, f"structural tag {where}.schema: must be a JSON schema (an object), got "
                               f"{json_kind(schema)}")  # fmt: skip
        tags.append({"type": "tag", "begin": begin, "content": {"type": "json_schema", "json_schema": schema},
                     "end": end})  # fmt: skip
        schemas.append((f"{where}.schema", schema))
    tag = {"type": TAG_TYPE, "format": {"type": "triggered_tags", "triggers": list(triggers), "tags": tags}}
    return tag, schemas


def _schemas_in(fmt: Mapping[str, Any], path: str) -> list[tuple[str, Any]]:
    """The JSON schemas of a format tree's json_schema nodes, with their paths, in document order."""
    return [(f"{where}.json_schema", node["json_schema"]) for where, node in schema_nodes(fmt, path)]


def schema_nodes(fmt: Any, path: str = "format") -> list[tuple[str, Mapping[str, Any]]]:
    """A format tree's nodes that hold a JSON schema (json_schema, qwen_xml_parameter), each with its path, in
    document order. Iterative: the caller bounds the nesting (and so a mapping that contains itself) before this
    walk. A node without a type holds one where xgrammar reads it as a json_schema (`untyped_form`)."""
    return [(where, node) for where, node in _format_nodes(fmt, path)
            if "json_schema" in node and node.get("type", untyped_form(node)) in _SCHEMA_NODES]  # fmt: skip


def untyped_form(node: Mapping[str, Any]) -> str:
    """The form xgrammar 0.2.9 reads a format node without a `type` as: the first its keys fit of a tag (begin,
    content and end), a const_string (a string `value`), then a json_schema. xgrammar also reads a tag whose begin,
    content or end it refuses as the next form; `with_forms_written` writes the form out, so that it refuses them."""
    if all(key in node for key in ("begin", "content", "end")):
        return "tag"
    return "const_string" if isinstance(node.get("value"), str) else _SCHEMA_NODES[0]


def with_forms_written(fmt: Any) -> Any:
    """A format tree (parsed; its nesting bounded by the caller) with the form of each node without a `type` that
    holds a `json_schema` written as its `type` (`untyped_form`; a copy where there is one): a stray `json_schema`
    beside a tag's or a const_string's keys is then neither compiled nor checked as the node's schema."""
    if not any("type" not in node and "json_schema" in node for _, node in _format_nodes(fmt)):
        return fmt
    fmt = copy.deepcopy(fmt)
    for _, node in _format_nodes(fmt):
        if "type" not in node and "json_schema" in node:
            node["type"] = untyped_form(node)  # type: ignore[index] - a copy, ours to change
    return fmt


def _format_nodes(fmt: Any, path: str = "format") -> list[tuple[str, Any]]:
    """Every mapping in a format tree with its path, in document order, but what a `json_schema` key holds (a JSON
    schema, never a format)."""
    found, todo = [], [(path, fmt)]
    while todo:
        where, node = todo.pop()
        if isinstance(node, Mapping):
            found.append((where, node))
            todo.extend((f"{where}.{key}", value) for key, value in reversed(list(node.items()))
                        if key != "json_schema")  # fmt: skip
        elif isinstance(node, list):
            todo.extend((f"{where}[{i}]", value) for i, value in reversed(list(enumerate(node))))
    return found


def schema_style(node: Mapping[str, Any]) -> Any:
    """The style a schema node (`schema_nodes`) is written in: a json_schema node's `style` (a node without a type
    is one); xgrammar reads none on a qwen_xml_parameter node (always its XML form)."""
    return node.get("style") if node.get("type", _SCHEMA_NODES[0]) == _SCHEMA_NODES[0] else None


# json_schema styles whose strings xgrammar 0.2.9 writes without their minLength / maxLength (gemma's took "abcd"
# under maxLength 3): a schema with them is refused there, as every keyword the grammar would not enforce
_UNBOUNDED_STRING_STYLES = ("gemma",)


def tag_strings(fmt: Any) -> list[str]:
    """A format tree's own strings (begin, end, value, triggers, excludes, a regex or grammar, a token's text; not
    its JSON schemas, nor its keys)."""
    return [text for _, text in _tag_strings(fmt)]


def _tag_strings(fmt: Any) -> list[tuple[str, str]]:
    """(place, string) for each of a format tree's own strings (`tag_strings`), in document order."""
    found = []
    for where, node in _format_nodes(fmt):
        for key, value in node.items():
            if key != "json_schema":
                items = enumerate(value) if isinstance(value, list) else [(None, value)]
                found.extend((f"{where}.{key}" if i is None else f"{where}.{key}[{i}]", text)
                             for i, text in items if isinstance(text, str))  # fmt: skip
    return found


def check_tag_strings(field: str, fmt: Any) -> None:
    """Raises RequestError naming `field` and the place of a NUL character or a lone surrogate in a format tree's
    own strings (`tag_strings`) or a lone surrogate in a node's key: the grammar text xgrammar prints ends at a
    NUL, so `const_string "a\\0b"` compiled as "a" and a begin holding one took nothing; a surrogate, which no
    output holds, xgrammar took for malformed JSON."""
    for where, node in _format_nodes(fmt):
        for key in node:
            if isinstance(key, str):
                check_unicode(field, key, f"{where} key {key!r:.40}")
    for where, text in _tag_strings(fmt):
        _check_tag_string(field, text, where)


def _check_tag_string(field: str, text: str, where: str) -> None:
    check_no_nul(field, check_unicode(field, text, where), where)


def check_string_lengths(field: str, fmt: Any) -> None:
    """Raises RequestError naming `field` and the node's place where a json_schema node of a style whose strings
    take any length (`_UNBOUNDED_STRING_STYLES`) has a minLength or maxLength: refused with the request's other
    checks, before its prompt is tokenized or its grammar waits for the compiler."""
    for where, node in schema_nodes(fmt):
        if schema_style(node) in _UNBOUNDED_STRING_STYLES and has_string_length(node["json_schema"]):
            raise RequestError(field, f"the JSON schema at {where}.json_schema: 'minLength' / 'maxLength' is not "
                               f"enforced in style {node['style']!r} (its strings take any length)")  # fmt: skip

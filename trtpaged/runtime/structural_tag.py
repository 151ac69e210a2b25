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

from typing import Any, Mapping

from trtpaged.errors import RequestError
from trtpaged.json_input import json_kind

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
    return dict(document), list(_schemas_in(document["format"], "format"))


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
    walk. A node without a type is one too when it has a json_schema: xgrammar reads such a node as the first form
    its keys fit (a tag, a const_string, then a json_schema); its other keys are still walked."""
    found, todo = [], [(path, fmt)]
    while todo:
        where, node = todo.pop()
        if isinstance(node, Mapping):
            schema_node = "json_schema" in node and node.get("type", _SCHEMA_NODES[0]) in _SCHEMA_NODES
            if schema_node:
                found.append((where, node))
            todo.extend((f"{where}.{key}", value) for key, value in reversed(list(node.items()))
                        if not (schema_node and key == "json_schema"))  # fmt: skip
        elif isinstance(node, list):
            todo.extend((f"{where}[{i}]", value) for i, value in reversed(list(enumerate(node))))
    return found


def schema_style(node: Mapping[str, Any]) -> Any:
    """The style a schema node (`schema_nodes`) is written in: a json_schema node's `style` (a node without a type
    is one); xgrammar reads none on a qwen_xml_parameter node (always its XML form)."""
    return node.get("style") if node.get("type", _SCHEMA_NODES[0]) == _SCHEMA_NODES[0] else None

"""JSON-schema keywords the grammar engine (xgrammar) would accept and not enforce.

xgrammar compiles these schemas without a word and then lets through outputs that break them: a request
would finish "stop" with JSON that fails its own schema. Such a schema is refused instead, naming the
keyword and where it sits, as vLLM's xgrammar backend refuses what it cannot enforce. Measured against
xgrammar 0.2.9 (a violating document accepted by the compiled grammar): the keywords below, formats outside
`ENFORCED_FORMATS`, a `$ref` outside the document or with constraints beside it, a `required` property that
`properties` does not define, and a `oneOf` whose branches can overlap (compiled as `anyOf`).
"""

from __future__ import annotations

from typing import Any, Iterator, Optional

# keyword -> why it is refused (each one compiled and shown to accept a document that breaks it)
UNENFORCED = {
    "not": "'not' is not enforced",
    "contains": "'contains' is not enforced",
    "minContains": "'minContains' is not enforced",
    "maxContains": "'maxContains' is not enforced",
    "if": "'if' / 'then' / 'else' are not enforced",
    "then": "'if' / 'then' / 'else' are not enforced",
    "else": "'if' / 'then' / 'else' are not enforced",
    "dependentRequired": "'dependentRequired' is not enforced",
    "dependentSchemas": "'dependentSchemas' is not enforced",
    "dependencies": "'dependencies' is not enforced",
}
ENFORCED_FORMATS = frozenset({
    "date", "time", "date-time", "duration", "email", "hostname", "ipv4", "ipv6", "uri", "uri-reference", "uuid",
    "uri-template", "json-pointer", "relative-json-pointer",
})  # fmt: skip
# what may sit beside a $ref without constraining anything
_REF_SIBLINGS = frozenset({"$ref", "$defs", "definitions", "$schema", "$id", "$comment", "title", "description",
                           "default", "examples", "deprecated", "readOnly", "writeOnly"})  # fmt: skip
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SUBSCHEMA = ("additionalProperties", "items", "propertyNames", "unevaluatedProperties", "unevaluatedItems")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")


def unenforced_feature(schema: Any) -> Optional[str]:
    """Why the grammar engine would not enforce `schema` (a parsed JSON schema), naming the keyword and its place
    as a JSON pointer (`#/properties/tags`); None when every keyword in it is enforced."""
    for path, node in _subschemas(schema):
        for keyword, why in UNENFORCED.items():
            if keyword in node:
                return f"{why} (at {path})"
        if node.get("uniqueItems") is True:
            return f"'uniqueItems' is not enforced (at {path})"
        fmt = node.get("format")
        if isinstance(fmt, str) and fmt not in ENFORCED_FORMATS and _may_be_string(node):
            return f"format {fmt!r} is not enforced; enforced: {', '.join(sorted(ENFORCED_FORMATS))} (at {path})"
        ref = node.get("$ref")
        if isinstance(ref, str):
            if not ref.startswith("#"):
                return f"a $ref outside the schema ({ref[:80]!r}) is not followed (at {path})"
            beside = sorted(set(node) - _REF_SIBLINGS)
            if beside:
                return f"constraints beside a $ref ({', '.join(beside)}) are not enforced (at {path})"
        all_of = node.get("allOf")
        if isinstance(all_of, list) and len(all_of) > 1:
            return f"'allOf' with more than one schema is not enforced (at {path})"
        one_of = node.get("oneOf")
        if isinstance(one_of, list) and len(one_of) > 1 and not _disjoint(one_of):
            return (f"'oneOf' whose branches may overlap is enforced as 'anyOf' (at {path}); use 'anyOf', or give "
                    "the branches distinct types or a property with a distinct 'const' each")
        required, properties = node.get("required"), node.get("properties")
        if isinstance(required, list):
            defined = properties if isinstance(properties, dict) else {}
            missing = next((name for name in required if name not in defined), None)
            if missing is not None:
                return f"required property {missing!r} is not defined in 'properties', so it is never generated " \
                       f"(at {path})"
    return None


def _subschemas(schema: Any) -> Iterator[tuple[str, dict]]:
    """Every schema object in `schema` with its JSON pointer, depth first (the nesting is bounded by the caller)."""
    todo = [("#", schema)]
    while todo:
        path, node = todo.pop()
        if not isinstance(node, dict):
            continue
        yield path, node
        for key in _SUBSCHEMA_MAPS:
            children = node.get(key)
            if isinstance(children, dict):
                todo.extend((f"{path}/{key}/{_escaped(name)}", child) for name, child in children.items())
        for key in _SUBSCHEMA:
            if isinstance(node.get(key), dict):
                todo.append((f"{path}/{key}", node[key]))
        for key in _SUBSCHEMA_LISTS:
            children = node.get(key)
            if isinstance(children, list):
                todo.extend((f"{path}/{key}/{i}", child) for i, child in enumerate(children))


def _escaped(name: Any) -> str:
    return str(name).replace("~", "~0").replace("/", "~1")


def _may_be_string(node: dict) -> bool:
    kind = node.get("type")
    return kind is None or kind == "string" or (isinstance(kind, list) and "string" in kind)


def _disjoint(branches: list) -> bool:
    """Whether no document can match two branches, by a simple proof: pairwise distinct single types, or a
    property every branch requires with a distinct `const` in each (a discriminator)."""
    if not all(isinstance(b, dict) for b in branches):
        return False
    types = [b.get("type") for b in branches]
    if all(isinstance(t, str) for t in types) and len(set(types)) == len(types) \
            and not {"integer", "number"} <= set(types):  # an integer is a number too
        return True
    common = set.intersection(*(set(b.get("required") or ()) for b in branches))
    for name in sorted(common):
        consts = [_const_of(b.get("properties", {}).get(name)) for b in branches]
        if all(c is not None for c in consts) and len({repr(c) for c in consts}) == len(consts):
            return True
    return False


def _const_of(schema: Any) -> Any:
    if not isinstance(schema, dict):
        return None
    if "const" in schema:
        return (schema["const"],)
    enum = schema.get("enum")
    return (enum[0],) if isinstance(enum, list) and len(enum) == 1 else None

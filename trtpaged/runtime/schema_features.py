"""JSON-schema keywords the grammar engine (xgrammar) would accept and not enforce.

xgrammar compiles these schemas without a word and then lets through outputs that break them: a request
would finish "stop" with JSON that fails its own schema. Such a schema is refused instead, naming the
keyword and where it sits, as vLLM's xgrammar backend refuses what it cannot enforce. Measured against
xgrammar 0.2.9 (a violating document accepted by the compiled grammar): the keywords in UNENFORCED, a string
length beside a pattern or a format (but a uri's: `schema_formats.length_beside_format`), multipleOf on a
number, type-specific constraints in a schema without a type, constraints beside a $ref / anyOf / oneOf, a $ref
outside the document, a `required` property that
`properties` does not define, an `enum` / `const` value that the node's other constraints refuse (the grammar
follows the values), a `oneOf` whose branches can overlap (compiled as `anyOf`), and a `format` that xgrammar
writes no grammar for (`schema_formats.py`: regex, idn-email, idn-hostname, iri, iri-reference). Other formats
unknown to JSON Schema are annotations (validators do not check them), so they are not refused.
"""

from __future__ import annotations

import json
import math
import re
import sys
from typing import Any, Iterator, Optional

from trtpaged.runtime.schema_formats import length_beside_format, unenforced_format

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
    "$dynamicRef": "'$dynamicRef' is not followed",
    "$recursiveRef": "'$recursiveRef' is not followed",
}
_JSON_TYPES = {"string": (str,), "integer": (int, float), "number": (int, float), "boolean": (bool,),
               "null": (type(None),), "array": (list,), "object": (dict,)}  # fmt: skip
# what may sit beside a $ref, anyOf or oneOf without constraining anything
_ANNOTATIONS = frozenset({"$defs", "definitions", "$schema", "$id", "$comment", "title", "description", "default",
                          "examples", "deprecated", "readOnly", "writeOnly", "discriminator"})  # fmt: skip
# keywords that constrain one type only: without a "type" (or enum / const / $ref / a combinator) they are ignored
_TYPED = frozenset({"minLength", "maxLength", "pattern", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
                    "multipleOf", "minItems", "maxItems", "items", "prefixItems", "properties", "required",
                    "additionalProperties", "minProperties", "maxProperties", "patternProperties",
                    "propertyNames"})  # fmt: skip
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SUBSCHEMA = ("additionalProperties", "items", "propertyNames", "unevaluatedProperties", "unevaluatedItems")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_MAX_REF_HOPS = 32
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1  # an integer's bounds as the grammar compiler holds them
_NUMERIC_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")


def unenforced_feature(schema: Any) -> Optional[str]:
    """Why the grammar engine would not enforce `schema` (a parsed JSON schema), naming the keyword and its place
    as a JSON pointer (`#/properties/tags`); None when every constraint in it is enforced. Values of the wrong
    type are left to the grammar compiler, which names them (but for a bound past the float64 range, which
    it refuses without a reason)."""
    for path, node in subschemas(schema):
        why = _node_feature(node, schema)
        if why is not None:
            return f"{why} (at {path})"
    return None


def has_string_length(schema: Any) -> bool:
    """Whether a string in `schema` has a minLength or maxLength (the grammar engine needs a mend for them,
    `structured.py`)."""
    return any("minLength" in node or "maxLength" in node for _, node in subschemas(schema))


def _node_feature(node: dict, root: Any) -> Optional[str]:
    for keyword, why in UNENFORCED.items():
        if keyword in node:
            return why
    if node.get("uniqueItems") is True:
        return "'uniqueItems' is not enforced"
    if ("pattern" in node or "format" in node) and ("minLength" in node or "maxLength" in node):
        why = length_beside_format(node)
        if why is not None:
            return why
    if "pattern" in node and "format" in node:
        return "a 'pattern' beside a 'format' is not enforced (the format is)"
    unchecked = unenforced_format(node)
    if unchecked is not None:
        return unchecked
    for combinator in ("anyOf", "oneOf", "allOf"):
        if node.get(combinator) == []:
            return f"empty '{combinator}' is not a valid schema (it needs at least one)"
    mismatch = (_value_outside_type(node) or _bound_past_float_range(node) or _integer_bound_past_int64(node)
                or _value_breaking_constraints(node, root))
    if mismatch is not None:
        return mismatch
    if "multipleOf" in node and not _numbers_are_integers(node.get("type")):
        return "'multipleOf' is enforced on integers only"
    if "multipleOf" in node and not _integer_multiple_enforced(node["multipleOf"]):
        return (f"'multipleOf' ({node['multipleOf']!r:.40}) of an integer is enforced only as a whole number from 1 "
                f"to {_MAX_MULTIPLE_OF} (xgrammar ignores another)")
    ref = node.get("$ref")
    if isinstance(ref, str) and not (ref == "#" or ref.startswith("#/")):
        if not ref.startswith("#"):
            return f"$ref outside the schema ({ref[:80]!r}) is not followed"
        return f"$ref to an anchor ({ref[:80]!r}), not a JSON pointer, is not followed"
    for combinator, allowed in (("$ref", ()), ("anyOf", ("type",)), ("oneOf", ("type",))):
        if combinator in node:
            beside = sorted(set(node) - _ANNOTATIONS - {combinator, *allowed})
            if beside:
                return f"constraints beside {combinator} ({', '.join(beside)}) are not enforced"
    typed = sorted(k for k in _TYPED if k in node)
    if typed and not any(k in node for k in ("type", "enum", "const", "$ref", "anyOf", "oneOf", "allOf")):
        return f"constraints without a 'type' ({', '.join(typed)}) are not enforced"
    all_of = node.get("allOf")
    if isinstance(all_of, list) and len(all_of) > 1:
        return "'allOf' with more than one schema is not enforced"
    one_of = node.get("oneOf")
    if isinstance(one_of, list) and len(one_of) > 1 and not _disjoint(one_of, root):
        return ("'oneOf' whose branches may overlap is enforced as 'anyOf'; use 'anyOf', or give the branches "
                "distinct types or a required property with a distinct 'const' each")
    shadowed = _shadowed_pattern_property(node)
    if shadowed is not None:
        return shadowed
    required, properties = node.get("required"), node.get("properties")
    if isinstance(required, list):
        defined = properties if isinstance(properties, dict) else {}
        missing = next((name for name in required if isinstance(name, str) and name not in defined), None)
        if missing is not None:
            return f"required property {missing!r} is not defined in 'properties', so the grammar does not require it"
    return None


def _value_outside_type(node: dict) -> Optional[str]:
    """An `enum` or `const` value that the node's `type` does not allow: the grammar follows the values and
    ignores the type, so it would let the value through."""
    types = node.get("type")
    types = [types] if isinstance(types, str) else types
    if not isinstance(types, list) or not all(isinstance(t, str) and t in _JSON_TYPES for t in types):
        return None
    values = [node["const"]] if "const" in node else node.get("enum") if isinstance(node.get("enum"), list) else []
    for value in values:
        fits = any(isinstance(value, _JSON_TYPES[t]) and not (isinstance(value, bool) and t in ("integer", "number"))
                   and not (t == "integer" and isinstance(value, float) and not value.is_integer()) for t in types)
        if not fits:
            keyword = "const" if "const" in node else "enum"
            return (f"{keyword} value {json.dumps(value)[:40]} is not of type {'/'.join(types)} "
                    "(the grammar would allow it)")
    return None


def _value_breaking_constraints(node: dict, root: Any) -> Optional[str]:
    """An `enum` or `const` value that the node's other constraints refuse (`maxLength`, `maximum`, `pattern`,
    `format`, ...): the grammar follows the values alone, so it would let the value through."""
    keyword = "const" if "const" in node else "enum" if isinstance(node.get("enum"), list) else None
    rest = {k: v for k, v in node.items() if k not in ("const", "enum")}
    if keyword is None or not set(rest) - _ANNOTATIONS - {"type"}:
        return None
    import jsonschema

    values = [node["const"]] if keyword == "const" else node["enum"]
    try:
        checker = jsonschema.Draft202012Validator(root, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
        errors = [(value, jsonschema.exceptions.best_match(checker.evolve(schema=rest).iter_errors(value)))
                  for value in values]  # fmt: skip
    except Exception:  # noqa: BLE001 - a malformed schema is left to the grammar compiler, which names it
        return None
    value, error = next(((v, e) for v, e in errors if e is not None), (None, None))
    if error is None:
        return None
    return (f"{keyword} value {json.dumps(value)[:40]} breaks its '{error.validator}' "
            "(the grammar follows the values and would allow it)")


def _shadowed_pattern_property(node: dict) -> Optional[str]:
    """A `properties` name that a `patternProperties` pattern with another schema matches as well: both schemas
    apply to its value, and the grammar enforces only the one in `properties`."""
    properties, patterns = node.get("properties"), node.get("patternProperties")
    if not isinstance(properties, dict) or not isinstance(patterns, dict):
        return None
    for pattern, extra in patterns.items():
        try:
            regex = re.compile(pattern)
        except (re.error, TypeError):  # an ECMA-only pattern: left to the grammar compiler
            continue
        name = next((name for name, schema in properties.items()
                     if regex.search(name) and not _same_schema(extra, schema)), None)  # fmt: skip
        if name is not None:
            return (f"property {name!r} matches 'patternProperties' {pattern[:40]!r} as well, whose schema is not "
                    "enforced on it (only its 'properties' schema is)")
    return None


def _same_schema(extra: Any, schema: Any) -> bool:
    """Whether `extra` is `schema`, annotations aside (a `patternProperties` schema that adds nothing; one that
    constrains less, `{}`, still lets the pattern's spelling of the name in a second time with any value)."""

    def constraints(node: Any) -> Any:
        return {k: v for k, v in node.items() if k not in _ANNOTATIONS} if isinstance(node, dict) else node

    return constraints(extra) == constraints(schema)


def _bound_past_float_range(node: dict) -> Optional[str]:
    """A numeric bound that no float64 holds (`10**400`, or 1e400 read as infinity): the grammar compiler fails
    on it without saying why."""
    for keyword in _NUMERIC_BOUNDS:
        value = node.get(keyword)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and not _fits_float64(value):
            shown = f"a {len(str(abs(value)))}-digit integer" if isinstance(value, int) else str(value)
            return f"'{keyword}' ({shown}) is past the float64 range (+-{sys.float_info.max:.4g})"
    return None


def _numbers_are_integers(types: Any) -> bool:
    """Whether a schema's `type` lets integers but no other numbers through: "integer", or a list of types holding
    "integer" and not "number" (["integer", "null"]: zod's nullable integer), where xgrammar writes the integer's
    multipleOf (the other types have none)."""
    types = [types] if isinstance(types, str) else types
    return isinstance(types, list) and "integer" in types and "number" not in types


_MAX_MULTIPLE_OF = 1024  # the largest integer multipleOf xgrammar 0.2.9 writes a grammar for


def _integer_multiple_enforced(value: Any) -> bool:
    """Whether an integer's `multipleOf` holds in xgrammar's grammar: a whole number up to _MAX_MULTIPLE_OF is
    written; another is ignored (with a warning), which is right only where every integer is a multiple (0.5)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0 or not math.isfinite(value):
        return True  # a value xgrammar refuses itself, naming it
    if float(value).is_integer():
        return value <= _MAX_MULTIPLE_OF
    return (1 / value).is_integer()


def _integer_bound_past_int64(node: dict) -> Optional[str]:
    """An integer's bound outside the 64-bit range (an exclusive one at its end): the grammar compiler refuses it
    as 'Integer exceeds maximum limit', naming neither the keyword nor the limit. Not beside an `enum` / `const`:
    the grammar follows the values there, and compiles whatever the bound."""
    types = node.get("type")
    if not (types == "integer" or isinstance(types, list) and "integer" in types) or "enum" in node or "const" in node:
        return None
    for keyword, low, high in (("minimum", _INT64_MIN, _INT64_MAX), ("maximum", _INT64_MIN, _INT64_MAX),
                               ("exclusiveMinimum", _INT64_MIN, _INT64_MAX - 1),
                               ("exclusiveMaximum", _INT64_MIN + 1, _INT64_MAX)):  # fmt: skip
        value = node.get(keyword)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and not low <= value <= high:
            shown = value if isinstance(value, float) or abs(value) < 10**24 else f"{value:.6g}"  # a float exactly
            return f"'{keyword}' ({shown}) of an integer is outside the supported range {low} to {high}"
    return None


def _fits_float64(value: int | float) -> bool:
    try:
        return math.isfinite(float(value))
    except OverflowError:
        return False


def subschemas(schema: Any) -> Iterator[tuple[str, dict]]:
    """Every schema object in `schema` with its JSON pointer, depth first (the nesting is bounded by the caller):
    the values of keywords that hold schemas, never those of `const`, `enum`, `default` or `examples`, and the
    target of each local `$ref` wherever it is (`#/x`: xgrammar compiles it as a schema); each object once."""
    todo, seen = [("#", schema)], set()
    while todo:
        path, node = todo.pop()
        if not isinstance(node, dict) or id(node) in seen:
            continue
        seen.add(id(node))
        yield path, node
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/"):
            todo.append((ref, _resolved({"$ref": ref}, schema)))
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


def _resolved(node: Any, root: Any) -> Any:
    """`node` with local $refs (`#/...`) followed, up to a bound (None where one does not resolve)."""
    for _ in range(_MAX_REF_HOPS):
        ref = node.get("$ref") if isinstance(node, dict) else None
        if not isinstance(ref, str):
            return node
        if not ref.startswith("#"):
            return None
        node = root
        for part in ref[1:].split("/")[1:] if ref != "#" else []:
            node = _pointer_step(node, part.replace("~1", "/").replace("~0", "~"))
    return None


def _pointer_step(node: Any, part: str) -> Any:
    """A JSON pointer's step into `node` (RFC 6901, as xgrammar follows it): an object's member, or an array's
    item by its index (digits, no leading zero); None where there is none."""
    if isinstance(node, dict):
        return node.get(part)
    # no longer than the list's own length in digits: an index past it is none, however many digits it has
    if isinstance(node, list) and part.isdecimal() and part.isascii() and (part == "0" or part[0] != "0") \
            and len(part) <= len(str(len(node))):  # fmt: skip
        index = int(part)
        return node[index] if index < len(node) else None
    return None


def _disjoint(branches: list, root: Any) -> bool:
    """Whether no document can match two branches, by a simple proof: pairwise distinct single types, or a
    property every branch requires with a distinct `const` (or one-value `enum`) in each (a discriminator)."""
    branches = [_resolved(b, root) for b in branches]
    if not all(isinstance(b, dict) for b in branches):
        return False
    types = [b.get("type") for b in branches]
    if all(isinstance(t, str) for t in types) and len(set(types)) == len(types) \
            and not {"integer", "number"} <= set(types):  # an integer is a number too
        return True
    required = [b.get("required") for b in branches]
    if not all(isinstance(r, list) for r in required):
        return False
    common = set.intersection(*(set(r for r in req if isinstance(r, str)) for req in required))
    for name in sorted(common):
        consts = [_const_of(_resolved((b.get("properties") or {}).get(name) if isinstance(b.get("properties"), dict)
                                      else None, root)) for b in branches]  # fmt: skip
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

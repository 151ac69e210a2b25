"""JSON-schema `format`s held to their definitions: a pattern for each format xgrammar writes too loosely, and the
formats it does not check at all.

xgrammar 0.2.9 writes a grammar for date, time, date-time, duration, email, hostname, ipv4, ipv6, uri,
uri-reference, uri-template, uuid, json-pointer and relative-json-pointer; some are looser than the format, so an
output finished "stop" with a string its own schema refuses (jsonschema's format checker, char-level walks through
the compiled grammar): a date whose day its month has not (2023-02-30, 2023-04-31, 2023-02-29, 0000-01-01), a
time on second 60 whatever the hour (12:30:60Z: Python's datetime and rfc3339-validator refuse every second 60),
an ipv4 octet with a leading zero (012.1.1.1, which Python's ipaddress refuses, as read as octal elsewhere) and a
hostname label past 63 characters or a name past 253. Each of those formats is compiled as the pattern below,
which takes what the format takes (but second 60, and the hostnames of more than 4 labels that none of
`_HOSTNAME`'s shapes takes: a regex cannot count a name's 253 characters beside its labels' 63). `regex`,
`idn-email`, `idn-hostname`, `iri` and `iri-reference` get no grammar from xgrammar (any string), and a format
without a `type` none either (any JSON value), so a schema that relies on one is refused. xgrammar writes no
minLength / maxLength beside a format; a uri's are held here (`length_beside_format`, `bounded_uri_pattern`:
pydantic's HttpUrl and AnyUrl have them).
"""

from __future__ import annotations

import copy
from typing import Any, Collection, Optional

_YEAR = "([1-9][0-9]{3}|0[1-9][0-9]{2}|00[1-9][0-9]|000[1-9])"  # 0001-9999, as Python's date
_LEAP_YEAR = "([0-9]{2}(0[48]|[2468][048]|[13579][26])|(0[48]|[2468][048]|[13579][26])00)"
_MONTH_DAY = "((0[13578]|1[02])-(0[1-9]|[12][0-9]|3[01])|(0[469]|11)-(0[1-9]|[12][0-9]|30)|02-(0[1-9]|1[0-9]|2[0-8]))"
_DATE = f"({_YEAR}-{_MONTH_DAY}|{_LEAP_YEAR}-02-29)"
_HOUR = "([01][0-9]|2[0-3])"
_TIME = f"{_HOUR}:[0-5][0-9]:[0-5][0-9](\\.[0-9]+)?(Z|[+-]{_HOUR}:[0-5][0-9])"
_OCTET = "(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9][0-9]|[0-9])"


def _label(most: int) -> str:
    """A hostname label of 1 to `most` letters, digits and hyphens, neither first nor last a hyphen."""
    return f"[a-z0-9]([a-z0-9-]{{0,{most - 2}}}[a-z0-9])?"


# RFC 1123 bounds a name to 253 characters, which a regex cannot count beside its labels' 63, so the name is one of
# these shapes, each at most 253 characters in all (re's parser reads their widths): up to 4 labels of 63 (the 4th
# of 61); 5 to 8 of 30; one label of 63 after up to 3 and before up to 8 of 15 (www.<63>.co.uk); two of 63 among
# up to 7 of 15, 2 before, 2 between and 3 after (<service>.<namespace>.svc.cluster.local); three of 63 then up
# to 7 of 7 (<pod>.<service>.<namespace>.svc.cluster.local); 9 to 25 of 9; or 9 to 50 of 4 (ip6.arpa names)
_HOSTNAME = (f"({_label(63)}(\\.{_label(63)}){{0,2}}(\\.{_label(61)})?|{_label(30)}(\\.{_label(30)}){{4,7}}"
             f"|({_label(15)}\\.){{0,3}}{_label(63)}(\\.{_label(15)}){{0,8}}"
             f"|({_label(15)}\\.){{0,2}}{_label(63)}(\\.{_label(15)}){{0,2}}\\.{_label(63)}(\\.{_label(15)}){{0,3}}"
             f"|{_label(63)}(\\.{_label(63)}){{2}}(\\.{_label(7)}){{0,7}}"
             f"|{_label(9)}(\\.{_label(9)}){{8,24}}|{_label(4)}(\\.{_label(4)}){{8,49}})")  # fmt: skip
FORMAT_PATTERNS = {
    "date": f"^{_DATE}$",
    "time": f"^{_TIME}$",
    "date-time": f"^{_DATE}T{_TIME}$",
    "ipv4": f"^{_OCTET}(\\.{_OCTET}){{3}}$",
    "hostname": f"^{_HOSTNAME}$",
}
# formats jsonschema's checker knows and xgrammar writes no grammar for
UNENFORCED_FORMATS = ("regex", "idn-email", "idn-hostname", "iri", "iri-reference")
# formats xgrammar writes a grammar for, on a string (a node without a "type" gets any JSON value)
GRAMMAR_FORMATS = (*FORMAT_PATTERNS, "duration", "email", "ipv6", "uri", "uri-reference", "uri-template", "uuid",
                   "json-pointer", "relative-json-pointer")  # fmt: skip


# a uri held to a length: its parts as RFC 3986 has them, but percent-encoding, userinfo and IP literals, each part
# bounded so that the longest is `maxLength` (xgrammar's uri takes any length, and writes no minLength / maxLength
# beside a format); a string of these characters, past the scheme, is a path then a query
_URI_PATH = "[a-zA-Z0-9._~!$&'()*+,;=:@-]"  # a path's characters but "/" (pchar)
_URI_QUERY = "[a-zA-Z0-9._~!$&'()*+,;=:@/?-]"  # a query's or a fragment's (pchar, "/" and "?")
_URI_HOST = "[a-zA-Z0-9._~!$&'()*+,;=-]"  # a reg-name's
_URI_PORT = "([0-9]{1,4}|[1-5][0-9]{4}|6[0-4][0-9]{3}|65[0-4][0-9]{2}|655[0-2][0-9]|6553[0-5])"  # 0-65535 (or none)
URI_SHORTEST = 2  # "a:", the shortest uri: a minLength up to this holds by the format
URI_LEAST_MAX_LENGTH = 32  # a maxLength below this is refused beside format uri
# a longer maxLength is held as this: xgrammar reads a repeat's count as 32 bits (maxLength 18000000000, its path
# as eights, was a 400 "Expect integer, but got -2044967335"), and no output here comes near 2 GiB of text
URI_MOST_MAX_LENGTH = 2**31 - 1


def _repeat(chars: str, least: int, most: int) -> str:
    """A regex for `least` to `most` (or up to 7 fewer) of `chars`: past `least`, a repeat of 8 at a time, then up
    to 7. xgrammar compiles a long repeat of a class in JSON text slowly (`[a-z]{0,1500}` in 0.4 s on SmolLM2's
    vocabulary, 0.02 s as eights)."""
    first = f"{chars}{{{least}}}" if least else ""
    if most - least < 16:
        return f"{first}{chars}{{0,{most - least}}}"
    return f"{first}({chars}{{8}}){{0,{(most - least - 7) // 8}}}{chars}{{0,7}}"


def bounded_uri_pattern(most: int) -> str:
    """A pattern for a uri of at most `most` (URI_LEAST_MAX_LENGTH or more; past URI_MOST_MAX_LENGTH, that many)
    characters: a scheme of up to an eighth (8 to 16), a fragment of up to an eighth (256 at most), and between
    them an authority (a host and a port) and what is left for the path and query (a host up to 16, 64 or 253
    characters leaves that much less), or a path and query alone."""
    most = min(most, URI_MOST_MAX_LENGTH)
    scheme = min(16, max(8, most // 8))  # https and mailto at any maxLength
    fragment = min(256, most // 8)
    rest = most - scheme - 1 - (fragment + 1)  # past "scheme:", before "#fragment"
    hier, shorter = [], 0
    for host in sorted({min(longest, rest - 9) for longest in (16, 64, 253)}):
        path = rest - 2 - host - 6 - 1  # past "//host:port", before the path's first character
        least = shorter + 1 if shorter else 0  # an empty host too (file:///etc/hosts)
        hier.append(f"//{_repeat(_URI_HOST, least, host)}(:{_URI_PORT}?)?([/?]{_repeat(_URI_QUERY, 0, path)})?")
        shorter = host
    hier += [f"/?([?]|{_URI_PATH}){_repeat(_URI_QUERY, 0, rest - 2)}", "/"]
    return f"^[a-zA-Z][a-zA-Z+.-]{{0,{scheme - 1}}}:({'|'.join(hier)})?(#{_repeat(_URI_QUERY, 0, fragment)})?$"


def length_beside_format(node: dict) -> Optional[str]:
    """Why a node's minLength / maxLength beside its pattern or format would not be enforced; None for those of a
    uri (`formats_as_patterns`: a minLength up to URI_SHORTEST holds by the format, a maxLength is a
    `bounded_uri_pattern`)."""
    least, most = node.get("minLength", 0), node.get("maxLength", URI_LEAST_MAX_LENGTH)
    if "pattern" in node or node.get("format") != "uri" or not all(type(n) is int for n in (least, most)):
        return "minLength / maxLength beside a pattern or a format are not enforced"
    if least > URI_SHORTEST:
        return f"minLength {least} beside format 'uri' is not enforced (a uri may have {URI_SHORTEST} characters)"
    if most < URI_LEAST_MAX_LENGTH:
        return f"maxLength {most} beside format 'uri' is below the {URI_LEAST_MAX_LENGTH} supported"
    return None


def unenforced_format(node: dict) -> Optional[str]:
    """Why `node`'s `format` would not be enforced (one xgrammar writes no grammar for); None where it is, or where
    the node's `enum` / `const` values decide the output."""
    fmt = node.get("format")
    if "enum" in node or "const" in node:
        return None
    if fmt in UNENFORCED_FORMATS:
        return f"format '{fmt}' is not enforced (the grammar would take any string)"
    if fmt in GRAMMAR_FORMATS and not any(k in node for k in ("type", "$ref", "anyOf", "oneOf", "allOf")):
        return f"format '{fmt}' without a 'type' is not enforced (the grammar would take any JSON value)"
    return None


def formats_as_patterns(schema: Any, hidden: bool = True, formats: Collection[str] = tuple(FORMAT_PATTERNS)) -> Any:
    """`schema` (parsed) with each `format` among `formats` (of FORMAT_PATTERNS) a `pattern`, and each pattern hidden
    from xgrammar (`grammar_text.hidden_pattern`) where `hidden` (a copy; `schema` itself where it has neither). A
    node with an `enum` or `const` keeps its format: the grammar follows the values."""
    from trtpaged.runtime.grammar_text import hidden_pattern
    from trtpaged.runtime.schema_features import subschemas

    if not any(_rewritten(node, formats) or _uri_with_length(node) or isinstance(node.get("pattern"), str)
               for _, node in subschemas(schema)):  # fmt: skip
        return schema
    schema = copy.deepcopy(schema)
    for _, node in subschemas(schema):
        if _rewritten(node, formats):
            node["pattern"] = FORMAT_PATTERNS[node.pop("format")]
        elif _uri_with_length(node):
            node.pop("minLength", None)  # holds by the format (length_beside_format)
            if "maxLength" in node:
                node["pattern"] = bounded_uri_pattern(node.pop("maxLength"))
                del node["format"]
        if hidden and isinstance(node.get("pattern"), str):
            node["pattern"] = hidden_pattern(node["pattern"])
    return schema


def _rewritten(node: dict, formats: Collection[str]) -> bool:
    return (node.get("format") in formats and "pattern" not in node and "enum" not in node
            and "const" not in node)  # fmt: skip


def _uri_with_length(node: dict) -> bool:
    return (node.get("format") == "uri" and ("minLength" in node or "maxLength" in node) and "pattern" not in node
            and "enum" not in node and "const" not in node)  # fmt: skip

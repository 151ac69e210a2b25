"""Grammar-constrained decoding (xgrammar) in the runtime, on the tiny engine with temperature > 0: every
output validates against its JSON schema (jsonschema) / matches its regex / is one of its choices / parses
under its EBNF grammar / follows its structural tag (begin, JSON, end, read by json's decoder); unconstrained
greedy requests batched with constrained ones are unchanged."""

from __future__ import annotations

import datetime
import ipaddress
import json
import re
from typing import Any

import pytest

from trtpaged import LLM, GuidedDecodingParams, SamplingParams
from trtpaged.errors import RequestError
from trtpaged.runtime.sampling_params import StructuredOutputsParams as Grammar
from trtpaged.runtime.structured import mended_schema_grammar, mended_structural_tag_grammar

xgrammar = pytest.importorskip("xgrammar", reason="xgrammar is not installed (pip install xgrammar)")
jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is not installed")

# Bounded so that a random-weight model finishes it: strings by pattern.
SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "ok": {"type": "boolean"},
        "tag": {"enum": ["red", "green", "blue"]},
        "code": {"type": "string", "pattern": "^[a-z]{1,6}$"},
        "items": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 3},
    },
    "required": ["id", "ok", "tag", "code", "items"],
    "additionalProperties": False,
}
PROMPTS = [f"prompt {i}:" for i in range(8)]


@pytest.fixture(scope="module")
def llm(tiny_engine_dir):
    return LLM(tiny_engine_dir, device="cpu")


def texts(outs):
    return [(c.text, c.finish_reason) for o in outs for c in o.outputs]


def test_json_schema_outputs_validate(llm):
    params = SamplingParams(max_tokens=100, temperature=1.0, n=4, structured_outputs=Grammar(json=SCHEMA))
    samples = texts(llm.generate(PROMPTS, params))
    assert len(samples) == 32
    for text, reason in samples:
        assert reason == "stop", text
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len({t for t, _ in samples}) > 8  # it samples


def test_length_bounded_strings_are_json_strings(llm):
    """A string with maxLength: xgrammar's own grammar for it lets raw control characters through (invalid JSON:
    about 8% of such seeds failed json.loads); the server's grammar for it does not, and keeps the bound. Truth:
    the strict JSON parser and jsonschema. xgrammar's class also takes the bytes of surrogate code points (no
    UTF-8: one character to the grammar, three U+FFFD in the text, past maxLength); the mended one does not."""
    from xgrammar.testing import _is_grammar_accept_string

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "note": {"type": "string", "maxLength": 8},
                                               "age": {"type": "integer"}},
              "required": ["name", "note", "age"], "additionalProperties": False}  # fmt: skip
    control = '{"name": "a\x1db", "note": "xx", "age": 1}'
    surrogate = b'{"name": "a\xed\xb2\x85b", "note": "xx", "age": 1}'  # U+DC85's bytes: no UTF-8, one "character"
    upstream = xgrammar.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
    assert _is_grammar_accept_string(upstream, control) and _is_grammar_accept_string(upstream, surrogate)
    mended = xgrammar.Grammar.from_ebnf(mended_schema_grammar(json.dumps(schema)))
    assert not _is_grammar_accept_string(mended, control) and not _is_grammar_accept_string(mended, surrogate)
    for fine in ('{"name": "a\ud585😀", "note": "xx", "age": 1}', '{"name": "abc", "note": "12345678", "age": -2}'):
        assert _is_grammar_accept_string(mended, fine), fine
    params = SamplingParams(max_tokens=120, temperature=1.0, seed=0, n=4, structured_outputs=Grammar(json=schema))
    samples = texts(llm.generate([f"person {i}:" for i in range(12)], params))
    stopped = [t for t, reason in samples if reason == "stop"]
    assert len(stopped) > 30
    for text in stopped:
        jsonschema.validate(json.loads(text), schema)  # strict JSON: no raw control character
        assert "\ufffd" not in text  # no surrogate's bytes either (one character to xgrammar, three U+FFFD here)


def test_json_object_regex_choice_and_grammar(llm):
    def run(grammar, n=8, max_tokens=40):
        return texts(llm.generate(PROMPTS[:2], SamplingParams(max_tokens=max_tokens, temperature=1.0, n=n,
                                                               structured_outputs=grammar)))  # fmt: skip

    for text, reason in run(Grammar(json_object=True), max_tokens=120):
        if reason == "stop":  # a random model may not close an unbounded object within max_tokens
            assert isinstance(json.loads(text), dict)
        else:
            assert text.startswith("{")
    for text, reason in run(Grammar(regex=r"[0-9]{3}-[a-z]{2,4}")):
        assert reason == "stop" and re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", text), text
    choices = ("yes", "no", "maybe", "it depends")
    picked = [t for t, _ in run(Grammar(choice=choices))]
    assert set(picked) <= set(choices) and len(set(picked)) > 1
    ebnf = 'root ::= ("a" | "b") digit digit\ndigit ::= [0-9]'
    for text, reason in run(Grammar(grammar=ebnf)):
        assert reason == "stop" and re.fullmatch(r"[ab][0-9]{2}", text), text


def test_constrained_requests_leave_unconstrained_greedy_outputs_unchanged(llm):
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:4], greedy)]
    constrained = [SamplingParams(max_tokens=100, temperature=1.0, structured_outputs=Grammar(json=SCHEMA)),
                   SamplingParams(max_tokens=24, temperature=0.0, structured_outputs=Grammar(regex="[a-z]+"))]
    mixed = llm.generate(PROMPTS[:4] + PROMPTS[4:6], [greedy] * 4 + constrained)
    assert [o.outputs[0].token_ids for o in mixed[:4]] == alone
    jsonschema.validate(json.loads(mixed[4].outputs[0].text), SCHEMA)


def test_constrained_outputs_stay_valid_across_preemption(tiny_engine_dir):
    small = LLM(tiny_engine_dir, device="cpu", num_kv_blocks=10, max_num_tokens=32)
    params = SamplingParams(max_tokens=100, temperature=1.0, seed=3, structured_outputs=Grammar(json=SCHEMA))
    outs = small.generate([p * 6 for p in PROMPTS[:6]], params)
    assert small.stats()["num_preemptions"] > 0
    for text, reason in texts(outs):
        assert reason == "stop"
        jsonschema.validate(json.loads(text), SCHEMA)
    assert small.stats()["kv_blocks_used"] == 0


def test_grammars_are_compiled_once_per_distinct_grammar(llm):
    before = llm.stats()["num_grammars_compiled"]
    schema = {"type": "object", "properties": {"k": {"enum": [1, 2]}}, "required": ["k"]}
    for _ in range(3):
        llm.generate(PROMPTS[:2], SamplingParams(max_tokens=20, structured_outputs=Grammar(json=schema)))
    assert llm.stats()["num_grammars_compiled"] == before + 1


@pytest.mark.parametrize("grammar", [Grammar(json={"type": 5}), Grammar(json="{not json"), Grammar(regex="(("),
                                     Grammar(grammar="root ::= ")])  # fmt: skip
def test_invalid_grammars_are_refused_naming_the_field(llm, grammar):
    with pytest.raises(RequestError) as info:
        llm.generate(["x"], SamplingParams(structured_outputs=grammar))
    assert info.value.field == "structured_outputs" and "invalid" in str(info.value)
    assert not llm.engine.has_unfinished()


@pytest.mark.parametrize("schema, named", [
    ({"type": "number", "minimum": 10**400}, "'minimum' (a 401-digit integer) is past the float64 range"),
    ('{"type": "object", "properties": {"x": {"type": "number", "exclusiveMaximum": -1e400}}}',
     "'exclusiveMaximum' (-inf) is past the float64 range"),
    ({"type": "integer", "multipleOf": 10**309}, "'multipleOf' (a 310-digit integer)")])  # fmt: skip
def test_a_numeric_bound_past_the_float_range_is_refused_saying_so(llm, schema, named):
    """xgrammar fails on these without a reason (an empty RuntimeError: "invalid json: RuntimeError")."""
    with pytest.raises(RequestError) as info:
        llm.generate(["x"], SamplingParams(structured_outputs=Grammar(json=schema, origin="response_format")))
    assert info.value.field == "response_format" and named in str(info.value), str(info.value)
    assert not llm.engine.has_unfinished()


@pytest.mark.parametrize("schema, keyword, edge", [
    ({"allOf": [{"type": "integer", "minimum": 1e300}]}, "'minimum' (1e+300)", -(2**63)),
    ({"type": "integer", "minimum": -(2**63), "maximum": 2**64}, "'maximum' (18446744073709551616)", 2**63 - 1),
    ({"type": ["integer", "null"], "maximum": -(2**63) - 1}, "'maximum' (-9223372036854775809)", -(2**63)),
    ({"type": "integer", "exclusiveMinimum": 2**63 - 1}, "'exclusiveMinimum' (9223372036854775807)", 2**63 - 2),
])  # fmt: skip
def test_an_integer_bound_past_64_bits_is_refused_naming_the_limit(llm, schema, keyword, edge):
    """xgrammar holds an integer's bounds in 64 bits and refused one past them as 'Integer exceeds maximum limit',
    naming neither the keyword nor the limit. Truth: xgrammar refuses the schema, and takes it with the bound at
    the 64-bit edge the message names (a number's bounds are no integer's: 1e300 is taken there)."""
    with pytest.raises(RuntimeError):
        xgrammar.Grammar.from_json_schema(json.dumps(schema))
    key = keyword.split("'")[1]
    fixed = {**schema, key: edge} if key in schema else {"allOf": [{**schema["allOf"][0], key: edge}]}
    xgrammar.Grammar.from_json_schema(json.dumps(fixed))
    with pytest.raises(RequestError) as info:
        llm.generate(["x"], SamplingParams(structured_outputs=Grammar(json=schema, origin="response_format")))
    message = str(info.value)
    assert info.value.field == "response_format" and keyword in message and str(edge) in message, message
    assert not llm.engine.has_unfinished()
    llm.generate(["x"], SamplingParams(max_tokens=2, structured_outputs=Grammar(json={"type": "number",
                                                                                       "minimum": 1e300})))


@pytest.mark.parametrize("schema, values", [
    ({"type": "integer", "enum": [1, 2], "maximum": 2**64}, {1, 2}),
    ({"type": "integer", "const": 5, "minimum": -(2**70)}, {5}),
])  # fmt: skip
def test_an_integer_bound_past_64_bits_beside_its_values_compiles(llm, schema, values):
    """Beside an enum or const the grammar follows the values, whatever the bound: xgrammar compiles such a
    schema (was: refused as the bound past 64 bits). Truth: xgrammar compiles it, and the output is one of them."""
    xgrammar.Grammar.from_json_schema(json.dumps(schema))
    out = llm.generate(["x"], SamplingParams(max_tokens=8, structured_outputs=Grammar(json=schema)))[0].outputs[0]
    assert out.finish_reason == "stop" and json.loads(out.text) in values, out.text


# (schema, a document that breaks it): xgrammar 0.2.9 compiles each schema and its grammar accepts the document
UNENFORCED = [
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, [1, 1], "uniqueItems"),
    ({"type": "object", "properties": {"n": {"type": "integer", "not": {"const": 3}}}, "required": ["n"]},
     {"n": 3}, "not"),
    ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 5}}, [1], "contains"),
    ({"type": "integer", "if": {"minimum": 5}, "then": {"maximum": 6}}, 9, "if"),
    ({"allOf": [{"type": "integer", "minimum": 5}, {"type": "integer", "maximum": 6}]}, 9, "allOf"),
    ({"oneOf": [{"type": "integer", "minimum": 0}, {"type": "integer", "maximum": 10}]}, 5, "oneOf"),
    ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
      "dependentRequired": {"a": ["b"]}}, {"a": 1}, "dependentRequired"),
    ({"type": "string", "pattern": "^a+$", "maxLength": 2}, "aaaa", "beside a pattern"),
    ({"type": "number", "multipleOf": 0.5}, 0.3, "multipleOf"),
    ({"type": "integer", "multipleOf": 1025}, 3, "'multipleOf' (1025) of an integer is enforced only as a whole"),
    ({"type": "integer", "multipleOf": 2.5}, 3, "'multipleOf' (2.5) of an integer"),
    ({"type": ["integer", "number"], "multipleOf": 5}, 3, "'multipleOf' is enforced on integers only"),
    ({"type": ["integer", "null"], "multipleOf": 1025}, 3, "'multipleOf' (1025) of an integer"),
    ({"minimum": 5, "anyOf": [{"type": "integer"}, {"type": "null"}]}, 1, "beside anyOf (minimum)"),
    ({"anyOf": [{"maxLength": 2}, {"pattern": "^x"}]}, "hello", "without a 'type'"),
    ({"$defs": {"i": {"type": "integer"}}, "$ref": "#/$defs/i", "minimum": 5}, 1, "beside $ref (minimum)"),
    ({"$ref": "http://example.com/schema.json"}, None,
     "the JSON schema's $ref outside the schema ('http://example.com/schema.json') is not followed"),  # nothing checked
    ({"type": "object", "required": ["z"]}, {}, "required property 'z'"),
    # a $ref to a place no schema keyword holds: xgrammar compiles its target, which was never checked
    ({"type": "object", "properties": {"a": {"$ref": "#/x"}}, "required": ["a"],
      "x": {"type": "string", "maxLength": 2, "pattern": "^a+$"}}, {"a": "aaaa"}, "format are not enforced (at #/x)"),
    # ... and one into an array there (xgrammar resolves an index as RFC 6901 reads it; was: never checked)
    ({"type": "object", "properties": {"a": {"$ref": "#/x/1"}}, "required": ["a"],
      "x": [{}, {"type": "string", "maxLength": 2, "pattern": "^a+$"}]}, {"a": "aaaa"},
     "format are not enforced (at #/x/1)"),
    ({"$defs": {"P": {"$anchor": "pp", "type": "boolean"}}, "type": "object", "properties": {"a": {"$ref": "#pp"}},
      "required": ["a"]}, {"a": "hello"}, "the JSON schema's $ref to an anchor ('#pp'), not a JSON pointer"),
    ({"$defs": {"I": {"$dynamicAnchor": "n", "type": "integer"}}, "type": "object",
      "properties": {"a": {"$dynamicRef": "#n"}}, "required": ["a"]}, {"a": "s"}, "$dynamicRef"),
    ({"type": "string", "format": "date", "pattern": "^2024"}, "2023-01-01", "beside a 'format'"),
    ({"type": "string", "enum": ["a", 1]}, 1, "enum value 1 is not of type string"),
    ({"type": "integer", "enum": [1.5, 2]}, 1.5, "enum value 1.5 is not of type integer"),
    ({"type": "string", "const": 5}, 5, "const value 5"),
    ({"type": "string", "enum": ["abc", "a"], "maxLength": 2}, "abc", "enum value \"abc\" breaks its 'maxLength'"),
    ({"type": "integer", "const": 5, "maximum": 3}, 5, "const value 5 breaks its 'maximum'"),
    ({"type": "string", "enum": ["ab", "zz"], "pattern": "^a"}, "zz", "enum value \"zz\" breaks its 'pattern'"),
    ({"type": "string", "const": "nope", "format": "email"}, "nope", "const value \"nope\" breaks its 'format'"),
    ({"type": "object", "properties": {"aa": {"type": "string"}}, "patternProperties": {"^a": {"type": "integer"}}},
     {"aa": "x"}, "property 'aa' matches 'patternProperties' '^a' as well"),
    ({"type": "string", "format": "regex"}, "(", "format 'regex' is not enforced (the grammar would take any string)"),
    ({"type": "string", "format": "idn-email"}, "nope", "format 'idn-email' is not enforced"),
    ({"type": "string", "format": "idn-hostname"}, "a..b", "format 'idn-hostname' is not enforced"),
    ({"format": "date"}, "2023-02-30", "format 'date' without a 'type' is not enforced"),
    ({"type": "string", "format": "date", "maxLength": 5}, "2023-01-01", "beside a pattern or a format"),
    ({"type": "string", "format": "uri", "minLength": 5}, "a:b", "minLength 5 beside format 'uri'"),
    ({"type": "string", "format": "uri", "maxLength": 10}, "a:" + "b" * 20, "maxLength 10 beside format 'uri'"),
]  # fmt: skip


@pytest.mark.parametrize("schema, breaking, named", UNENFORCED, ids=[c[2] for c in UNENFORCED])
def test_a_schema_the_grammar_would_not_enforce_is_refused_naming_the_keyword(llm, schema, breaking, named):
    """Accepted before, and an output could finish "stop" with JSON its own schema refuses."""
    from xgrammar.testing import _is_grammar_accept_string

    if breaking is not None:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(breaking, schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
    grammar = xgrammar.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
    document = json.dumps(breaking if breaking is not None else {"any": ["thing"]})
    assert _is_grammar_accept_string(grammar, document), "xgrammar enforces it now: revisit the list"
    with pytest.raises(RequestError) as info:
        llm.generate(["x"], SamplingParams(structured_outputs=Grammar(json=schema, origin="response_format")))
    assert info.value.field == "response_format" and named in str(info.value), str(info.value)
    assert not llm.engine.has_unfinished()


@pytest.mark.parametrize("combinator", ["anyOf", "oneOf", "allOf"])
def test_an_empty_combinator_is_refused(llm, combinator):
    """Not a valid schema (the metaschema asks for one subschema or more); was: compiled to a grammar that allows
    only the end, so the answer was "" with finish "stop"."""
    with pytest.raises(jsonschema.SchemaError):
        jsonschema.Draft202012Validator.check_schema({combinator: []})
    with pytest.raises(RequestError, match=f"the JSON schema's empty '{combinator}' is not a valid schema"):
        llm.generate(["x"], SamplingParams(structured_outputs=Grammar(json={combinator: []})))


def _pydantic_schema() -> dict:
    """What pydantic writes for a discriminated union, Optional fields and a list of models ($defs and $refs)."""
    from typing import Annotated, Literal, Optional, Union

    from pydantic import BaseModel, Field

    class Cat(BaseModel):
        kind: Literal["cat"]
        meows: int

    class Dog(BaseModel):
        kind: Literal["dog"]
        barks: bool

    class Item(BaseModel):
        name: str
        price: Optional[float] = None

    class Pet(BaseModel):
        pet: Annotated[Union[Cat, Dog], Field(discriminator="kind")]
        items: list[Item]

    return Pet.model_json_schema()


# (schema, a document that breaks it): taken, and xgrammar's grammar refuses the document
ENFORCED = [
    ({"oneOf": [{"type": "integer"}, {"type": "string"}]}, "true"),
    ({"oneOf": [{"type": "object", "properties": {"k": {"const": "a"}, "x": {"type": "integer"}},
                 "required": ["k", "x"]},
                {"type": "object", "properties": {"k": {"const": "b"}, "y": {"type": "boolean"}},
                 "required": ["k", "y"]}]},
     '{"k": "a", "y": true}'),
    ({"type": "object", "properties": {"d": {"type": "string", "format": "date"}, "r": {"$ref": "#/$defs/r"}},
      "required": ["d", "r"], "$defs": {"r": {"type": "integer", "description": "a ref with an annotation"}}},
     '{"d": "2020-13-45", "r": 1}'),
    ({"type": "object", "properties": {"v": {"allOf": [{"type": "integer", "minimum": 5}]}}, "required": ["v"]},
     '{"v": 1}'),
    (_pydantic_schema(), '{"pet": {"kind": "cat", "barks": true}, "items": []}'),
    ({"type": "string", "enum": ["ab", "a"], "maxLength": 2, "title": "T"}, '"abc"'),  # every value within its bound
    ({"type": "object", "properties": {"b": {"type": "string"}}, "patternProperties": {"^a": {"type": "integer"}}},
     '{"a1": "x"}'),  # no property that a pattern matches
    ({"type": "object", "properties": {"name": {"type": "string", "description": "who"}}, "required": ["name"],
      "patternProperties": {"^[a-z]+$": {"type": "string"}}}, '{"name": 1}'),  # a pattern whose schema is the same
    # a nullable integer's multipleOf (zod-to-json-schema's .int().multipleOf(5).nullable(); was: refused as
    # enforced on integers only)
    ({"type": ["integer", "null"], "multipleOf": 5}, "3"),
    ({"type": ["string", "integer"], "multipleOf": 5}, "3"),
]  # fmt: skip


@pytest.mark.parametrize("schema, breaking", ENFORCED)
def test_schemas_the_grammar_enforces_are_taken(llm, schema, breaking):
    from xgrammar.testing import _is_grammar_accept_string

    grammar = xgrammar.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
    assert not _is_grammar_accept_string(grammar, breaking)
    params = SamplingParams(max_tokens=60, temperature=1.0, seed=1, n=2, structured_outputs=Grammar(json=schema))
    for text, reason in texts(llm.generate(PROMPTS[:2], params)):
        if reason == "stop":
            jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("schema", [{"type": "object", "required": [["a"]]},
                                    {"oneOf": [{"properties": [1]}, {"required": 5}]}, {"$ref": 5}, {"$ref": "#/nope"},
                                    {"oneOf": [{"$ref": "#"}, {"$ref": "#"}]}])  # fmt: skip
def test_a_malformed_schema_is_a_request_error_not_a_crash(llm, schema):
    """The checker met shapes the compiler refuses (a list where a name goes): a TypeError, a 500 from serve."""
    try:
        llm.generate(["x"], SamplingParams(max_tokens=4, structured_outputs=Grammar(json=schema)))
    except RequestError as e:
        assert e.field == "structured_outputs"
    assert not llm.engine.has_unfinished()


def test_schemas_in_another_key_order_are_other_grammars(llm):
    """The grammar writes properties in the schema's order, so a cached grammar of the same keys in another order
    is not the one to use (it was: the cache key sorted the keys)."""
    def output(order):
        schema = {"type": "object", "properties": {k: {"type": "boolean"} for k in order}, "required": sorted(order),
                  "additionalProperties": False}
        outs = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=12, temperature=1.0, seed=2,
                                                          structured_outputs=Grammar(json=schema)))
        return outs[0].outputs[0].text

    assert output(("answer", "reasoning")).startswith('{"answer"')
    assert output(("reasoning", "answer")).startswith('{"reasoning"')


def test_structured_params_are_checked():
    for kwargs in ({}, {"json": {}, "regex": "a"}, {"choice": []}, {"choice": ["a", ""]}, {"regex": ""}):
        with pytest.raises(RequestError) as info:
            Grammar(**kwargs)
        assert info.value.field == "structured_outputs"
    with pytest.raises(RequestError) as info:
        SamplingParams(beam_width=2, structured_outputs=Grammar(regex="a", origin="guided_regex"))
    assert info.value.field == "guided_regex" and "beam search" in str(info.value)


def _arrays(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


def test_a_schema_nested_past_the_limit_is_refused_before_compiling(llm):
    # xgrammar's compile time grows faster than the nesting: 900 levels (a 25 KB body) took 39 s of CPU
    from trtpaged.runtime.sampling_params import MAX_SCHEMA_DEPTH

    deepest = _arrays(MAX_SCHEMA_DEPTH - 1)  # MAX_SCHEMA_DEPTH levels of objects and arrays in all
    Grammar(json=deepest)
    before = llm.stats()["num_grammars_compiled"]
    for schema in (_arrays(MAX_SCHEMA_DEPTH), json.dumps(_arrays(MAX_SCHEMA_DEPTH)), "[" * 30000 + "]" * 30000):
        with pytest.raises(RequestError, match=f"nests objects and arrays more than {MAX_SCHEMA_DEPTH} deep") as info:
            llm.generate(["x"], SamplingParams(max_tokens=4, structured_outputs=Grammar(json=schema)))
        assert info.value.field == "structured_outputs" and info.value.limit == MAX_SCHEMA_DEPTH
    assert llm.stats()["num_grammars_compiled"] == before and not llm.engine.has_unfinished()
    cyclic: dict = {"type": "array"}
    cyclic["items"] = cyclic
    for schema in (_arrays(5000), cyclic):  # json.dumps recursed past Python's limit on the first
        with pytest.raises(RequestError, match="nests objects and arrays"):
            Grammar(json=schema)
    out = llm.generate(["x"], SamplingParams(max_tokens=8, structured_outputs=Grammar(json=deepest)))[0]
    assert out.outputs[0].text.startswith("[")


def test_bench_structured_times_full_batches_and_counts_constrained_rows(tiny_engine_dir):
    from trtpaged.bench.structured_bench import format_structured, run_structured_bench

    report = run_structured_bench(tiny_engine_dir, batch=4, steps=3, repeats=1)
    (rounds,) = report["rounds"]
    assert rounds["plain_steps"] == rounds["constrained_steps"] == 3
    assert report["ratio"] == pytest.approx(rounds["constrained"] / rounds["plain"])
    assert report["constrained_requests"] == 2 * 2  # the warm-up's and the round's 2 constrained rows
    assert "ratio (median of rounds)" in format_structured(report)


def test_bench_structured_default_batch_fits_the_engine(tiny_engine_dir):
    """The default 16 requests were refused by an engine built for 8; the default is now what the engine takes."""
    from trtpaged.bench.structured_bench import run_structured_bench

    report = run_structured_bench(tiny_engine_dir, steps=2, repeats=1)
    assert report["batch"] == 8  # examples/tiny.yaml's max_batch_size



def test_the_special_token_that_ends_an_output_is_not_its_text(llm):
    """With skip_special_tokens=False the EOS that ended a sequence stays out of its text (vLLM's rule), unless
    include_stop_str_in_output asks for it."""
    eos = llm.tokenizer.eos_token_id

    def one(**kw):
        params = SamplingParams(max_tokens=8, temperature=1.0, structured_outputs=Grammar(choice=["hi"]),
                                skip_special_tokens=False, **kw)  # fmt: skip
        return llm.generate(["x"], params)[0].outputs[0]

    completion = one()
    assert completion.token_ids[-1] == eos and completion.finish_reason == "stop"
    assert completion.text == llm.tokenizer.decode(completion.token_ids[:-1], skip_special_tokens=False) == "hi"
    assert one(include_stop_str_in_output=True).text == "hi" + llm.tokenizer.eos_token


@pytest.mark.parametrize("pattern", [r"[^0-9]{8}", r"[a-z]{2}.{7}"])
def test_the_end_token_is_allowed_only_where_the_output_is_complete(llm, pattern):
    """xgrammar also reads a stop token as its text (`<|eos|>`, 7 characters), and allowed it wherever that text
    completes the grammar: with the end favoured, `[^0-9]{8}` ended after one character, finish "stop"."""
    eos = llm.tokenizer.eos_token_id
    assert len(llm.tokenizer.decode([eos])) == 7
    params = [SamplingParams(max_tokens=20, temperature=1.0, seed=seed, logit_bias={eos: 100.0},
                             structured_outputs=Grammar(regex=pattern)) for seed in range(4)]  # fmt: skip
    for text, reason in texts(llm.generate(["x"] * 4, params)):
        assert reason == "stop" and re.fullmatch(pattern, text, re.DOTALL), (text, reason)


def test_the_grammar_cache_is_bounded_by_bytes_as_well_as_entries():
    """Least recently used grammars go once the kept ones' memory (xgrammar's own count) passes max_bytes; the
    newest stays whatever its size; a hit moves a grammar to the back."""
    from trtpaged.models.tiny_tokenizer import make_tiny_tokenizer
    from trtpaged.runtime.structured import GrammarCache

    tok = make_tiny_tokenizer()
    probe = GrammarCache(tok, len(tok), [tok.eos_token_id])
    sizes = {n: probe.compile(Grammar(regex=f"[a-z]{{1,{n}}}")).memory_size_bytes for n in (100, 101, 102, 103)}
    assert probe.cached_bytes == sum(sizes.values())
    cache = GrammarCache(tok, len(tok), [tok.eos_token_id], max_bytes=sizes[100] + sizes[101] + sizes[102] // 2)
    kept = []
    for n in (100, 101, 100, 102, 103):
        cache.compile(Grammar(regex=f"[a-z]{{1,{n}}}"))
        kept = [k for k in kept if k != n] + [n]
        while sum(sizes[k] for k in kept) > cache.max_bytes and len(kept) > 1:
            kept.pop(0)
        assert cache.cached_bytes == sum(sizes[k] for k in kept) <= cache.max_bytes, (n, kept)
    assert (cache.num_compiled, cache.num_hits) == (4, 1) and kept == [102, 103]
    tiny = GrammarCache(tok, len(tok), [tok.eos_token_id], max_bytes=1)
    tiny.compile(Grammar(regex="[a-z]{1,100}"))
    assert tiny.cached_bytes == sizes[100]  # the newest is kept


def test_a_pattern_repeating_past_the_bound_is_refused_before_compiling():
    """A 60-byte schema whose pattern repeats up to 16,000 times took xgrammar 27 s to compile (quadratic in the
    bound), holding a core while other requests waited for theirs: refused, naming the field and the limit."""
    from trtpaged.runtime.sampling_params import MAX_PATTERN_REPEAT

    for schema in ({"type": "string", "pattern": "^[a-z]{1,16000}$"},
                   json.dumps({"type": "object", "patternProperties": {"^x{3000}$": {"type": "integer"}}}),
                   {"type": "object", "properties": {"a": {"anyOf": [{"type": "string", "pattern": "b{2000}"}]}}}):
        with pytest.raises(RequestError) as info:
            Grammar(json=schema, origin="response_format")
        assert info.value.field == "response_format" and info.value.limit == MAX_PATTERN_REPEAT
    Grammar(json={"type": "string", "pattern": f"^[a-z]{{1,{MAX_PATTERN_REPEAT}}}$"})
    # a value is not a schema: a const, default or example that looks like one is data, whatever it holds
    Grammar(json={"type": "object", "const": {"pattern": "a{5000}"}, "default": {"pattern": "a{5000}"},
                  "examples": [{"pattern": "a{5000}"}]})



def test_a_pattern_nesting_groups_past_the_bound_is_refused_before_compiling(llm):
    """A pattern of 30,000 nested groups (60 KB) overflowed the stack of the thread compiling it in xgrammar (which
    bounds a regex's nesting but not a schema pattern's): the server died. Refused, naming the field and the limit,
    in a schema and in a structural tag's; a pattern at the bound compiles and its output matches it."""
    from trtpaged.runtime.sampling_params import MAX_PATTERN_NESTING

    deep = "(" * 30000 + "a" + ")" * 30000
    for params in ({"json": {"type": "string", "pattern": deep}},
                   {"json": {"type": "object", "patternProperties": {deep: {"type": "integer"}}}},
                   {"structural_tag": _tag_around({"type": "string", "pattern": deep})}):
        with pytest.raises(RequestError) as info:
            Grammar(**params, origin="response_format")
        assert info.value.field == "response_format" and info.value.limit == MAX_PATTERN_NESTING, str(info.value)
        assert "nests groups 30000 deep" in str(info.value)
    # at the bound (escaped parentheses open no group): the strings of [a-c]\(\[ (too deep for Python's re)
    pattern = "^" + "(" * MAX_PATTERN_NESTING + "[a-c]" + ")" * MAX_PATTERN_NESTING + r"\(\[$"
    grammar = Grammar(json={"type": "string", "pattern": pattern})
    for text, reason in texts(llm.generate(PROMPTS[:2], SamplingParams(max_tokens=12, structured_outputs=grammar))):
        assert reason == "stop" and re.fullmatch(r"[a-c]\(\[", json.loads(text)), text


# ---- structural tags (xgrammar's format, vLLM's legacy structures + triggers) ------------------------------------
ANSWER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                                           "days": {"type": "integer", "minimum": 1, "maximum": 14}},
          "required": ["city", "days"], "additionalProperties": False}  # fmt: skip
# any whitespace is xgrammar's default inside a tag's JSON: a random model can write it until max_tokens
ANSWER_TAG = {"type": "structural_tag", "format": {"type": "sequence", "elements": [
    {"type": "const_string", "value": "<answer>"},
    {"type": "json_schema", "json_schema": ANSWER, "max_whitespace_cnt": 1},
    {"type": "const_string", "value": "</answer>"}]}}  # fmt: skip
# the legacy form: any text, each "<" opening one of the structures; a value of ITEM holds a "<" of its own
ITEM = {"type": "object", "properties": {"k": {"enum": ["a<b", "c"]}, "n": {"type": "integer", "minimum": 0,
                                                                           "maximum": 9}},
        "required": ["k", "n"], "additionalProperties": False}  # fmt: skip
STRUCTURES = [{"begin": "<item>", "schema": ITEM, "end": "</item>"}, {"begin": "<ok>", "schema": {"type": "boolean"},
                                                                      "end": "</ok>"}]  # fmt: skip
LEGACY_TAG = {"type": "structural_tag", "structures": STRUCTURES, "triggers": ["<"]}


def check_exactly_tagged(text: str, begin: str, schema: dict, end: str) -> Any:
    """The JSON value of `text` when it is exactly `begin`, one JSON value that `schema` validates, and `end` (read
    by json's own decoder, nothing before or after it; checked by jsonschema); AssertionError otherwise."""
    assert text.startswith(begin) and text.endswith(end), text
    body = text[len(begin):len(text) - len(end)]
    value, stop = json.JSONDecoder().raw_decode(body)  # no whitespace before the value either
    assert stop == len(body), text
    jsonschema.validate(value, schema)
    return value


def check_triggered(text: str, triggers: list[str], structures: list[dict], cut: bool) -> int:
    """How many structures `text` holds, asserting the legacy structural tag's rule: text is free until a trigger,
    which opens a structure: its begin, one JSON value its schema validates, its end; then free text again. Read
    left to right, so a trigger inside a structure's JSON opens nothing. An output `cut` short (finish "length")
    may end inside its last structure."""
    decoder, pos, count = json.JSONDecoder(), 0, 0
    while True:
        found = [i for i in (text.find(t, pos) for t in triggers) if i >= 0]
        if not found:
            return count
        at = min(found)
        rest = text[at:]
        opened = [s for s in structures if rest.startswith(s["begin"])]
        if not opened:  # only a cut output may end inside a begin
            assert cut and any(s["begin"].startswith(rest) for s in structures), text
            return count
        (structure,) = opened
        body = at + len(structure["begin"])
        try:
            value, end = decoder.raw_decode(text, body)
        except json.JSONDecodeError:  # only a cut output may end inside the JSON
            assert cut, text
            return count
        jsonschema.validate(value, structure["schema"])
        if not text.startswith(structure["end"], end):
            assert cut and structure["end"].startswith(text[end:]), text
            return count
        count += 1
        pos = end + len(structure["end"])


def test_a_structural_tag_sequence_is_begin_json_end(llm):
    """xgrammar's structural tag format through StructuredOutputsParams(structural_tag=...) (a mapping or its JSON
    text): a sequence of const strings around a json_schema is exactly begin + schema-valid JSON + end, greedy and
    sampled; the two spellings of one tag are one grammar, compiled once."""
    before = llm.stats()["num_grammars_compiled"]
    for tag in (ANSWER_TAG, json.dumps(ANSWER_TAG)):
        for temperature, n in ((0.0, 1), (1.0, 4)):
            params = SamplingParams(max_tokens=80, temperature=temperature, n=n,
                                    structured_outputs=Grammar(structural_tag=tag))  # fmt: skip
            samples = texts(llm.generate(PROMPTS, params))
            assert len(samples) == 8 * n
            for text, reason in samples:
                assert reason == "stop", text
                check_exactly_tagged(text, "<answer>", ANSWER, "</answer>")
            if n > 1:
                assert len({t for t, _ in samples}) > 8
    assert llm.stats()["num_grammars_compiled"] == before + 1
    guided = GuidedDecodingParams(structural_tag=json.dumps(ANSWER_TAG))  # vLLM <= 0.10's spelling
    (out,) = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=80, temperature=0.0, guided_decoding=guided))
    check_exactly_tagged(out.outputs[0].text, "<answer>", ANSWER, "</answer>")


def test_the_legacy_structural_tag_opens_a_structure_at_every_trigger(llm):
    """vLLM's legacy form (structures + triggers): any text, and each trigger in it opens a structure that runs to
    its end with JSON its schema validates. A random model writes "<" rarely, so a logit bias makes the trigger
    frequent; the rule is checked over every sampled output, read left to right (`check_triggered`)."""
    lt = llm.tokenizer.convert_tokens_to_ids("<")
    assert llm.tokenizer.decode([lt]) == "<"
    params = SamplingParams(max_tokens=96, temperature=1.0, n=4, seed=1, logit_bias={lt: 4.0},
                            structured_outputs=Grammar(structural_tag=LEGACY_TAG))  # fmt: skip
    samples = texts(llm.generate(PROMPTS, params))
    counts = [check_triggered(text, ["<"], STRUCTURES, reason == "length") for text, reason in samples]
    assert sum(counts) >= 32 and sum(1 for c in counts if c) >= 24, counts
    assert any('"a<b"' in t for t, _ in samples)  # a trigger inside the JSON opened nothing


def test_a_structural_tags_length_bounded_strings_are_json_strings(llm):
    """A json_schema in a tag with maxLength: xgrammar's own grammar for the tag takes raw control characters in
    the string (no JSON), as it does for a plain schema; the server's is compiled from the mended grammar text."""
    from xgrammar.testing import _is_grammar_accept_string


    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}},
              "required": ["name"], "additionalProperties": False}  # fmt: skip
    tag = {"type": "structural_tag", "format": {"type": "tag", "begin": "<p>", "end": "</p>", "content": {
        "type": "json_schema", "json_schema": schema, "max_whitespace_cnt": 1}}}  # fmt: skip
    control = '<p>{"name": "a\x1db"}</p>'
    assert _is_grammar_accept_string(xgrammar.Grammar.from_structural_tag(json.dumps(tag)), control)
    mended = xgrammar.Grammar.from_ebnf(mended_structural_tag_grammar(tag))
    assert not _is_grammar_accept_string(mended, control)
    assert _is_grammar_accept_string(mended, '<p>{"name": "a😀 b"}</p>')
    params = SamplingParams(max_tokens=80, temperature=1.0, n=4, seed=2, structured_outputs=Grammar(structural_tag=tag))
    samples = texts(llm.generate([f"person {i}:" for i in range(8)], params))
    stopped = [t for t, reason in samples if reason == "stop"]
    assert len(stopped) > 24
    for text in stopped:
        check_exactly_tagged(text, "<p>", schema, "</p>")  # strict JSON: no raw control character


def _nested_sequences(depth: int) -> dict:
    fmt: dict = {"type": "const_string", "value": "x"}
    for _ in range(depth):
        fmt = {"type": "sequence", "elements": [fmt]}
    return {"type": "structural_tag", "format": fmt}


GEMMA_BOUNDED = {"type": "string", "maxLength": 3}


def _tag_around(schema: Any) -> dict:
    return {"type": "structural_tag", "format": {"type": "json_schema", "json_schema": schema}}


BAD_TAGS = [
    ("{not json", "not JSON", False),
    ([{"type": "structural_tag"}], "a structural tag object or its JSON text", False),
    ('["structural_tag"]', "a structural tag is a JSON object", False),
    ({"format": {"type": "const_string", "value": "x"}}, 'a structural tag is {"type": "structural_tag"', False),
    ({"type": "structural_tag", "format": "x"}, "must be a format object", False),
    ({"type": "structural_tag", "format": {"type": "nope"}}, "Format type not recognized: nope", True),
    ({"type": "structural_tag", "format": {"type": "sequence", "elements": []}}, "at least one element", True),
    ({"type": "structural_tag", "format": {"type": "regex", "pattern": "(("}}, "invalid structural_tag", True),
    ({"type": "structural_tag", "format": {"type": "token", "token": 10**6}}, "out of the vocabulary", True),
    (_nested_sequences(120), "nested deeper than 100", True),  # xgrammar's own bound
    (_nested_sequences(200), "nests objects and arrays more than 256 deep", False),
    ("[" * 30000 + "]" * 30000, "nests objects and arrays more than 256 deep", False),
    (json.dumps(_tag_around({"enum": ["x" * 70000]})), "exceeds 65536", False),
    (_tag_around(_arrays(70)), "json schema at format.json_schema nests objects and arrays more than 64", False),
    (_tag_around({"type": "string", "pattern": "a{1,5000}"}), "json schema at format.json_schema pattern", False),
    (_tag_around({"type": "array", "uniqueItems": True}), "the JSON schema at format.json_schema: 'uniqueItems'", True),
    # a node without a type that xgrammar reads as a json_schema (was: compiled unchecked, 6 s for a{1,12000})
    ({"type": "structural_tag", "format": {"json_schema": {"type": "array", "uniqueItems": True}}},
     "the JSON schema at format.json_schema: 'uniqueItems'", True),
    ({"type": "structural_tag", "format": {"begin": "<a>", "end": "</a>", "content": {
        "json_schema": {"type": "string", "pattern": "a{1,5000}"}}}}, "format.content.json_schema pattern", False),
    # a node without a type with a tag's keys, whose content xgrammar refuses: xgrammar read it as its stray
    # json_schema instead (`^zz$`, compiled unchecked); its form is written out, so the content is refused
    ({"type": "structural_tag", "format": {"begin": "<a>", "content": {"foo": 1}, "end": "</a>",
                                           "json_schema": {"type": "string", "pattern": "^zz$"}}},
     "invalid structural_tag", True),
    ({**LEGACY_TAG, "triggers": ["<x"]}, "does not match any trigger", True),
    ({**LEGACY_TAG, "triggers": []}, "triggers: must be a non-empty list", False),
    ({"structures": [{"begin": "<a>", "end": "</a>"}], "triggers": ["<"]}, "exactly begin, schema and end", False),
    ({"structures": [{"begin": "<a>", "schema": [], "end": "</a>"}], "triggers": ["<"]}, "schema: must be", False),
    ({"structures": [], "triggers": ["<"]}, "structures: must be a non-empty list", False),
    ({**LEGACY_TAG, "at_least_one": True}, "unknown keys ['at_least_one']", False),
    ({"type": "structural_tag", "structures": [{"begin": "<a>", "schema": {"type": "object", "not": {}},
                                                "end": "</a>"}], "triggers": ["<"]},
     "the JSON schema at structures[0].schema: 'not'", True),
    ({"type": "structural_tag", "format": {"type": "sequence", "elements": [
        {"type": "token", "token": "b"}, {"type": "json_schema", "json_schema": {"type": "string", "maxLength": 3}}]}},
     "beside a token named by its text", True),
    # a pattern xgrammar refuses, as the json kind does (the fallback once compiled its stand-in, the only value taken)
    (_tag_around({"type": "string", "pattern": "^\u0000$"}), "The regex must not contain null characters", True),
    ({"type": "structural_tag", "format": {"type": "qwen_xml_parameter", "json_schema": {
        "type": "object", "properties": {"d": {"type": "string", "pattern": "^a\u0000$"}}}}},
     "The regex must not contain null characters", True),
    # refused when the params are made (was: when compiled, after the server tokenized the prompt, loaded the
    # vocabulary and queued on the grammar lane, where a full lane answered 503 rather than this 400)
    ({"type": "structural_tag", "format": {"type": "tag", "begin": "<a>", "end": "</a>", "content": {
        "type": "json_schema", "style": "gemma",
        "json_schema": {"type": "object", "properties": {"s": GEMMA_BOUNDED}}}}},
     "format.content.json_schema: 'minLength' / 'maxLength' is not enforced in style 'gemma'", False),
    # a mended text xgrammar refuses for another reason than a TagDispatch it does not read back (an empty
    # exclude): named as itself (was: blamed on a free text whose exclude starts a trigger, or compiled from
    # xgrammar's own grammar without the mends)
    ({"type": "structural_tag", "format": {"type": "sequence", "elements": [
        {"type": "any_text", "excludes": [""]}, {"type": "json_schema", "json_schema": GEMMA_BOUNDED}]}},
     "invalid structural_tag: EBNF parser error", True),
    ({"type": "structural_tag", "format": {"type": "sequence", "elements": [
        {"type": "any_text", "excludes": [""]}, {"type": "const_string", "value": "!"}]}},
     "Exclude must be a non-empty string literal", True),
    # a NUL in the tag's own strings, where the grammar text xgrammar prints ends (was: const_string "a\0b"
    # compiled as "a", a begin holding one took nothing, an exclude was xgrammar's EBNF error)
    ({"type": "structural_tag", "format": {"type": "const_string", "value": "a\u0000b"}},
     "format.value holds a NUL character (U+0000, at 1)", False),
    ({"type": "structural_tag", "format": {"type": "tag", "begin": "<a\u0000", "content": {"type": "any_text"},
                                           "end": "</a>"}}, "format.begin holds a NUL character (U+0000, at 2)", False),
    ({"type": "structural_tag", "format": {"type": "sequence", "elements": [
        {"type": "any_text", "excludes": ["x", "\u0000"]}, {"type": "const_string", "value": "!"}]}},
     "format.elements[0].excludes[1] holds a NUL character", False),
    # a lone surrogate in the tag's own strings or names, which no output holds (was: xgrammar's 'Failed to parse
    # JSON: syntax error' at compile, the JSON valid; a token named by one: UnicodeEncodeError, naming no field)
    ({"type": "structural_tag", "format": {"type": "token", "token": "\ud800"}},
     "format.token: not valid Unicode text", False),
    ({"type": "structural_tag", "format": {"type": "tag", "begin": "\ud800", "content": {"type": "any_text"},
                                           "end": "x"}}, "format.begin: not valid Unicode text", False),
    ({"type": "structural_tag", "format": {"type": "sequence", "elements": [
        {"type": "any_text", "excludes": ["x", "\udc00"]}, {"type": "const_string", "value": "!"}]}},
     "format.elements[0].excludes[1]: not valid Unicode text", False),
    ({"type": "structural_tag", "format": {"type": "const_string", "value": "a", "\ud800": 1}},
     "format key '\\ud800': not valid Unicode text", False),
    # the legacy form's strings named where they were given (was: as the triggered_tags it is read as)
    ({**LEGACY_TAG, "structures": [{"begin": "<a\u0000", "schema": {}, "end": "x"}], "triggers": ["<a"]},
     "structures[0].begin holds a NUL character (U+0000, at 2)", False),
    ({**LEGACY_TAG, "structures": [{"begin": "<a", "schema": {}, "end": "\ud800"}], "triggers": ["<a"]},
     "structures[0].end: not valid Unicode text", False),
    ({**LEGACY_TAG, "triggers": ["<a", "\ud800"]}, "triggers[1]: not valid Unicode text", False),
    ({"type": "structural_tag", "format": {"type": "token_dispatch", "loop": False, "rules": [
        ["\ud800", {"type": "const_string", "value": "!"}]]}}, "invalid structural_tag", True),
]  # fmt: skip


@pytest.mark.parametrize("named", [
    lambda end: {"type": "sequence", "elements": [{"type": "const_string", "value": "ab"}, {"type": "token",
                                                                                          "token": end}]},
    lambda end: {"type": "tag", "begin": "ab", "content": {"type": "any_text"}, "end": {"type": "token", "token": end}},
    lambda end: {"type": "sequence", "elements": [{"type": "any_tokens", "exclude_tokens": [end], "max_tokens": 3},
                                                  {"type": "const_string", "value": "!"}]},
    lambda end: {"type": "token_dispatch", "rules": [[end, {"type": "const_string", "value": "!"}]], "loop": False},
], ids=["token", "tag-end", "exclude-tokens", "token-dispatch"])  # fmt: skip
def test_a_structural_tag_may_name_the_stop_token_by_its_text(llm, named):
    """The grammar compiler's vocabulary leaves the stop tokens' text out (the end token is no text there), and
    a tag naming the end token by its text (`<|eos|>`; a token_dispatch's rule too) was refused as 'not found in
    vocabulary'; it now answers as the same tag naming the token by its id (the truth: xgrammar resolves an id
    without the text)."""
    eos = llm.tokenizer.eos_token_id
    answers = []
    for end in (llm.tokenizer.eos_token, eos):
        tag = {"type": "structural_tag", "format": named(end)}
        params = SamplingParams(max_tokens=12, temperature=1.0, seed=3, n=3,
                                structured_outputs=Grammar(structural_tag=tag))  # fmt: skip
        answers.append([(c.token_ids, c.finish_reason) for o in llm.generate(["x"], params) for c in o.outputs])
    assert answers[0] == answers[1], answers


@pytest.mark.parametrize("grammar, conforms", [
    (Grammar(json={"type": "object", "properties": {"s": {"type": "string", "minLength": 8, "maxLength": 8}},
                   "required": ["s"], "additionalProperties": False}),
     lambda text: jsonschema.validate(json.loads(text), {"properties": {"s": {"minLength": 8, "maxLength": 8}}})),
    (Grammar(json_object=True), lambda text: isinstance(json.loads(text), dict)),
    (Grammar(regex="[a-z<|>]{7}"), lambda text: re.fullmatch("[a-z<|>]{7}", text) or pytest.fail(text)),
    # a structural tag naming no special token by its text (was: compiled against the vocabulary that keeps their
    # text, so {"s": "<|bos|>Q"} came out {"s": "Q"} and the regex's output empty)
    (Grammar(structural_tag={"type": "structural_tag", "format": {"type": "tag", "begin": "<s>", "end": "</s>",
        "content": {"type": "json_schema", "json_schema": {"type": "object", "properties": {"s": {
            "type": "string", "minLength": 8, "maxLength": 8}}, "required": ["s"], "additionalProperties": False}}}}),
     lambda text: jsonschema.validate(json.loads(text.removeprefix("<s>").removesuffix("</s>")),
                                      {"properties": {"s": {"minLength": 8, "maxLength": 8}}})),
    (Grammar(structural_tag={"type": "structural_tag", "format": {"type": "regex", "pattern": "[a-z<|>]{7}"}}),
     lambda text: re.fullmatch("[a-z<|>]{7}", text) or pytest.fail(text)),
], ids=["json", "json_object", "regex", "tag-json", "tag-regex"])  # fmt: skip
def test_a_special_token_is_never_taken_as_its_text(llm, grammar, conforms):
    """xgrammar found no special token in the vocabulary (its special_token_ids is empty for the tiny model and
    SmolLM2) and took `<|pad|>` as its 7 characters inside a JSON string or a regex; the output's decode drops it
    (skip_special_tokens, the default), so `{"s": "<|pad|>Q"}` under minLength 8 came out `{"s": "Q"}` and the
    regex's output came out empty. The logit bias makes the model pick the special tokens wherever allowed.
    Truth: jsonschema, json's decoder and Python's re on the text; the token ids hold no special token."""
    special = set(llm.tokenizer.all_special_ids) - {llm.tokenizer.eos_token_id}
    params = SamplingParams(max_tokens=40, temperature=1.0, seed=1, n=3, logit_bias={i: 30.0 for i in special},
                            structured_outputs=grammar)  # fmt: skip
    for out in (c for o in llm.generate(["p0", "p1"], params) for c in o.outputs):
        assert not special & set(out.token_ids), out.token_ids
        if out.finish_reason == "stop":
            conforms(out.text)


def test_a_structural_tag_may_name_a_special_token_by_its_text(llm):
    """The compiler's vocabulary leaves the special tokens' text out (above); a tag naming one by its text is
    compiled as naming its id, and generates it. Truth: the same tag naming the token by its id."""
    pad = llm.tokenizer.pad_token_id
    answers = []
    for token in (llm.tokenizer.pad_token, pad):
        tag = {"type": "structural_tag", "format": {"type": "sequence", "elements": [
            {"type": "token", "token": token}, {"type": "const_string", "value": "ab"}]}}  # fmt: skip
        params = SamplingParams(max_tokens=8, temperature=1.0, seed=2, structured_outputs=Grammar(structural_tag=tag))
        answers.append([(c.token_ids, c.finish_reason) for o in llm.generate(["x"], params) for c in o.outputs])
    assert answers[0] == answers[1] and answers[0][0][0][0] == pad, answers


@pytest.mark.parametrize("shape", ["tag", "triggered_tags"])
def test_a_structural_tags_begin_written_as_a_special_tokens_text_is_that_token(llm, shape):
    """A tag's begin or trigger is often a special token's text (Llama 3's `<|python_tag|>`, Mistral's
    `[TOOL_CALLS]`), which a model writes as that one token: a structural tag takes the token there, as xgrammar
    (and vLLM) read it, where a JSON string or a regex takes none (above); was: only its text spelled out
    character by character (`<`, `|`, `p`, ...). The logit bias makes the model pick the token wherever allowed."""
    pad, text = llm.tokenizer.pad_token_id, llm.tokenizer.pad_token
    tag = {"begin": text, "content": {"type": "const_string", "value": "ab"}, "end": "."}
    fmt = {"type": "tag", **tag} if shape == "tag" else {
        "type": "triggered_tags", "triggers": [text], "tags": [tag], "at_least_one": True, "stop_after_first": True}
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=3, logit_bias={pad: 30.0},
                            structured_outputs=Grammar(structural_tag={"type": "structural_tag", "format": fmt}))
    out = llm.generate(["x"], params)[0].outputs[0]
    assert out.token_ids[0] == pad and out.finish_reason == "stop", out.token_ids
    assert out.text == "ab."  # the special token dropped by the decode, as any other


_STRAY_SCHEMA = {"type": "string", "not": {"const": "a"}}  # a keyword the json kind refuses


@pytest.mark.parametrize("fmt, text", [
    ({"begin": "<a>", "content": {"type": "const_string", "value": "xy"}, "end": "</a>", "json_schema": _STRAY_SCHEMA},
     "<a>xy</a>"),
    ({"value": "xy", "json_schema": _STRAY_SCHEMA}, "xy"),
], ids=["tag", "const_string"])  # fmt: skip
def test_a_stray_json_schema_beside_a_tags_keys_is_not_the_nodes_schema(llm, fmt, text):
    """A format node without a type is what xgrammar reads first of a tag, a const_string and a json_schema: one
    with a tag's keys (or a string `value`) and a stray `json_schema` is a tag, its schema never compiled (was:
    refused as that schema's 'not'). Truth: xgrammar's own grammar for the tag as given takes the output."""
    from xgrammar.testing import _is_grammar_accept_string

    tag = {"type": "structural_tag", "format": fmt}
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=1, structured_outputs=Grammar(structural_tag=tag))
    out = llm.generate(["x"], params)[0].outputs[0]
    assert (out.text, out.finish_reason) == (text, "stop")
    assert _is_grammar_accept_string(xgrammar.Grammar.from_structural_tag(json.dumps(tag)), out.text)


def test_a_grammar_holding_a_nul_is_refused_naming_it(llm):
    """xgrammar's EBNF parser ends the text at a NUL: `root ::= "ab" <NUL> "cd"` compiled as `root ::= "ab"`, the
    rest dropped without a word, and the output finished "stop" as ab. Truth: xgrammar's own reading of both texts.
    Refused when the params are made, naming the field and where the NUL is."""
    text = 'root ::= "ab" \u0000 "cd"'
    assert str(xgrammar.Grammar.from_ebnf(text)) == str(xgrammar.Grammar.from_ebnf('root ::= "ab"'))
    with pytest.raises(RequestError) as info:
        Grammar(grammar=text, origin="guided_grammar")
    assert info.value.field == "guided_grammar", info.value
    assert "grammar holds a NUL character (U+0000, at 14)" in str(info.value), str(info.value)


@pytest.mark.parametrize("tag, words, compiled", BAD_TAGS, ids=[c[1][:40] for c in BAD_TAGS])
def test_a_bad_structural_tag_is_refused_naming_the_field(llm, tag, words, compiled):
    """Refused with a RequestError naming the field that carried it and why (xgrammar's reason where it is the
    one that refuses): the shape, size and nesting when the params are made, before any compile; what xgrammar
    or the json kind's rules refuse when it compiles. Nothing is left running."""
    before = llm.stats()["num_grammars_compiled"]
    with pytest.raises(RequestError) as info:
        grammar = Grammar(structural_tag=tag, origin="structured_outputs.structural_tag")
        assert compiled, "refused only at compile time, expected when the params were made"
        llm.generate(["x"], SamplingParams(max_tokens=4, structured_outputs=grammar))
    assert info.value.field == "structured_outputs.structural_tag" and words in str(info.value), str(info.value)
    assert llm.stats()["num_grammars_compiled"] == before and not llm.engine.has_unfinished()


# four nested 50-repeats: an ambiguous grammar whose parser states multiply with every token (its mask took 0.03 s,
# 0.2, 0.5, 1.4, 3.6, 5 s a token in turn for three levels on SmolLM2's vocabulary, on the engine thread)
AMBIGUOUS = "((([a-z]{1,50}){50}){50}){50}"


def test_an_ambiguous_grammar_ends_its_request_instead_of_stalling_the_engine(llm):
    """A grammar whose matcher calls grow past the budget (thread CPU time) ends its request with finish_reason
    "error", naming the field and the time, after a bounded stall; its text so far holds to the grammar, and the
    other requests of the batch finish normally (was: each token slower than the last, every request held up with
    it, past 200 s for 200 tokens)."""
    import time

    from trtpaged.runtime.structured import MATCHER_CALL_BUDGET_S

    start = time.monotonic()
    hostile, plain = llm.generate(["x", "y"], [
        SamplingParams(max_tokens=400, structured_outputs=Grammar(regex=AMBIGUOUS, origin="structured_outputs")),
        SamplingParams(max_tokens=40, ignore_eos=True)])  # fmt: skip
    assert time.monotonic() - start < 60
    out = hostile.outputs[0]
    assert out.finish_reason == "error" and len(out.token_ids) < 400, out
    assert hostile.error.startswith("its output grammar took ") and "CPU time" in hostile.error, hostile.error
    assert f"{MATCHER_CALL_BUDGET_S:g} s a step may spend on it" in hostile.error or "on average" in hostile.error
    assert hostile.error_field == "structured_outputs" and re.fullmatch("[a-z]*", out.text), out.text
    assert plain.outputs[0].finish_reason == "length" and len(plain.outputs[0].token_ids) == 40
    assert llm.engine.stats()["kv_blocks_used"] == 0


def test_a_grammar_that_allows_no_first_token_answers_every_sample(llm):
    """n = 3 samples whose grammar ('a') and bad_words ('a') leave no first token: the request ends naming the
    field, with three completions (one per index, as vLLM answers n), while the request beside it is unchanged
    (was: one completion for n = 3)."""
    grammar = Grammar(regex="a", origin="structured_outputs")
    blocked, plain = llm.generate(["x", "y"], [
        SamplingParams(n=3, temperature=1.0, max_tokens=4, bad_words=["a"], structured_outputs=grammar),
        SamplingParams(n=3, temperature=1.0, max_tokens=4, structured_outputs=grammar)])  # fmt: skip
    assert [o.index for o in blocked.outputs] == [0, 1, 2], blocked.outputs
    assert all(o.finish_reason == "error" and o.token_ids == [] and o.text == "" for o in blocked.outputs)
    assert blocked.error_field == "structured_outputs" and "leave no token" in blocked.error, blocked.error
    assert [o.index for o in plain.outputs] == [0, 1, 2] and all(o.text == "a" for o in plain.outputs), plain.outputs
    assert llm.engine.stats()["kv_blocks_used"] == 0


STRING_TAG = {"type": "structural_tag", "format": {"type": "sequence", "elements": [
    {"type": "const_string", "value": "<s>"}, {"type": "json_schema", "json_schema": {"type": "string"}}]}}
FREE_TEXT_TAG = {"type": "structural_tag", "format": {"type": "tag", "begin": "<x>", "content": {"type": "any_text"},
                                                      "end": "</x>"}}  # fmt: skip
TRIGGERED_TAG = {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<f"], "tags": [
    {"begin": "<f>", "content": {"type": "json_schema", "json_schema": {"type": "integer"}}, "end": "</f>"}]}}
FIRST_ONLY_TAG = {**TRIGGERED_TAG, "format": {**TRIGGERED_TAG["format"], "stop_after_first": True}}


@pytest.mark.parametrize("grammar, before", [
    (Grammar(regex="[^0-9]{3}"), ""), (Grammar(regex=".{3}"), ""), (Grammar(regex=r"[\s\S]{3}"), ""),
    (Grammar(grammar="root ::= [^a] [^a] [^a]"), ""), (Grammar(json={"type": "string"}), '"'),
    (Grammar(json={"type": "object", "properties": {"s": {"type": "string"}}, "required": ["s"]}), '{"s": "'),
    (Grammar(json_object=True), '{"'), (Grammar(structural_tag=STRING_TAG), '<s>"'),
    (Grammar(json={"type": "string", "pattern": "^[^0-9]{3}$"}), '"'),
    (Grammar(json={"type": "string", "pattern": "^.+$"}), '"'),
    (Grammar(structural_tag=FREE_TEXT_TAG), "<x>a"), (Grammar(structural_tag=TRIGGERED_TAG), "a"),
    (Grammar(structural_tag=TRIGGERED_TAG), "a<f>1</f>b"),
], ids=["negated-class", "dot", "s-or-S", "ebnf", "json-string", "schema-string", "json-object", "structural-tag",
        "pattern-negated-class", "pattern-dot", "tag-free-text", "triggered-free-text", "after-a-trigger"])
def test_no_grammar_takes_the_bytes_of_a_surrogate_code_point(grammar, before):
    """xgrammar matches UTF-8 bytes, and a class covering U+D800-U+DFFF ([^0-9], `.`, a JSON string's characters)
    took a surrogate's three bytes (ED A0 80) as one character, though no UTF-8 decoder does (Python's is the truth
    here): the text showed three U+FFFD, past the grammar's count. Every grammar kind now refuses the second byte,
    and still takes U+D000 (ED 80 80), the character before the surrogates."""
    from trtpaged.models.tiny_tokenizer import make_tiny_tokenizer
    from trtpaged.runtime.structured import GrammarCache

    with pytest.raises(UnicodeDecodeError):
        b"\xed\xa0\x80".decode("utf-8")
    tok = make_tiny_tokenizer()  # one token a byte
    cache = GrammarCache(tok, len(tok), [tok.eos_token_id])
    ed, b80, b80_ = tok.encode("\ud000", add_special_tokens=False)
    a0 = tok.encode("\xa0", add_special_tokens=False)[1]
    assert b80 == b80_ and tok.decode([ed, b80, b80]) == "\ud000" and tok.decode([a0]) == "\ufffd"

    def matcher_after_prefix():
        matcher = cache.matcher(cache.compile(grammar))
        assert all(matcher.accept_token(t) for t in tok.encode(before, add_special_tokens=False)), before
        return matcher

    fine = matcher_after_prefix()
    assert fine.accept_token(ed) and fine.accept_token(b80) and fine.accept_token(b80)
    surrogate = matcher_after_prefix()
    assert surrogate.accept_token(ed) and not surrogate.accept_token(a0)


def test_the_vocabulary_is_copied_once_when_the_compiler_is_made(tiny_engine_dir):
    """xgrammar's `decoded_vocab` copies the whole vocabulary into Python on every read (0.25 s for SmolLM2's
    49152 tokens); the compiler without the stop tokens' text read it four times (0.99 s before the first
    grammar). Truth: the reads counted on xgrammar's own property."""
    from transformers import AutoTokenizer

    from trtpaged.runtime.structured import GrammarCache

    reads = []
    decoded = xgrammar.TokenizerInfo.decoded_vocab

    def counted(info):
        reads.append(1)
        return decoded.fget(info)

    tokenizer = AutoTokenizer.from_pretrained(f"{tiny_engine_dir}/tokenizer")
    vocab_size = json.loads((tiny_engine_dir / "trtpaged.json").read_text())["dims"]["vocab_size"]
    cache = GrammarCache(tokenizer, vocab_size, [tokenizer.eos_token_id])
    try:
        xgrammar.TokenizerInfo.decoded_vocab = property(counted)
        cache.prepare()
    finally:
        xgrammar.TokenizerInfo.decoded_vocab = decoded
    assert len(reads) == 1
    assert cache.ids_by_text == {tokenizer.convert_ids_to_tokens(i).encode(): i for i in tokenizer.all_special_ids}


# (format, values its checker refuses that xgrammar's own grammar for it takes, values it takes)
LOOSE_FORMATS = [
    ("date", ["2023-02-30", "2023-04-31", "2023-02-29", "1900-02-29", "0000-01-01"],
     ["2024-02-29", "2000-02-29", "1900-02-28", "0001-01-01", "9999-12-31"]),
    ("date-time", ["2023-02-29T10:00:00Z", "2023-01-01T23:59:60Z", "0000-01-01T00:00:00Z"],
     ["2024-02-29T23:59:59.25+05:30", "2023-12-31T00:00:00Z"]),
    ("time", ["12:30:60Z", "23:59:60+01:00"], ["23:59:59Z", "00:00:00.5-12:00"]),
    ("ipv4", ["012.1.1.1", "1.2.3.00", "192.168.01.1"], ["0.0.0.0", "255.255.255.255", "10.200.1.99"]),
    ("hostname", ["a" * 64, "b." + "c" * 64 + ".d", ".".join(["x" * 63] * 4)],
     ["example.com", "a-b.c0", "x" * 63, ".".join(["x" * 63] * 3 + ["y" * 61]), ".".join(["ab"] * 20),
      # 5 labels or more, one past 30 characters (was refused: 5 to 8 labels of 30 at most), or more than 25
      "x" * 45 + ".namespace.svc.cluster.local", "x" * 63 + "." + "y" * 63 + ".svc.cluster.local",
      "www." + "x" * 40 + ".co.uk", ".".join(["p" * 40, "s" * 40, "n" * 40, "svc", "cluster", "local"]),
      "my-load-balancer-name-1234-0123456789.us-west-2.elb.amazonaws.com", ".".join("4321" * 8) + ".ip6.arpa"]),
]  # fmt: skip


_RFC3339_TIME = r"[0-9]{2}:[0-9]{2}:[0-9]{2}(\.[0-9]+)?(Z|[+-][0-9]{2}:[0-9]{2})"
_RFC1123 = re.compile(r"(?=.{1,253}$)[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?(\.[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?)*")


def _conforms(value: str, fmt: str) -> bool:
    """Whether `value` is of JSON Schema's `fmt`, from the standard library alone (jsonschema's checker passes
    time and date-time unchecked where rfc3339-validator is not installed, as in CI): RFC 3339's shape, then
    Python's datetime for the calendar and the clock (no day 30 of February, no second 60); ipaddress for ipv4
    (no leading zeros); RFC 1123's labels and length for hostname."""
    shapes = {"date": "[0-9]{4}-[0-9]{2}-[0-9]{2}", "time": _RFC3339_TIME,
              "date-time": f"[0-9]{{4}}-[0-9]{{2}}-[0-9]{{2}}T{_RFC3339_TIME}"}  # fmt: skip
    parse = {"date": datetime.date.fromisoformat, "time": datetime.time.fromisoformat,
             "date-time": datetime.datetime.fromisoformat, "ipv4": ipaddress.IPv4Address}  # fmt: skip
    if fmt == "hostname":
        return bool(_RFC1123.fullmatch(value))
    if fmt in shapes and not re.fullmatch(shapes[fmt], value):
        return False
    try:
        parse[fmt](value)
    except ValueError:
        return False
    return True


@pytest.mark.parametrize("fmt, refused, taken", LOOSE_FORMATS, ids=[f[0] for f in LOOSE_FORMATS])
def test_a_format_the_grammar_wrote_loosely_is_held_to_the_format(fmt, refused, taken):
    """xgrammar's grammars for these formats took impossible values (February 30th, a time on second 60, an
    ipv4 octet with a leading zero, a hostname label past 63 characters): an output finished "stop" with a string
    its own schema refuses. Truth: `_conforms` (RFC 3339's shapes with Python's datetime, ipaddress, RFC 1123) on
    each value, and xgrammar's own grammar taking it."""
    from xgrammar.testing import _is_grammar_accept_string

    schema = {"type": "object", "properties": {"v": {"type": "string", "format": fmt}}, "required": ["v"]}
    upstream = xgrammar.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
    mended = xgrammar.Grammar.from_ebnf(mended_schema_grammar(json.dumps(schema)))
    for value in refused:
        assert not _conforms(value, fmt), value
        document = json.dumps({"v": value})
        assert _is_grammar_accept_string(upstream, document), value
        assert not _is_grammar_accept_string(mended, document), value
    for value in taken:
        assert _conforms(value, fmt), value
        assert _is_grammar_accept_string(mended, json.dumps({"v": value})), value


# RFC 3986's URI, from its ABNF (an IP literal aside: an ipv4 address is a reg-name's text too)
_PCHAR = r"(?:[A-Za-z0-9._~!$&'()*+,;=:@-]|%[0-9A-Fa-f]{2})"
_REG_NAME = r"(?:[A-Za-z0-9._~!$&'()*+,;=-]|%[0-9A-Fa-f]{2})*"
_RFC3986_URI = re.compile(
    rf"[A-Za-z][A-Za-z0-9+.-]*:(?://(?:(?:{_REG_NAME}|:)*@)?{_REG_NAME}(?::[0-9]*)?(?:/{_PCHAR}*)*"
    rf"|/(?:{_PCHAR}+(?:/{_PCHAR}*)*)?|{_PCHAR}+(?:/{_PCHAR}*)*|)(?:\?(?:{_PCHAR}|[/?])*)?(?:#(?:{_PCHAR}|[/?])*)?")


def _url_models() -> tuple[Any, Any]:
    from typing import Annotated

    from pydantic import AnyUrl, BaseModel, HttpUrl, UrlConstraints

    class Link(BaseModel):
        url: HttpUrl  # format uri, minLength 1, maxLength 2083
        home: AnyUrl  # format uri, minLength 1

    class Short(BaseModel):
        url: Annotated[AnyUrl, UrlConstraints(max_length=40)]

    return Link, Short


def test_pydantics_url_schemas_compile_holding_their_length():
    """pydantic writes HttpUrl as format uri with minLength 1 and maxLength 2083, and AnyUrl with minLength 1: both
    were refused ("minLength / maxLength beside a pattern or a format"), where xgrammar (and vLLM) compile them and
    drop the bounds (a uri of any length). A minLength up to 2 holds by the format (the shortest uri, `a:`); a
    maxLength compiles as a pattern of the uri's parts, each bounded, the whole at most maxLength. Truth: xgrammar's
    own grammar for the schema, an RFC 3986 regex and pydantic's HttpUrl on each value."""
    from pydantic import ValidationError
    from xgrammar.testing import _is_grammar_accept_string

    from trtpaged.runtime.schema_features import unenforced_feature

    link, _ = _url_models()
    schema = link.model_json_schema()
    assert unenforced_feature(schema) is None
    upstream = xgrammar.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
    mended = xgrammar.Grammar.from_ebnf(mended_schema_grammar(json.dumps(schema)))
    long = "https://example.com/" + "a" * 2064  # 2084 characters
    for url, taken in [("https://example.com/a/b?q=1&r=x#top", True), ("http://h:8080", True), ("a:", True),
                       ("https://example.com/" + "a" * 1700, True), (long, False)]:  # fmt: skip
        assert _RFC3986_URI.fullmatch(url), url
        document = json.dumps({"url": url, "home": "a:b"})
        assert _is_grammar_accept_string(upstream, document)
        assert _is_grammar_accept_string(mended, document) == taken, url
        try:
            link.model_validate_json(document)
            assert taken or not url.startswith("http"), url
        except ValidationError:
            assert not taken or not url.startswith("http"), url


@pytest.mark.parametrize("url", ["file:///etc/hosts", "file://", "file:///", "http://h:/x", "http://h:"])
def test_a_length_bounded_uri_takes_an_empty_host_or_port(url):
    """RFC 3986 lets an authority's host be empty (file:///etc/hosts) and its port after the ":" too (http://h:/x),
    as xgrammar's uri takes them; a uri with a maxLength did not. Truth: an RFC 3986 regex, xgrammar's own grammar
    for the schema and pydantic's AnyUrl."""
    from pydantic import AnyUrl, TypeAdapter
    from xgrammar.testing import _is_grammar_accept_string

    schema = {"type": "string", "format": "uri", "minLength": 1, "maxLength": 2083}
    upstream = xgrammar.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
    mended = xgrammar.Grammar.from_ebnf(mended_schema_grammar(json.dumps(schema)))
    assert _RFC3986_URI.fullmatch(url) and _is_grammar_accept_string(upstream, json.dumps(url))
    TypeAdapter(AnyUrl).validate_python(url)
    assert _is_grammar_accept_string(mended, json.dumps(url))


@pytest.mark.parametrize("url", ["https://a.io/", "mailto:a@b.io", "https://h:443/"])
def test_a_short_maxlength_takes_https_and_mailto(url):
    """A uri's maxLength of 32 took schemes of up to 4 characters only (an eighth of it): no https or mailto. Truth: an
    RFC 3986 regex, xgrammar's own grammar for the schema and pydantic's AnyUrl, and the value's length."""
    from pydantic import AnyUrl, TypeAdapter
    from xgrammar.testing import _is_grammar_accept_string

    schema = {"type": "string", "format": "uri", "maxLength": 32}
    upstream = xgrammar.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
    mended = xgrammar.Grammar.from_ebnf(mended_schema_grammar(json.dumps(schema)))
    assert _RFC3986_URI.fullmatch(url) and len(url) <= 32 and _is_grammar_accept_string(upstream, json.dumps(url))
    TypeAdapter(AnyUrl).validate_python(url)
    assert _is_grammar_accept_string(mended, json.dumps(url))


@pytest.mark.parametrize("most", [32, 40, 100, 255, 2083, 5000])
def test_a_bounded_uri_pattern_takes_at_most_its_length(most):
    """The pattern a uri's maxLength compiles as takes no string longer than it, and strings up to 7 shorter.
    Truth: the widths Python's regex parser reads off the pattern (re._parser's getwidth)."""
    import re._parser

    from trtpaged.runtime.schema_formats import bounded_uri_pattern

    assert most - 7 <= re._parser.parse(bounded_uri_pattern(most)).getwidth()[1] <= most


@pytest.mark.parametrize("most", [18_000_000_000, 10**30])
def test_a_uri_of_any_maxlength_compiles(llm, most):
    """A uri's maxLength past 32 bits (its pattern's repeat counts past xgrammar's) compiles, held as 2**31 - 1:
    was a 400 ('Expect integer, but got -2044967335'; from 8e15 'Integer is too large'), where xgrammar compiles the
    schema and a lower maxLength compiles. Truth: an RFC 3986 regex on each value that finishes "stop"."""
    schema = {"type": "object", "properties": {"u": {"type": "string", "format": "uri", "maxLength": most}},
              "required": ["u"]}  # fmt: skip
    params = SamplingParams(max_tokens=40, temperature=1.0, seed=3, n=4, structured_outputs=Grammar(json=schema))
    stopped = [t for t, reason in texts(llm.generate(["link:", "url:"], params)) if reason == "stop"]
    assert stopped
    for text in stopped:
        assert _RFC3986_URI.fullmatch(json.loads(text)["u"]), text


def test_sampled_length_bounded_uris_are_valid_pydantic_urls(llm):
    """At temperature 1 on the tiny model every value of a pydantic model's `Annotated[AnyUrl,
    UrlConstraints(max_length=40)]` that finishes "stop" is a URL of at most 40 characters. Truth: pydantic's own
    validation of the model, and an RFC 3986 regex."""
    _, short = _url_models()
    params = SamplingParams(max_tokens=60, temperature=1.0, seed=3, n=4,
                            structured_outputs=Grammar(json=short.model_json_schema()))  # fmt: skip
    stopped = [t for t, reason in texts(llm.generate([f"link {i}:" for i in range(4)], params)) if reason == "stop"]
    assert len(stopped) >= 8
    for text in stopped:
        url = json.loads(text)["url"]
        assert _RFC3986_URI.fullmatch(url) and len(url) <= 40, url
        short.model_validate_json(text)


def test_every_hostname_the_pattern_takes_is_at_most_253_characters():
    """A hostname's pattern counts its labels' 63 characters, and its shapes bound the name: none is wider than
    RFC 1123's 253 characters. Truth: the widths Python's regex parser reads off the pattern (re._parser's
    getwidth)."""
    import re._parser

    from trtpaged.runtime.schema_formats import FORMAT_PATTERNS

    assert re._parser.parse(FORMAT_PATTERNS["hostname"]).getwidth() == (1, 253)


def test_sampled_hostnames_satisfy_rfc_1123(llm):
    """At temperature 1 on the tiny model every hostname that finishes "stop" is one (`_conforms`: RFC 1123's
    labels and length), of whichever of the pattern's shapes."""
    schema = {"type": "object", "properties": {"h": {"type": "string", "format": "hostname"}}, "required": ["h"]}
    params = SamplingParams(max_tokens=100, temperature=1.0, seed=3, n=4, structured_outputs=Grammar(json=schema))
    stopped = [t for t, reason in texts(llm.generate([f"host {i}:" for i in range(4)], params)) if reason == "stop"]
    assert len(stopped) >= 8
    for text in stopped:
        assert _conforms(json.loads(text)["h"], "hostname"), text


def test_sampled_formatted_strings_satisfy_their_format(llm):
    """At temperature 1 on the tiny model every output that finishes "stop" holds its formats (`_conforms`; before:
    2023-11-31, 12:02:60Z, 037.63.58.81 among a character-level walk's outputs)."""
    schema = {"type": "object", "properties": {f: {"type": "string", "format": f} for f in ("date", "time", "ipv4")},
              "required": ["date", "time", "ipv4"], "additionalProperties": False}  # fmt: skip
    params = SamplingParams(max_tokens=200, temperature=1.0, seed=3, n=4, structured_outputs=Grammar(json=schema))
    samples = texts(llm.generate([f"when {i}:" for i in range(6)], params))
    stopped = [t for t, reason in samples if reason == "stop"]
    assert len(stopped) >= 12
    for text in stopped:
        document = json.loads(text)
        jsonschema.validate(document, schema)
        assert all(_conforms(document[f], f) for f in ("date", "time", "ipv4")), document


@pytest.mark.parametrize("pattern", ["ab", "^ab", "ab$", "^ab$"])
def test_a_pattern_matches_the_whole_string_as_in_xgrammar(pattern):
    """JSON Schema reads `pattern` as an unanchored ECMA-262 search; xgrammar (and so vLLM) as a match of the whole
    string, anchors or none, and so does this server (docs/structured_outputs.md). Truth: xgrammar's own grammar for
    the schema, on the same strings."""
    from xgrammar.testing import _is_grammar_accept_string

    schema = json.dumps({"type": "string", "pattern": pattern})
    upstream = xgrammar.Grammar.from_json_schema(schema, any_whitespace=False)
    mended = xgrammar.Grammar.from_ebnf(mended_schema_grammar(schema))
    for value, taken in [("ab", True), ("xab", False), ("abx", False), ("xabx", False)]:
        assert bool(re.search(pattern, value)) or not taken
        document = json.dumps(value)
        assert _is_grammar_accept_string(upstream, document) == taken, value
        assert _is_grammar_accept_string(mended, document) == taken, value


@pytest.mark.parametrize("pattern, refused, taken", [
    (r"^a(x[0-9]+)?$", ["a5", "a55"], ["a", "ax5", "ax123"]),
    (r"^[0-9]{2}(\.[0-9]+)?Z$", ["125Z", "1234Z"], ["12Z", "12.5Z"]),
])  # fmt: skip
def test_a_pattern_with_an_optional_repeat_is_compiled_as_written(pattern, refused, taken):
    """xgrammar 0.2.9 compiles a schema's pattern (its `Regex(..., json_string=true)`) wrongly where an optional
    group holds a repeat: `^a(x[0-9]+)?$` took "a5". Truth: Python's re, and xgrammar's own grammar for the
    same regex outside a JSON string."""
    from xgrammar.testing import _is_grammar_accept_string

    schema = json.dumps({"type": "string", "pattern": pattern})
    upstream = xgrammar.Grammar.from_json_schema(schema, any_whitespace=False)
    mended = xgrammar.Grammar.from_ebnf(mended_schema_grammar(schema))
    plain = xgrammar.Grammar.from_regex(pattern)
    for value in refused:
        assert not re.search(pattern, value) and not _is_grammar_accept_string(plain, value)
        assert _is_grammar_accept_string(upstream, json.dumps(value)), value
        assert not _is_grammar_accept_string(mended, json.dumps(value)), value
    for value in taken:
        assert re.search(pattern, value) and _is_grammar_accept_string(mended, json.dumps(value)), value


@pytest.mark.parametrize("pattern, taken, refused", [
    ('^"[a-z]+"$', ['"ab"'], ['""ab""']),
    ("^a\\\\b$", ["a\\b"], ['"a\\b"']),  # xgrammar wrote the backslash bare: JSON's backspace
    ("^\\x22$", ['"'], ['"""']),
    ("^\\u0022[0-9]$", ['"1'], ['""1"']),
    ("^a\\nb$", ["a\nb"], ['"a\nb"']),  # a bare newline: no JSON
    ("^é+[a-z]$", ["ééx"], ['"e"']),
])
def test_a_pattern_with_an_escaped_or_non_ascii_literal_is_held_as_json(llm, pattern, taken, refused):
    """xgrammar writes such a pattern's grammar itself (no Regex macro), its literals not JSON-escaped: it took a
    bare quote or newline (no JSON) or a bare backslash (another string) and refused the string's JSON. Truth:
    Python's re on the value and json's encoder (a control character as \\u00XX, as the grammar writes it)."""
    from xgrammar.testing import _is_grammar_accept_string

    schema = {"type": "string", "pattern": pattern}
    grammar = xgrammar.Grammar.from_ebnf(mended_schema_grammar(json.dumps(schema)))
    for value in taken:
        assert re.search(pattern, value)
        document = json.dumps(value, ensure_ascii=False).replace("\\n", "\\u000a")
        assert _is_grammar_accept_string(grammar, document), document
    for document in refused:
        assert not _is_grammar_accept_string(grammar, document), document
    out = llm.generate(["x"], SamplingParams(max_tokens=20, structured_outputs=Grammar(json=schema)))[0].outputs[0]
    assert out.finish_reason != "stop" or re.search(pattern, json.loads(out.text))


@pytest.mark.parametrize("tag, taken, refused", [
    (FREE_TEXT_TAG, ["<x>ab</x>", "<x></x>", "<x></</x>", "<x></x</x>", "<x>é😀</x>"], ["<x>a</x>b</x>", "<x>a"]),
    (TRIGGERED_TAG, ["", "ab<", "a<f>12</f>b<f>-3</f>", "<<f>1</f>"], ["a<f>x</f>", "a<fx", "a<f>1</f"]),
    # an exclude that ends where a trigger does ("f" at the end of "<f"): xgrammar refuses the trigger there
    ({**TRIGGERED_TAG, "format": {**TRIGGERED_TAG["format"], "excludes": ["f"]}}, ["", "a<", "<a"],
     ["<f>1</f>", "a<f>1</f>", "f"]),
    # stop_after_first: the text ends after the first tag (xgrammar's TagDispatch without its loop)
    (FIRST_ONLY_TAG, ["", "ab<", "a<f>12</f>", "<<f>1</f>"], ["a<f>1</f>b", "a<f>1</f><f>2</f>", "a<f>x</f>"]),
    # and an exclude that starts its trigger (xgrammar printed a grammar text it refused to read back)
    ({**FIRST_ONLY_TAG, "format": {**FIRST_ONLY_TAG["format"], "excludes": ["<"]}}, ["", "ab", "a>f"],
     ["<", "a<f>1</f>"]),
], ids=["tag", "triggered", "exclude-ending-a-trigger", "stop-after-first", "stop-after-first-exclude-starting-it"])
# fmt: skip
def test_a_structural_tags_free_text_written_out_takes_what_xgrammar_takes(tag, taken, refused):
    """The free text of a structural tag (xgrammar's TagDispatch, which takes any bytes) is written out as rules
    with character classes; the texts it takes and refuses are those xgrammar's own grammar does. Truth: xgrammar's
    grammar for the tag on the same texts."""
    from xgrammar.testing import _is_grammar_accept_string

    from trtpaged.runtime.structured import mended_structural_tag_grammar

    upstream = xgrammar.Grammar.from_structural_tag(json.dumps(tag))
    mended_text = mended_structural_tag_grammar(tag)
    assert "TagDispatch" in str(upstream) and "TagDispatch" not in mended_text
    mended = xgrammar.Grammar.from_ebnf(mended_text)
    for text in taken:
        assert _is_grammar_accept_string(upstream, text) and _is_grammar_accept_string(mended, text), text
    for text in refused:
        assert not _is_grammar_accept_string(upstream, text) and not _is_grammar_accept_string(mended, text), text


def _const_tag(begin: str, end: str, content: Any = "") -> dict[str, Any]:
    return {"begin": begin, "end": end,
            "content": content if isinstance(content, dict) else {"type": "const_string", "value": content}}


@pytest.mark.parametrize("fmt, taken, refused", [
    # a trigger inside another's text ("b" in "<ba") is not one there: xgrammar's automaton goes on with "<b"
    ({"triggers": ["<ba", "b"], "tags": [_const_tag("<ba", "A"), _const_tag("bb", "B")]},
     ["<bx", "<baA", "<bbbB", "bbB<bxbbB"], ["<bbB", "<bab"]),
    # a trigger that starts an exclude ("a" of "a<<") may go on as that exclude's text instead of its tag
    ({"triggers": ["a"], "excludes": ["a<<"], "tags": [_const_tag("a", ">", "c")], "stop_after_first": True},
     ["a<", "xa<c", "ac>"], ["a<<", "a<a"]),
    # two tags of any_text: the second's states were named as xgrammar's own any_text_1 (refused as defined twice)
    ({"triggers": ["<", "b<"], "tags": [_const_tag("<a", ">a", {"type": "any_text"}),
                                        _const_tag("b<", "a", {"type": "any_text"})]},
     ["<ax>a", "b<xa", "xb<xa<a>a"], ["<ax", "b<x>a<a"]),
], ids=["trigger-inside-a-trigger", "trigger-starting-an-exclude", "two-any-texts"])  # fmt: skip
def test_overlapping_triggers_and_excludes_take_what_xgrammar_takes(fmt, taken, refused):
    """A structural tag's free text, written out as rules, finds a trigger where xgrammar's automaton does: where
    the longest suffix of the text that starts a trigger or an exclude is that trigger (not any trigger the text
    ends with), and a trigger that starts a longer one may go on as its text. Truth: xgrammar's grammar for the tag
    on the same texts."""
    from xgrammar.testing import _is_grammar_accept_string

    tag = {"type": "structural_tag", "format": {"type": "triggered_tags", **fmt}}
    upstream = xgrammar.Grammar.from_structural_tag(json.dumps(tag))
    mended = xgrammar.Grammar.from_ebnf(mended_structural_tag_grammar(tag))
    assert "TagDispatch" in str(upstream) and "TagDispatch" not in str(mended)
    for text in taken:
        assert _is_grammar_accept_string(upstream, text) and _is_grammar_accept_string(mended, text), text
    for text in refused:
        assert not _is_grammar_accept_string(upstream, text) and not _is_grammar_accept_string(mended, text), text


def test_random_triggers_and_excludes_take_what_xgrammar_takes():
    """Random trigger, tag and exclude sets over a small alphabet (triggers that start or hold one another,
    excludes that overlap them, any_text inside tags, stop_after_first) and random texts: the written-out free text
    takes (whole or as a prefix) exactly what xgrammar's own grammar for the tag does (before, about 0.5% of such
    texts differed and 6% of such tags were refused: rules named as xgrammar's own).
    Truth: xgrammar's grammar for the same tag."""
    import random

    from xgrammar.testing import _is_grammar_accept_string

    rng = random.Random(7)

    def word(low: int, high: int, alphabet: str = "ab<") -> str:
        return "".join(rng.choice(alphabet) for _ in range(rng.randint(low, high)))

    compared = 0
    for _ in range(40):
        triggers = sorted({word(1, 3) for _ in range(rng.randint(1, 3))})
        tags = [_const_tag(trigger + word(0, 2, "ab<>"), word(1, 2, ">a"),
                           {"type": "any_text"} if rng.random() < 0.3 else word(0, 1, "ac"))
                for trigger in triggers for _ in range(rng.randint(1, 2))]  # fmt: skip
        fmt = {"type": "triggered_tags", "triggers": triggers, "tags": tags, "stop_after_first": rng.random() < 0.4,
               "excludes": sorted({word(1, 3) for _ in range(rng.randint(0, 2))})}  # fmt: skip
        tag = {"type": "structural_tag", "format": fmt}
        try:
            upstream = xgrammar.Grammar.from_structural_tag(json.dumps(tag))
        except Exception:  # noqa: BLE001 - a tag whose begin starts two triggers: xgrammar refuses it
            continue
        mended = xgrammar.Grammar.from_ebnf(mended_structural_tag_grammar(tag))
        pieces = [*triggers, *(t["begin"] for t in tags), *(t["end"] for t in tags), *fmt["excludes"], *"ab<>c"]
        for _ in range(40):
            text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 5)))
            for whole in (True, False):
                assert _is_grammar_accept_string(mended, text, require_termination=whole) == \
                    _is_grammar_accept_string(upstream, text, require_termination=whole), (fmt, text, whole)
            compared += 1
    assert compared > 1000


@pytest.mark.parametrize("excludes", [["<"], ["<f"]])
def test_stop_after_first_with_an_exclude_starting_its_trigger_generates(llm, excludes):
    """A triggered_tags with stop_after_first whose exclude starts its trigger compiles in xgrammar (and vLLM), but
    xgrammar printed its TagDispatch as a grammar text that it refuses to read back ('Exclude string must not be a
    prefix of trigger string'), and the request was refused so. Its free text is now written out as rules; past
    MAX_FREE_TEXT_STATES (a trigger of 140 characters) it is xgrammar's own grammar. Truth: xgrammar's grammar for
    the tag takes every output (as a prefix where max_tokens cut it)."""
    from xgrammar.testing import _is_grammar_accept_string

    long_trigger = "<" + "f" * 140
    for trigger in ("<f", long_trigger):
        fmt = {**FIRST_ONLY_TAG["format"], "excludes": excludes, "triggers": [trigger],
               "tags": [{**FIRST_ONLY_TAG["format"]["tags"][0], "begin": trigger + ">"}]}  # fmt: skip
        tag = {"type": "structural_tag", "format": fmt}
        params = SamplingParams(max_tokens=16, temperature=1.0, seed=4, n=4,
                                structured_outputs=Grammar(structural_tag=tag))  # fmt: skip
        samples = texts(llm.generate(["a", "b"], params))
        upstream = xgrammar.Grammar.from_structural_tag(json.dumps(tag))
        for text, reason in samples:  # a free text rarely ends: one cut by max_tokens is a prefix xgrammar takes
            assert _is_grammar_accept_string(upstream, text, require_termination=reason == "stop"), (text, reason)
            assert not any(e in text for e in excludes), text


def test_a_format_on_many_fields_is_compiled_once(tiny_engine_dir):
    """Each hostname format became a pattern written out as rules of its own, one copy per field: 20 fields took
    2.0 s to compile on SmolLM2's vocabulary (0.35 s for one; 0.14 s as xgrammar's own format), each copy's masks
    in the compiled grammar. The same pattern is now written out once. Truth: xgrammar's own grammar for the
    format, whose compiled size grows with the fields' names alone (memory_size_bytes, as GrammarCache counts)."""
    from transformers import AutoTokenizer

    info = xgrammar.TokenizerInfo.from_huggingface(AutoTokenizer.from_pretrained(f"{tiny_engine_dir}/tokenizer"))

    def sizes(fields: int) -> tuple[int, int]:
        names = [f"host{i}" for i in range(fields)]
        schema = json.dumps({"type": "object", "required": names,
                             "properties": {n: {"type": "string", "format": "hostname"} for n in names}})  # fmt: skip
        compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
        ours = compiler.compile_grammar(mended_schema_grammar(schema)).memory_size_bytes
        return ours, compiler.compile_json_schema(schema, any_whitespace=False).memory_size_bytes

    (ours_1, own_1), (ours_20, own_20) = sizes(1), sizes(20)
    assert ours_20 - ours_1 <= own_20 - own_1, (ours_1, ours_20, own_1, own_20)


def test_a_free_text_with_a_long_end_compiles_as_xgrammar_does(tiny_engine_dir):
    """A free text written out as rules has one rule per prefix of its end: an `any_text` ending in 1002
    characters took 8 times xgrammar's compiled size on the tiny vocabulary (minutes to compile on SmolLM2's). Past
    MAX_FREE_TEXT_STATES prefixes the TagDispatch stays. Truth: xgrammar's own compile of the tag."""
    from transformers import AutoTokenizer

    info = xgrammar.TokenizerInfo.from_huggingface(AutoTokenizer.from_pretrained(f"{tiny_engine_dir}/tokenizer"))
    tag = json.dumps({"type": "structural_tag", "format": {"type": "tag", "begin": "<x>",
                                                           "content": {"type": "any_text"}, "end": f"<{'ab' * 500}>"}})
    compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
    ours = compiler.compile_grammar(mended_structural_tag_grammar(json.loads(tag))).memory_size_bytes
    assert ours <= 2 * compiler.compile_structural_tag(tag).memory_size_bytes


_A_DIGIT = {"type": "string", "pattern": "^a[0-9]$"}


@pytest.mark.parametrize("value_schema, taken, refused", [
    (_A_DIGIT, ["a1", " a7\n"], ["a12", "b1", '"a1"']),
    ({"type": "string", "format": "date"}, ["2024-02-29", "1999-12-31"], ["2023-02-30", "2024-13-01", "24-01-01"]),
    ({"type": "string", "pattern": "^a\\\\b$"}, ["a\\b"], ["a\bb", "a\\\\b"]),
    ({"anyOf": [_A_DIGIT, {"type": "integer"}]}, ["a3", "-7"], ["a", "3.5"]),
    ({"type": "object", "properties": {"e": _A_DIGIT}, "required": ["e"]}, ['{"e": "a1"}'], ['{"e": "a12"}', "a1"]),
    ({"type": "array", "items": {"type": "string", "format": "date"}}, ['["2024-02-29"]'], ['["2023-02-29"]']),
])  # fmt: skip
def test_a_qwen_xml_parameters_patterns_and_formats_hold_to_the_value_as_written(value_schema, taken, refused):
    """A qwen_xml_parameter node writes its top-level values as raw text between <parameter=NAME> and
    </parameter> (nested ones as JSON). Its patterns reached xgrammar as `hidden_pattern` stand-ins, which xgrammar
    wrote there as plain text: the grammar took only the stand-in's own characters (`trtpagedpattern5e61...`) and
    no value the pattern matches. Truth: Python's re and `_conforms` on each value (raw, or json's decoder where
    the value is JSON)."""
    from xgrammar.testing import _is_grammar_accept_string

    from trtpaged.runtime.structured import tag_formats_as_patterns

    schema = {"type": "object", "properties": {"d": value_schema}, "required": ["d"]}
    tag = json.dumps({"type": "structural_tag", "format": {"type": "qwen_xml_parameter", "json_schema": schema}})
    grammar = xgrammar.Grammar.from_ebnf(mended_structural_tag_grammar(tag_formats_as_patterns(json.loads(tag))))

    def holds(raw: str) -> bool:  # a number, object or array is JSON there; a string is the text itself
        try:
            value = json.loads(raw)
        except ValueError:
            value = raw
        value = raw if isinstance(value, str) else value
        try:
            jsonschema.validate(value, value_schema)
        except jsonschema.ValidationError:
            return False
        return all(_conforms(date, "date") for date in re.findall(r"[0-9]+-[0-9]+-[0-9]+", raw))

    for value in taken:
        assert holds(value.strip()), value
        assert _is_grammar_accept_string(grammar, f"<parameter=d>{value}</parameter>"), value
    for value in refused:
        assert not holds(value), value
        assert not _is_grammar_accept_string(grammar, f"<parameter=d>{value}</parameter>"), value


def test_sampled_qwen_xml_parameters_hold_their_pattern_and_format(llm):
    """Through the engine at temperature 1: every output that finishes "stop" has each parameter's raw value
    matching its pattern (Python's re) and its format (`_conforms`); before, a pattern's value was its stand-in."""
    schema = {"type": "object", "properties": {"c": {"type": "string", "pattern": "^[a-z]{1,6}$"},
                                               "d": {"type": "string", "format": "date"}},
              "required": ["c", "d"], "additionalProperties": False}  # fmt: skip
    tag = {"type": "structural_tag", "format": {"type": "qwen_xml_parameter", "json_schema": schema}}
    params = SamplingParams(max_tokens=80, temperature=1.0, seed=3, n=4, structured_outputs=Grammar(structural_tag=tag))
    stopped = [t for t, reason in texts(llm.generate([f"call {i}:" for i in range(6)], params)) if reason == "stop"]
    assert len(stopped) >= 3
    for text in stopped:
        values = dict(re.findall(r"<parameter=(\w+)>\s*(.*?)\s*</parameter>", text, re.S))
        assert set(values) == {"c", "d"} and re.search("^[a-z]{1,6}$", values["c"]), text
        assert _conforms(values["d"], "date"), text


_NOT_QUOTE_OR_LINE = '[^"\\\\\\r\\n]{1,3}'  # a class xgrammar also writes for a length-bounded JSON string's character


@pytest.mark.parametrize("fmt, wrap", [
    ({"type": "regex", "pattern": _NOT_QUOTE_OR_LINE}, "{}"),
    ({"type": "grammar", "grammar": f"root ::= {_NOT_QUOTE_OR_LINE}"}, "{}"),
    ({"type": "qwen_xml_parameter", "json_schema": {"type": "object", "required": ["v"], "properties": {
        "v": {"type": "string", "pattern": f"^{_NOT_QUOTE_OR_LINE}$"}}}}, "<parameter=v>{}</parameter>"),
], ids=["regex", "ebnf", "qwen-xml-pattern"])  # fmt: skip
def test_a_tags_regex_or_grammar_keeps_the_class_a_length_bounded_string_has(fmt, wrap):
    """The JSON string class replaced in a length-bounded string's rule (`[^"\\\\\\r\\n]`, which takes control
    characters JSON forbids) was replaced wherever the tag's grammar text had it: a regex, an EBNF grammar or a raw
    XML value written with that class refused a tab. Truth: Python's re on each value; json's decoder for the
    length-bounded JSON string beside them, which still refuses the raw tab."""
    from xgrammar.testing import _is_grammar_accept_string

    from trtpaged.runtime.structured import tag_formats_as_patterns

    tag = json.dumps({"type": "structural_tag", "format": {"type": "sequence", "elements": [
        fmt, {"type": "json_schema", "json_schema": {"type": "string", "maxLength": 2}}]}})  # fmt: skip
    grammar = xgrammar.Grammar.from_ebnf(mended_structural_tag_grammar(tag_formats_as_patterns(json.loads(tag))))

    for value, taken in [("\t", True), ("a\x01b", True), ("abc", True), ("a\nb", False), ('"', False), ("", False)]:
        assert bool(re.fullmatch(_NOT_QUOTE_OR_LINE, value)) == taken, value
        assert _is_grammar_accept_string(grammar, wrap.format(value) + '"ab"') == taken, value
    for string in ['"a\tb"', '"\x01"']:
        with pytest.raises(ValueError):
            json.loads(string)
        assert not _is_grammar_accept_string(grammar, wrap.format("a") + string), string


@pytest.mark.parametrize("value_schema, taken, refused", [
    (_A_DIGIT, ["a1", "a7"], ["a12", "b1", '"a1"']),
    ({"type": "string", "pattern": "^a\\\\b$"}, ["a\\b"], ["a\bb", "a\\\\b"]),
    ({"type": "string", "pattern": "^é+[a-z]$"}, ["ééx"], ["e", "éé"]),
    ({"type": "string", "format": "date"}, ["2024-02-29", "1999-12-31"], ["2023-02-30", "2023-02-29", "24-01-01"]),
])  # fmt: skip
def test_a_gemma_styled_schemas_patterns_and_formats_hold_to_the_value(value_schema, taken, refused):
    """A json_schema node of style "gemma" writes each string between <|"|> delimiters, its pattern as rules of
    xgrammar's own (never the Regex macro): the `hidden_pattern` stand-in became the value itself there, so no value
    the pattern matches was taken, at any nesting. Truth: Python's re and `_conforms` on each raw value."""
    from xgrammar.testing import _is_grammar_accept_string

    from trtpaged.runtime.structured import tag_formats_as_patterns

    schema = {"type": "object", "properties": {"d": value_schema, "o": {"type": "object", "properties": {
        "e": value_schema}, "required": ["e"]}}, "required": ["d", "o"]}  # fmt: skip
    tag = json.dumps({"type": "structural_tag", "format": {"type": "json_schema", "style": "gemma",
                                                           "json_schema": schema}})  # fmt: skip
    grammar = xgrammar.Grammar.from_ebnf(mended_structural_tag_grammar(tag_formats_as_patterns(json.loads(tag))))

    def holds(value: str) -> bool:
        if "format" in value_schema:
            return _conforms(value, value_schema["format"])
        return bool(re.search(value_schema["pattern"], value))

    def text(d: str, e: str) -> str:
        return f'{{d:<|"|>{d}<|"|>,o:{{e:<|"|>{e}<|"|>}}}}'

    for value in taken:
        assert holds(value) and _is_grammar_accept_string(grammar, text(value, value)), value
    for value in refused:
        assert not holds(value), value
        assert not _is_grammar_accept_string(grammar, text(value, taken[0])), value
        assert not _is_grammar_accept_string(grammar, text(taken[0], value)), value


def test_a_gemma_styled_hostname_compiles_no_larger_than_in_json(tiny_engine_dir):
    """A gemma node's patterns are written as xgrammar's own rules, which keep the string's delimiter out: the
    hostname format as its pattern there compiled to 1.1 MB on the tiny vocabulary (2.5 s on SmolLM2's), 8 times
    the same schema in a JSON node (whose pattern is written out from xgrammar's regex grammar); a gemma hostname
    keeps xgrammar's own format. Truth: the compiled size of the schema in a JSON node (memory_size_bytes)."""
    from transformers import AutoTokenizer

    from trtpaged.runtime.structured import tag_formats_as_patterns

    info = xgrammar.TokenizerInfo.from_huggingface(AutoTokenizer.from_pretrained(f"{tiny_engine_dir}/tokenizer"))
    compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
    schema = {"type": "object", "properties": {"h": {"type": "string", "format": "hostname"}}, "required": ["h"]}

    def size(style: str) -> int:
        tag = json.dumps({"type": "structural_tag", "format": {"type": "json_schema", "style": style,
                                                               "json_schema": schema}})  # fmt: skip
        mended = mended_structural_tag_grammar(tag_formats_as_patterns(json.loads(tag)))
        return compiler.compile_grammar(mended).memory_size_bytes

    assert size("gemma") <= size("json"), (size("gemma"), size("json"))


def test_sampled_gemma_styled_values_hold_their_pattern_and_format(llm):
    """Through the engine at temperature 1: every output that finishes "stop" has each gemma value (between <|"|>
    delimiters) matching its pattern (Python's re) and its format (`_conforms`); before, the value could only be the
    pattern's stand-in (`trtpagedpattern5e61...`) and no output finished (0 of 20)."""
    schema = {"type": "object", "properties": {"p": {"type": "string", "pattern": "^a[0-9]{1,2}$"},
                                               "d": {"type": "string", "format": "date"}}, "required": ["p", "d"]}
    tag = {"type": "structural_tag", "format": {"type": "json_schema", "style": "gemma", "json_schema": schema}}
    params = SamplingParams(max_tokens=150, temperature=1.0, seed=5, n=4,
                            structured_outputs=Grammar(structural_tag=tag))
    stopped = [t for t, reason in texts(llm.generate([f"go {i}:" for i in range(4)], params)) if reason == "stop"]
    assert len(stopped) >= 8
    for text in stopped:
        values = re.fullmatch(r'\{\s*p\s*:\s*<\|"\|>(.*?)<\|"\|>\s*,\s*d\s*:\s*<\|"\|>(.*?)<\|"\|>\s*\}', text, re.S)
        assert values and re.search("^a[0-9]{1,2}$", values[1]) and _conforms(values[2], "date"), text


@pytest.mark.parametrize("schema, value", [
    ({"type": "string", "pattern": "^a[0-9]$"}, "a7"), ({"type": "string", "format": "date"}, "2024-02-29"),
], ids=["pattern", "format"])  # fmt: skip
def test_a_tag_naming_a_token_by_its_text_takes_its_patterns_values(schema, value):
    """A tag that names a token by its text (not a stop token) needs the vocabulary, so it is compiled by xgrammar
    from the tag itself; it was given the tag with its patterns (and formats) as `hidden_pattern` stand-ins, which
    only the mended text writes out: the grammar took no value the pattern matches. Truth: Python's re and
    `_conforms` on the value, and the same tag naming the token by its id."""
    from trtpaged.models.tiny_tokenizer import BOS, BOS_ID, make_tiny_tokenizer
    from trtpaged.runtime.structured import GrammarCache

    tok = make_tiny_tokenizer()  # one token a byte
    cache = GrammarCache(tok, len(tok), [tok.eos_token_id])
    assert re.search(schema["pattern"], value) if "pattern" in schema else _conforms(value, schema["format"])
    for token in (BOS, BOS_ID):
        tag = {"type": "structural_tag", "format": {"type": "sequence", "elements": [
            {"type": "token", "token": token}, {"type": "json_schema", "json_schema": schema}]}}  # fmt: skip
        matcher = cache.matcher(cache.compile(Grammar(structural_tag=tag)))
        ids = [BOS_ID, *tok.encode(json.dumps(value), add_special_tokens=False), tok.eos_token_id]
        assert all(matcher.accept_token(t) for t in ids) and matcher.is_terminated(), token


def test_a_gemma_styled_string_takes_any_length():
    """Why a gemma node's minLength / maxLength is refused (BAD_TAGS): xgrammar 0.2.9 writes its strings without
    them, so the output could break its own schema. Truth: jsonschema refuses the value xgrammar's grammar takes."""
    from xgrammar.testing import _is_grammar_accept_string

    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate("abcd", GEMMA_BOUNDED)
    tag = {"type": "structural_tag", "format": {"type": "json_schema", "style": "gemma", "json_schema": {
        "type": "object", "properties": {"s": GEMMA_BOUNDED}, "required": ["s"]}}}  # fmt: skip
    assert _is_grammar_accept_string(xgrammar.Grammar.from_structural_tag(json.dumps(tag)), '{s:<|"|>abcd<|"|>}')


@pytest.mark.parametrize("fmt", [
    {"type": "regex", "pattern": "trtpagedpattern41"},
    {"type": "grammar", "grammar": 'root ::= "t" "r" "t" "p" "a" "g" "e" "d" "p" "a" "t" "t" "e" "r" "n" "4" "1"'},
], ids=["regex", "ebnf"])  # fmt: skip
def test_a_tags_regex_spelling_a_pattern_stand_in_keeps_its_text(fmt):
    """A schema pattern's stand-in written as plain text is written out as its regex's rules (a qwen_xml value);
    any regex or EBNF node that spelled one (`trtpagedpattern41`, the stand-in of `A`) was rewritten too: it took
    "A" and refused its own text. Only the stand-ins of the tag's schemas are written out. Truth: Python's re."""
    from xgrammar.testing import _is_grammar_accept_string

    from trtpaged.runtime.structured import tag_formats_as_patterns

    tag = json.dumps({"type": "structural_tag", "format": {"type": "sequence", "elements": [fmt, {
        "type": "qwen_xml_parameter", "json_schema": {"type": "object", "properties": {"v": _A_DIGIT}}}]}})
    grammar = xgrammar.Grammar.from_ebnf(mended_structural_tag_grammar(tag_formats_as_patterns(json.loads(tag))))
    for text, taken in [("trtpagedpattern41", True), ("A", False)]:
        assert bool(re.fullmatch("trtpagedpattern41", text)) == taken
        assert _is_grammar_accept_string(grammar, text + "<parameter=v>a1</parameter>") == taken, text
    assert not _is_grammar_accept_string(grammar, "trtpagedpattern41<parameter=v>a12</parameter>")


_BOUNDED = {"type": "string", "maxLength": 3}


@pytest.mark.parametrize("kind, spec, wrap", [
    ("json", {"$defs": {"Short-Name": _BOUNDED}, "type": "array", "items": {"$ref": "#/$defs/Short-Name"}}, "[{}]"),
    ("json", {"$defs": {"v1.name": _BOUNDED}, "type": "array", "items": {"$ref": "#/$defs/v1.name"}}, "[{}]"),
    ("json", {"type": ["string", "null"], "maxLength": 3}, "{}"),
    ("json", {"anyOf": [_BOUNDED, {"type": "integer"}]}, "{}"),
    ("json", {"type": "object", "propertyNames": {"maxLength": 3}, "additionalProperties": {"type": "integer"}},
     "{{{}: 1}}"),
    ("json", {"type": "array", "items": _BOUNDED}, "[{}]"),
    ("json", {"type": "string", "minLength": 3}, "{}"),
    ("json", {"type": "string", "minLength": 3, "maxLength": 3}, "{}"),
    ("structural_tag", {"type": "structural_tag", "format": {"type": "sequence", "elements": [
        {"type": "json_schema", "json_schema": {"type": "string", "maxLength": 4}},
        {"type": "json_schema", "json_schema": _BOUNDED}]}}, '"ab"{}'),
    ("structural_tag", {"type": "structural_tag", "format": {"type": "sequence", "elements": [
        {"type": "json_schema", "json_schema": {"type": "object", "properties": {"a": {"type": "string",
                                                                                   "maxLength": 4}}}},
        {"type": "json_schema", "json_schema": {"type": "object", "properties": {"a": _BOUNDED}}}]}},
     '{{"a": "ab"}}{{"a": {}}}'),
], ids=["defs-hyphen", "defs-dot", "nullable", "anyof", "property-names", "array", "min-only", "exact", "tag-second",
        "tag-second-property"])  # fmt: skip
def test_every_length_bounded_string_is_a_json_string(kind, spec, wrap):
    """The JSON string class is put in a length-bounded string's character rule by its name, which xgrammar makes
    from the string's place: a $defs name keeps its `-` and `.`, and a structural tag's second schema's rule gets a
    number (`root_characters_1`); those strings kept xgrammar's class, which takes a raw tab. Truth: json's decoder
    refuses the raw tab and takes the escaped one; the bound as jsonschema reads it."""
    from xgrammar.testing import _is_grammar_accept_string

    from trtpaged.runtime.structured import tag_formats_as_patterns

    if kind == "json":
        grammar = xgrammar.Grammar.from_ebnf(mended_schema_grammar(json.dumps(spec)))
    else:
        grammar = xgrammar.Grammar.from_ebnf(mended_structural_tag_grammar(tag_formats_as_patterns(spec)))
    for string, taken in [('"a\tb"', False), ('"\x01bc"', False), ('"abc"', True)]:
        try:
            json.loads(string)
        except ValueError:
            assert not taken, string
        assert _is_grammar_accept_string(grammar, wrap.format(string)) == taken, string
    if kind == "json":
        jsonschema.validate(json.loads(wrap.format('"abc"')), spec)


def test_a_qwen_xml_parameter_reads_no_style():
    """xgrammar reads a style on a json_schema node only: a qwen_xml_parameter of style "gemma" is its XML form,
    its strings bounded. It was refused for a maxLength ("not enforced in style 'gemma'") and its hostname kept
    xgrammar's loose format (a 64-letter label taken). Truth: xgrammar's grammar for the node is the same without
    the style; `_conforms` on the hostname; the bound as jsonschema reads it."""
    from xgrammar.testing import _is_grammar_accept_string

    from trtpaged.models.tiny_tokenizer import make_tiny_tokenizer
    from trtpaged.runtime.structured import GrammarCache, tag_formats_as_patterns

    schema = {"type": "object", "properties": {"h": {"type": "string", "format": "hostname"}, "s": GEMMA_BOUNDED},
              "required": ["h", "s"]}  # fmt: skip
    tags = [{"type": "structural_tag", "format": {"type": "qwen_xml_parameter", "json_schema": schema, **style}}
            for style in ({"style": "gemma"}, {})]  # fmt: skip
    assert len({str(xgrammar.Grammar.from_structural_tag(json.dumps(tag))) for tag in tags}) == 1
    tok = make_tiny_tokenizer()
    GrammarCache(tok, len(tok), [tok.eos_token_id]).compile(Grammar(structural_tag=tags[0]))  # not refused
    grammar = xgrammar.Grammar.from_ebnf(mended_structural_tag_grammar(tag_formats_as_patterns(tags[0])))
    for host, s, taken in [("ab.c", "abc", True), ("a" * 64, "abc", False), ("ab.c", "abcd", False)]:
        assert (_conforms(host, "hostname") and jsonschema.Draft202012Validator(GEMMA_BOUNDED).is_valid(s)) == taken
        text = f"<parameter=h>{host}</parameter><parameter=s>{s}</parameter>"
        assert _is_grammar_accept_string(grammar, text) == taken, (host, s)

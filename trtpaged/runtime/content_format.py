"""How a chat template reads a message's content (vLLM's --chat-template-content-format): as one string, or as
OpenAI's list of parts ({"type": "text", "text": ...}) that it loops over. A template that loops over the parts
and is given a string loops over its characters and drops the text, so "auto" reads the template to choose."""

from __future__ import annotations

import functools
from typing import Any, Callable, Iterator, Optional

import jinja2
import jinja2.ext
from jinja2 import nodes

CONTENT_FORMATS = ("auto", "string", "openai")


def template_content_format(template: Any, tools: bool = False) -> str:
    """"openai" when the template loops over a message's content, else "string" (also for a template Jinja cannot
    parse here: it is rendered as before). Of transformers' dict of named templates, the one it renders: "tool_use"
    for a request with tools when there is one, else "default"."""
    if isinstance(template, dict):
        template = template.get("tool_use") if tools and "tool_use" in template else template.get("default")
    return "openai" if isinstance(template, str) and _loops_over_content(template) else "string"


class _GenerationBlocks(jinja2.ext.Extension):
    """transformers' `{% generation %}...{% endgeneration %}` (the assistant's tokens, for training masks), read
    here as its body, so that templates with it parse."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


@functools.lru_cache(maxsize=64)
def _loops_over_content(template: str) -> bool:
    try:
        return _reads_parts(jinja2.Environment(extensions=["jinja2.ext.loopcontrols", "jinja2.ext.do",
                                                           _GenerationBlocks]).parse(template))  # fmt: skip
    except (jinja2.TemplateSyntaxError, RecursionError):  # rendering refuses it, naming the template or messages
        return False


def _reads_parts(tree: nodes.Template) -> bool:
    """Whether a parsed template loops over a message's content: itself, or in a macro it passes the content to."""
    macros = {macro.name: macro for macro in tree.find_all(nodes.Macro)}
    return _loops_over_content_in(tree.body, set(), _MacroReader(macros))


class _MacroReader:
    """Which macro parameters a macro loops over (as content), each macro read once; a macro calling itself (or
    one that calls it back) is not read again inside its own reading."""

    def __init__(self, macros: dict[str, nodes.Macro]):
        self.macros, self._loops, self._reading = macros, {}, set()

    def loops_over(self, call: nodes.Call, is_content: Callable[[nodes.Node], bool]) -> bool:
        """Whether `call` passes a content to a parameter its macro loops over."""
        macro = self.macros.get(call.node.name) if isinstance(call.node, nodes.Name) else None
        if macro is None:
            return False
        params = [arg.name for arg in macro.args]
        passed = list(zip(params, call.args)) + [(kw.key, kw.value) for kw in call.kwargs if kw.key in params]
        return any(is_content(value) and self._param_looped(macro, param) for param, value in passed)

    def _param_looped(self, macro: nodes.Macro, param: str) -> bool:
        key = (macro.name, param)
        if key not in self._loops:
            if macro.name in self._reading:
                return False
            self._reading.add(macro.name)
            try:
                self._loops[key] = _loops_over_content_in(macro.body, {param}, self)
            finally:
                self._reading.discard(macro.name)
        return self._loops[key]


def _loops_over_content_in(body: list[nodes.Node], contents: set[str], macros: _MacroReader) -> bool:
    """Whether the statements loop over a message's content, or a name in `contents` (a macro's parameter; a
    namespace's field written `ns.field`)."""
    message_lists, messages, contents = {"messages"}, set(), set(contents)
    # names bound to the conversation, to one of its messages, to a message's content: in the template's order,
    # so that a later statement sees the names the earlier ones bound

    def is_content(node: nodes.Node) -> bool:
        return _is_content(node, messages, message_lists, contents)

    for node in _in_order(body, (nodes.For, nodes.Assign, nodes.Call)):
        if isinstance(node, nodes.Call):
            if macros.loops_over(node, is_content):
                return True
            continue
        source = node.iter if isinstance(node, nodes.For) else node.node
        bound = set(_stored_names(node.target))
        if isinstance(node, nodes.For) and _root(source) in message_lists:
            messages |= bound
        elif isinstance(node, nodes.Assign) and _root(source) in message_lists:
            (messages if _indexes_one(source) else message_lists).update(bound)
        if is_content(source):
            if isinstance(node, nodes.For):
                return True
            contents |= bound
        elif isinstance(node, nodes.Assign) and _is_namespace(source):
            # {% set ns = namespace(content=message.content) %}: ns.content is the content
            contents |= {f"{name}.{kw.key}" for name in bound for kw in source.kwargs if is_content(kw.value)}
    return False


def _in_order(body: list[nodes.Node], kinds: tuple[type, ...]) -> Iterator[Any]:
    """The nodes of `kinds` in the statements and below them, in the template's order."""
    for statement in body:
        if isinstance(statement, kinds):
            yield statement
        yield from statement.find_all(kinds)


def _is_namespace(node: nodes.Node) -> bool:
    return isinstance(node, nodes.Call) and isinstance(node.node, nodes.Name) and node.node.name == "namespace"


def _stored_names(target: nodes.Node) -> Iterator[str]:
    if isinstance(target, nodes.Name):
        yield target.name
    elif isinstance(target, nodes.NSRef):  # {% set ns.field = ... %}
        yield f"{target.name}.{target.attr}"
    elif isinstance(target, nodes.Tuple):
        for item in target.items:
            yield from _stored_names(item)


def _root(node: nodes.Node) -> Optional[str]:
    """The variable an expression of slices and filters reads (`messages[1:] | reverse` -> messages)."""
    while True:
        if isinstance(node, nodes.Filter) and node.node is not None:
            node = node.node
        elif isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice):
            node = node.node
        else:
            return node.name if isinstance(node, nodes.Name) else None


def _indexes_one(node: nodes.Node) -> bool:
    """`messages[0]`, `messages[-1]`: one message of the list."""
    return isinstance(node, nodes.Getitem) and not isinstance(node.arg, nodes.Slice)


def _is_content(node: nodes.Node, messages: set[str], message_lists: set[str], contents: set[str]) -> bool:
    """`message['content']`, `message.content`, `messages[0]['content']` or a name bound to one (through filters)."""
    while isinstance(node, nodes.Filter) and node.node is not None:
        node = node.node
    if isinstance(node, nodes.Name):
        return node.name in contents
    if isinstance(node, nodes.Getattr):
        owner, key = node.node, node.attr
    elif isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Const):
        owner, key = node.node, node.arg.value
    else:
        return False
    if isinstance(owner, nodes.Name) and f"{owner.name}.{key}" in contents:
        return True
    if key != "content":
        return False
    if isinstance(owner, nodes.Name):
        return owner.name in messages
    return _indexes_one(owner) and _root(owner.node) in message_lists  # type: ignore[attr-defined]

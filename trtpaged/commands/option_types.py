"""Click parameter types shared by the commands, and `flag_error`: a runtime error line in the flags' names."""

from __future__ import annotations

import codecs
import json
import math
import os
import re
import stat
from fractions import Fraction
from typing import Iterable, Mapping
from urllib.parse import urlsplit

import click

from trtpaged.errors import mentions_renamed


class RegularFile(click.Path):
    """click.Path of an existing regular file: a FIFO or a device passes click's own check and then blocks the
    read (a hang with no output)."""

    def __init__(self) -> None:
        super().__init__(exists=True, dir_okay=False)

    def convert(self, value, param, ctx):
        path = super().convert(value, param, ctx)
        if not stat.S_ISREG(os.stat(path).st_mode):
            self.fail(f"{path!r} is not a regular file.", param, ctx)
        return path


class ChatTemplate(click.ParamType):
    """vLLM's --chat-template: the path of a regular file holding a Jinja template (UTF-8, at most
    MAX_TEMPLATE_BYTES), else, when no such file opens and the value has a brace or a newline, the template's text
    (its backslash escapes decoded, as vLLM decodes them). Converts to the template's text."""

    name = "TEMPLATE"
    MAX_TEMPLATE_BYTES = 1 << 20

    def convert(self, value, param, ctx):
        if not isinstance(value, str):
            return value
        try:  # opened without blocking: a FIFO's open waits for a writer
            with os.fdopen(os.open(value, os.O_RDONLY | os.O_NONBLOCK), "rb") as f:
                if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                    self.fail(f"{value!r} is not a regular file.", param, ctx)
                data = f.read(self.MAX_TEMPLATE_BYTES + 1)
        except OSError as e:
            if any(c in value for c in "{}\n"):
                return _escapes_decoded(value)
            self.fail(f"{value!r} looks like a file's path (no braces), and it cannot be read: {e.strerror}.",
                      param, ctx)  # fmt: skip
        if len(data) > self.MAX_TEMPLATE_BYTES:
            self.fail(f"{value!r} holds more than {self.MAX_TEMPLATE_BYTES} bytes; a chat template is far smaller.",
                      param, ctx)  # fmt: skip
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            self.fail(f"{value!r} is not UTF-8 text.", param, ctx)


def _escapes_decoded(text: str) -> str:
    """A template typed on a command line with its backslash escapes (\\n) as the characters they stand for, as
    vLLM reads one; text that is not plain ASCII is kept as typed (the decoding would garble it)."""
    try:
        return codecs.decode(text.encode("ascii"), "unicode_escape")
    except (UnicodeError, ValueError):
        return text


class JsonObject(click.ParamType):
    """A JSON object typed on the command line (vLLM's JSON flags), as a dict."""

    name = "json"

    def convert(self, value, param, ctx):
        if isinstance(value, dict):
            return value
        try:
            parsed = json.loads(value)
        except ValueError as exc:
            self.fail(f"not JSON ({exc}): {value[:80]!r}", param, ctx)
        if not isinstance(parsed, dict):
            self.fail(f"must be a JSON object ({{...}}), got {type(parsed).__name__}", param, ctx)
        return parsed


class JsonStringList(click.ParamType):
    """A list of strings typed on the command line: vLLM's JSON form ('["a", "b"]') or comma-separated (a,b)."""

    name = "list"

    def convert(self, value, param, ctx):
        if isinstance(value, tuple):
            return value
        text = value.strip()
        if text.startswith("["):
            try:
                parsed = json.loads(text)
            except ValueError as exc:
                self.fail(f"not JSON ({exc}): {value[:80]!r}", param, ctx)
            if not all(isinstance(item, str) for item in parsed):
                self.fail(f"must be a JSON list of strings, got {value[:80]!r}", param, ctx)
            items = [item.strip() for item in parsed]
        else:
            items = [item.strip() for item in text.split(",")]
        if not items or not all(items):
            self.fail(f"must name at least one value and no empty one, got {value[:80]!r}", param, ctx)
        return tuple(items)


class OutputFile(click.Path):
    """click.Path of a file a command writes, created when absent: an existing path must be a regular file (a FIFO
    blocked the open until a reader came: a server that never started, with no output; a plot replaced it)."""

    def __init__(self) -> None:
        super().__init__(dir_okay=False)

    def convert(self, value, param, ctx):
        path = super().convert(value, param, ctx)
        try:
            mode = os.stat(path).st_mode
        except FileNotFoundError:  # created by the command (which says so if it cannot)
            return path
        except OSError as exc:
            self.fail(f"{path!r}: {exc.strerror or exc}.", param, ctx)
        if not stat.S_ISREG(mode):
            self.fail(f"{path!r} exists and is not a regular file.", param, ctx)
        return path


class Size(click.ParamType):
    """A size in bytes, as `trtpaged.config.parse_size` reads it ("8GiB", "512MiB", a number of bytes), in
    [1, 1 PiB] (model.yaml's bound on a KV memory budget): a bad one failed only when the engine was loading, naming
    an internal field (`kv_tiers.host_memory`) instead of the flag."""

    name = "size"

    def convert(self, value, param, ctx):
        from trtpaged.config import MAX_KV_MEMORY, parse_size

        try:
            size = parse_size(value)
        except ValueError as exc:
            self.fail(str(exc), param, ctx)
        if not 1 <= size <= MAX_KV_MEMORY:
            self.fail(f"{value!r} is {size} bytes; expected 1 byte to {MAX_KV_MEMORY} (1 PiB).", param, ctx)
        return size


class HumanInt(click.ParamType):
    """vLLM's human-readable integers (--max-model-len 32k): a plain integer, or one with a multiplier, lower case
    decimal (k, m, g: 1k = 1000, 25.6k = 25600) and upper case binary (K, M, G: 1K = 1024, whole numbers only)."""

    name = "integer"
    _DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9}
    _BINARY = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}

    def convert(self, value, param, ctx):
        if isinstance(value, int):
            return value
        text = str(value).strip()
        match = re.fullmatch(r"(\d+)(?:\.(\d+))?([kmgKMG]?)", text)
        if match is not None:
            whole, fraction, unit = match.groups()
            if not unit and not fraction:
                return int(whole)
            if unit in self._DECIMAL:
                number = Fraction(f"{whole}.{fraction or 0}") * self._DECIMAL[unit]
                if number.denominator == 1:
                    return int(number)
            elif unit in self._BINARY and not fraction:
                return int(whole) * self._BINARY[unit]
        self.fail(f"{text[:40]!r} is not a whole number of tokens (e.g. 4096, 32k = 32000, 32K = 32768)", param, ctx)


def flag_error(message: str, flags: Mapping[str, str], mentions: Iterable[str] = ()) -> str:
    """`message`, a runtime error line "field: text" (RequestError's and the config errors' form), with the field
    the user set through a flag named as that flag: "max_tokens: must be >= 1" -> "--max-tokens: must be >= 1", a
    nested field "speculative_config.method: ..." -> "--speculative-config: method: ...". The `mentions` (fields of
    `flags`) are named as their flags in the text too ("at most beam_width (2)" -> "at most --beam-width (2)");
    a field no flag sets stays as it is."""
    head, sep, rest = message.partition(": ")
    if not sep:
        return message
    for field in sorted(flags, key=len, reverse=True):
        if head == field:
            head = flags[field]
            break
        if head.startswith(field + "."):
            head, rest = flags[field], f"{head[len(field) + 1:]}: {rest}"
            break
    return f"{head}: {mentions_renamed(rest, {field: flags[field] for field in mentions})}"


class HttpUrl(click.ParamType):
    """An http(s) URL with a host (and a valid port, if any): a URL urllib or httpx cannot open failed only once
    the command had done its work, as a traceback or an unnamed connection error."""

    name = "url"

    def convert(self, value, param, ctx):
        try:
            parts = urlsplit(value)
            ok = parts.scheme in ("http", "https") and bool(parts.hostname)
            parts.port  # ValueError past 65535
        except ValueError:
            ok = False
        if not ok:
            self.fail(f"{value!r} is not an http(s) URL with a host (e.g. http://127.0.0.1:8000).", param, ctx)
        return value


class FiniteFloatRange(click.FloatRange):
    """click.FloatRange that also refuses nan and inf (a range check compares, and nan compares false)."""

    def convert(self, value, param, ctx):
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{number!r} is not a finite number.", param, ctx)
        return number

"""Click parameter types shared by the commands."""

from __future__ import annotations

import math
import os
import stat
from urllib.parse import urlsplit

import click


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

"""Click parameter types shared by the commands."""

from __future__ import annotations

import math

import click


class FiniteFloatRange(click.FloatRange):
    """click.FloatRange that also refuses nan and inf (a range check compares, and nan compares false)."""

    def convert(self, value, param, ctx):
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{number!r} is not a finite number.", param, ctx)
        return number

"""`trtpaged generate`."""

from __future__ import annotations

import click


@click.command(name="generate", context_settings={"ignore_unknown_options": True})
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def command(args: tuple[str, ...]) -> None:
    """Not implemented yet."""
    raise click.ClickException("trtpaged generate: not implemented yet")

"""`trtpaged build`."""

from __future__ import annotations

import click


@click.command(name="build", context_settings={"ignore_unknown_options": True})
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def command(args: tuple[str, ...]) -> None:
    """Not implemented yet."""
    raise click.ClickException("trtpaged build: not implemented yet")

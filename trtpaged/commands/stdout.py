"""Writing a command's results to stdout: a stdout that cannot take them is one error line, not a traceback."""

from __future__ import annotations

import sys

import click


def echo(text: str = "", nl: bool = True, what: str = "the results") -> None:
    """click.echo to stdout; a full disk, a closed pipe or a closed stdout ends the command with one error line."""
    if sys.stdout is None:  # started with stdout closed (>&-): click.echo would drop the text without a word
        raise click.ClickException(f"stdout is closed: nowhere to write {what}")
    try:
        click.echo(text, nl=nl)
    except (OSError, ValueError) as exc:  # ValueError: "I/O operation on closed file"
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise click.ClickException(f"cannot write {what} to stdout ({reason})") from None

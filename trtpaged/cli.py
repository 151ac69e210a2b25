"""The `trtpaged` command line: build, serve, generate, bench, inspect, diagnose, run-batch.

Each command lives in its own module under `trtpaged/commands/` and is imported
only when invoked, so `trtpaged --help` stays fast.
"""

from __future__ import annotations

import importlib
import io
import sys

import click

from trtpaged import __version__
from trtpaged.names import renamed_options

_COMMANDS = {
    "build": "Build an engine dir from a model.yaml.",
    "serve": "Serve an engine over an OpenAI-compatible HTTP API.",
    "generate": "Generate a completion for one prompt.",
    "bench": "Benchmarks: kernels, memory, throughput.",
    "inspect": "Print an engine dir's manifest and memory plan.",
    "diagnose": "What paged KV and sharing buy a workload, with numbers.",
    "run-batch": "Answer a file of OpenAI batch requests (vLLM's run-batch).",
}


class LazyGroup(click.Group):
    """A click group whose subcommands are imported on first use."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(_COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in _COMMANDS:
            return None
        module = importlib.import_module(f"trtpaged.commands.{name.replace('-', '_')}")
        return module.command

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        return super().parse_args(ctx, renamed_options(args))  # deprecated option spellings (names.py)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        with formatter.section("Commands"):
            formatter.write_dl(list(_COMMANDS.items()))


@click.group(cls=LazyGroup)
@click.version_option(__version__, prog_name="trtpaged")
def main() -> None:
    """trtpaged: compile a Hugging Face causal LM into a paged-attention engine and serve it."""
    # a terminal whose encoding lacks a character (latin-1, ASCII: a model's text, a path, U+FFFD) shows it escaped
    # instead of ending the command with UnicodeEncodeError
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper):
            stream.reconfigure(errors="backslashreplace")


if __name__ == "__main__":
    main()

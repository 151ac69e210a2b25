"""The README's commands table, generated from the CLI itself so it cannot drift.

`python -m trtpaged.commands.reference` prints the table; tests/test_docs.py checks
that README.md holds exactly this table between its `commands` markers.
"""

from __future__ import annotations

import click

from trtpaged.cli import main

START, END = "<!-- commands:start (generated: python -m trtpaged.commands.reference) -->", "<!-- commands:end -->"


def _usage(path: str, command: click.Command) -> str:
    parts = [path]
    for param in command.params:
        if isinstance(param, click.Argument):
            name = param.name.upper() if param.name else "ARG"
            parts.append(name if param.required else f"[{name}]")
        elif isinstance(param, click.Option) and not param.hidden:
            flag = max(param.opts, key=len)
            if getattr(param, "_flag_needs_value", False):  # an optional value (--llamacpp [GGUF]): its metavar
                text = f"{flag} {param.metavar}"
            else:
                text = flag if param.is_flag else f"{flag} {_metavar(param)}"
            parts.append(text if param.required else f"[{text}]")
    return "`" + " ".join(parts) + "`"


def _metavar(param: click.Option) -> str:
    kind = param.type
    if isinstance(kind, click.Choice):
        return "/".join(str(c) for c in kind.choices)
    if isinstance(kind, (click.types.IntParamType, click.IntRange)):
        return "N"
    if isinstance(kind, click.types.FloatParamType):
        return "X"
    if isinstance(kind, click.Path):
        return "PATH"
    return (param.name or "value").upper()


def _summary(command: click.Command) -> str:
    text = (command.help or command.short_help or "").strip().split("\n\n")[0]
    return " ".join(text.split()).replace("|", "\\|")


def _rows(prefix: str, group: click.Group, ctx: click.Context) -> list[tuple[str, str]]:
    rows = []
    for name in group.list_commands(ctx):
        command = group.get_command(ctx, name)
        if command is None:
            continue
        path = f"{prefix} {name}"
        if isinstance(command, click.Group):
            rows += _rows(path, command, click.Context(command, parent=ctx, info_name=name))
        else:
            rows.append((_usage(path, command), _summary(command)))
    return rows


def commands_table() -> str:
    """The markdown table: one row per (sub)command, every option it takes, its help's first paragraph."""
    ctx = click.Context(main, info_name="trtpaged")
    lines = ["| command | what it does |", "|---|---|"]
    lines += [f"| {usage} | {summary} |" for usage, summary in _rows("trtpaged", main, ctx)]
    return "\n".join(lines)


if __name__ == "__main__":
    print(START)
    print(commands_table())
    print(END)

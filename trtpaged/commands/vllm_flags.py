"""`vllm serve` flags that launch scripts pass and that have nothing to set here: accepted (hidden from --help),
and each named at start-up with the reason it changes nothing, so that a script written for vLLM starts this
server unchanged instead of failing on "No such option". A flag that would change answers or memory is not among
them: those are refused, or have a real counterpart (--max-model-len, --max-num-seqs, ...)."""

from __future__ import annotations

from typing import Any, Callable, Mapping

import click

# flag -> (whether it takes a value, why it changes nothing here)
NO_EFFECT: dict[str, tuple[bool, str]] = {
    "--trust-remote-code": (False, "an engine dir runs no model code of its own"),
    "--disable-log-requests": (False, "the server logs one line per finished request, without its text"),
    "--enable-log-requests": (False, "the server logs one line per finished request (--request-log: a file)"),
    "--max-log-len": (True, "the log holds no prompt text"),
    "--disable-log-stats": (False, "the engine's statistics are on /metrics, not in the log"),
    "--enforce-eager": (False, "no CUDA graphs are captured"),
    "--disable-uvicorn-access-log": (False, "the server writes no access log"),
    "--disable-fastapi-docs": (False, "the server serves no documentation pages"),
    "--enable-chunked-prefill": (False, "long prompts are always prefilled in chunks of --max-num-batched-tokens"),
    "--enable-request-id-headers": (False, "every answer carries X-Request-Id"),
    "--disable-frontend-multiprocessing": (False, "the HTTP front end and the engine share one process"),
    "--download-dir": (True, "the engine dir is local: nothing is downloaded"),
    "--load-format": (True, "an engine dir has one format"),
    "--no-enable-chunked-prefill": (False, "long prompts are prefilled in chunks of --max-num-batched-tokens; the "
                                           "answers are the same"),
    "--disable-custom-all-reduce": (False, "tensor-parallel ranks all-reduce through the collectives library's own"),
    "--async-scheduling": (False, "the scheduler runs on the engine thread between steps"),
    "--use-v2-block-manager": (False, "the KV cache is paged already"),
    "--enable-server-load-tracking": (False, "the load is on /metrics (vllm:num_requests_running, _waiting)"),
    "--enable-log-outputs": (False, "the log holds no output text"),
    "--uvicorn-log-level": (True, "the server writes no access log; its own lines are at INFO"),
    "--disable-access-log-for-endpoints": (True, "the server writes no access log"),
    "--distributed-executor-backend": (True, "tensor-parallel ranks are this machine's processes"),
    "--max-parallel-loading-workers": (True, "an engine dir loads in one pass"),
    "--max-seq-len-to-capture": (True, "no CUDA graphs are captured"),
    "--max-num-partial-prefills": (True, "prompt chunks are scheduled within --max-num-batched-tokens"),
    "--otlp-traces-endpoint": (True, "no traces are exported (the request log and /metrics time each request)"),
}

# vLLM flags that this server takes with one value only, the one that is its own behaviour: flag -> (the values
# accepted, lower case; what this server does instead). Any other value is refused before the model loads.
ONLY_VALUES: dict[str, tuple[tuple[str, ...], str]] = {
    "--pipeline-parallel-size": (("1",), "layers are not split into pipeline stages; --tensor-parallel-size splits "
                                         "each layer over ranks"),
    "--data-parallel-size": (("1",), "one engine per server; run replicas behind a router"),
    "--cpu-offload-gb": (("0",), "weights are not offloaded to host memory"),
    "--tokenizer-mode": (("auto", "hf"), "the engine dir's tokenizer is loaded by transformers"),
    "--guided-decoding-backend": (("auto", "xgrammar"), "structured outputs are compiled by xgrammar"),
    "--response-role": (("assistant",), "a chat answer's message is the assistant's"),
}


# vLLM's flags of several values (argparse's nargs="+"): `--served-model-name a b`, `--api-key k1 k2`
NARGS_FLAGS = ("--served-model-name", "--api-key")


class VllmArgsCommand(click.Command):
    """A command that reads NARGS_FLAGS as vLLM's argparse does: after the positional argument, the words that
    follow such a flag up to the next option are its values (`--api-key k1 k2` is `--api-key k1 --api-key k2`).
    Before the positional argument a flag takes one word, so that the positional argument is never taken."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        valued = {opt for p in self.params if isinstance(p, click.Option) and not p.is_flag and not p.count
                  for opt in (*p.opts, *p.secondary_opts)}  # fmt: skip
        return super().parse_args(ctx, spread_nargs(args, valued))


def spread_nargs(args: list[str], valued: set[str]) -> list[str]:
    """`args` with each NARGS_FLAGS run of several words after the positional argument as one flag per word;
    `valued`: the options that take a value (the word after them is not a positional argument)."""
    out: list[str] = []
    positional_seen, i = False, 0
    while i < len(args):
        word = args[i]
        if word == "--":
            out += args[i:]
            break
        if word in NARGS_FLAGS and i + 1 < len(args):
            out += [word, args[i + 1]]
            i += 2
            while positional_seen and i < len(args) and not args[i].startswith("-"):
                out += [word, args[i]]
                i += 1
            continue
        out.append(word)
        if word in valued and i + 1 < len(args):
            out.append(args[i + 1])
            i += 2
            continue
        positional_seen = positional_seen or not word.startswith("-")
        i += 1
    return out


def _param(flag: str) -> str:
    return "vllm_" + flag.lstrip("-").replace("-", "_")


def _only(flag: str, values: tuple[str, ...], instead: str) -> Callable[..., Any]:
    def check(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
        if value is not None and value.strip().lower() not in values:
            raise click.BadParameter(f"only {' or '.join(values)} here ({instead}), got {value[:40]!r}", ctx, param)
        return value

    return click.option(flag, _param(flag), default=None, hidden=True, callback=check)


def vllm_no_effect_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """Adds the NO_EFFECT flags to a click command as hidden options (keyword arguments named vllm_<flag>), and the
    ONLY_VALUES flags, which check their value."""
    for flag, (values, instead) in reversed(ONLY_VALUES.items()):
        command = _only(flag, values, instead)(command)
    for flag, (takes_value, _) in reversed(NO_EFFECT.items()):
        if takes_value:
            command = click.option(flag, _param(flag), default=None, hidden=True)(command)
        else:
            command = click.option(flag, _param(flag), is_flag=True, default=False, hidden=True)(command)
    return command


def no_effect_note(given: Mapping[str, Any]) -> str:
    """One line naming the NO_EFFECT flags that were given (`given`: the command's vllm_* arguments) and why each
    changes nothing; "" when none was."""
    used = [f"{flag} ({why})" for flag, (takes_value, why) in NO_EFFECT.items()
            if given.get(_param(flag)) not in (None, False)]  # fmt: skip
    used += [f"{flag} {given[_param(flag)]} ({instead})" for flag, (_, instead) in ONLY_VALUES.items()
             if given.get(_param(flag)) is not None]  # fmt: skip
    return f"trtpaged serve: vLLM flags without an effect here: {'; '.join(used)}" if used else ""

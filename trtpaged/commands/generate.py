"""`trtpaged generate ENGINE --prompt TEXT`: stream one completion to the terminal."""

from __future__ import annotations

import sys

import click

from trtpaged.commands.option_types import flag_error
from trtpaged.commands.stdout import echo
from trtpaged.manifest import BACKENDS

# the request and LLM fields this command's flags set: their errors name the flag the user typed
FLAGS = {"prompt": "--prompt", "messages": "--prompt", "max_tokens": "--max-tokens", "temperature": "--temperature",
         "top_p": "--top-p", "seed": "--seed", "n": "--n", "beam_width": "--beam-width", "backend": "--backend",
         "device": "--device", "speculative_config": "--speculative-config"}  # fmt: skip
MENTIONED = ("max_tokens", "top_p", "beam_width")  # in other fields' errors ("n: at most beam_width (2) ...")

# Figures `--stats` prints: the run's peaks and totals, then the pool as the run left it.
_RUN_STATS = (
    "kv_blocks_used_peak", "kv_blocks_saved_by_sharing_peak", "num_steps", "num_tokens_computed",
    "num_block_copies", "num_preemptions", "prefix_cache_hits_tokens", "kv_blocks_total", "kv_blocks_cached",
)  # fmt: skip


@click.command(name="generate")
@click.argument("engine", type=click.Path(exists=True))
@click.option("--prompt", required=True, help="The prompt text.")
@click.option("--chat", is_flag=True, help="Wrap the prompt as a user turn with the engine's chat template.")
@click.option("--max-tokens", type=int, default=128, show_default=True,
              help="At most this many new tokens; prompt + max tokens must fit in max_seq_len.")
@click.option("--temperature", type=float, default=0.0, show_default=True, help="0 is greedy.")
@click.option("--top-p", type=float, default=1.0, show_default=True)
@click.option("--seed", type=int, default=None, help="Seed of the request's own RNG (reproducible samples).")
@click.option("--n", "n", type=int, default=None,
              help="Parallel samples (they share the prompt's KV); with --beam-width, the best beams shown (default: "
                   "1 sample, every beam).")
@click.option("--beam-width", type=int, default=1, show_default=True, help="Beam search when > 1.")
@click.option("--backend", type=click.Choice(BACKENDS), default="auto", show_default=True)
@click.option("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when present).")
@click.option("--speculative-config", default=None, metavar="JSON",
              help='Speculative decoding, a JSON object, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\' '
                   "(docs/speculative.md).")
@click.option("--stats", "show_stats", is_flag=True,
              help="Print the run's KV-cache figures (peaks, sharing) at the end.")
def command(engine, prompt, chat, max_tokens, temperature, top_p, seed, n, beam_width, backend, device,
            speculative_config, show_stats) -> None:  # fmt: skip
    """Generate a completion for one prompt, streaming text as it is decoded."""
    if sys.stdout is None:  # started with stdout closed (>&-): the completion would be lost without a word
        raise click.ClickException("stdout is closed: nowhere to write the completion")
    from trtpaged.runtime.llm import LLM
    from trtpaged.runtime.outputs import RequestOutputKind
    from trtpaged.runtime.sampling_params import SamplingParams

    if n is None:
        n = beam_width if beam_width > 1 else 1
    streaming = n == 1 and beam_width == 1
    kind = RequestOutputKind.DELTA if streaming else RequestOutputKind.FINAL_ONLY
    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed, n=n,
                                beam_width=beam_width, output_kind=kind)  # fmt: skip
        llm = LLM(engine, backend=backend, device=device, speculative_config=speculative_config)
        request = llm.chat_prompt([{"role": "user", "content": prompt}]) if chat else prompt
        loop = llm.engine
        request_id = loop.add_request(request, params)
    except (ValueError, FileNotFoundError) as e:
        raise click.ClickException(flag_error(str(e), FLAGS, MENTIONED)) from None
    if params.n > 1 and params.greedy and not params.use_beam_search:
        click.echo(f"note: --n {params.n} at --temperature {temperature:g} (greedy): the samples are one answer "
                   "repeated; give a --temperature above 0 to sample", err=True)  # fmt: skip
    final = None
    while loop.has_unfinished():
        for out in loop.step():
            if out.request_id != request_id:
                continue
            if streaming:
                for delta in out.outputs:
                    _write(delta.text, nl=False)
            if out.finished:
                final = out
    if streaming:
        _write("")
    if final is not None and final.error is not None:
        raise click.ClickException(f"the request failed: {final.error}")
    if not streaming and final is not None:
        for completion in final.outputs:
            _write(f"--- [{completion.index}] ({completion.finish_reason})")
            _write(completion.text)
    if show_stats:
        stats = llm.stats()
        click.echo(f"execution_plan: {llm.execution_plan}", err=True)
        for key in _RUN_STATS + tuple(k for k in stats if k.startswith("spec_decode_")):
            click.echo(f"{key}: {stats[key]}", err=True)


def _write(text: str, nl: bool = True) -> None:
    """The completion to stdout; a stdout that cannot take it (a full disk, a closed pipe) is one error line."""
    echo(text, nl=nl, what="the completion")

"""`trtpaged generate ENGINE --prompt TEXT`: stream one completion to the terminal."""

from __future__ import annotations

import click


@click.command(name="generate")
@click.argument("engine", type=click.Path(exists=True))
@click.option("--prompt", required=True, help="The prompt text.")
@click.option("--chat", is_flag=True, help="Wrap the prompt as a user turn with the engine's chat template.")
@click.option("--max-tokens", type=int, default=128, show_default=True)
@click.option("--temperature", type=float, default=0.0, show_default=True, help="0 is greedy.")
@click.option("--top-p", type=float, default=1.0, show_default=True)
@click.option("--seed", type=int, default=None)
@click.option("--n", "n", type=int, default=1, show_default=True, help="Parallel samples (they share the prompt's KV).")
@click.option("--beam-width", type=int, default=1, show_default=True, help="Beam search when > 1.")
@click.option("--backend", type=click.Choice(["auto", "torch", "tensorrt"]), default="auto", show_default=True)
@click.option("--device", default=None, help="cpu or cuda (default: cuda when present).")
@click.option("--stats", "show_stats", is_flag=True, help="Print KV-cache statistics at the end.")
def command(engine, prompt, chat, max_tokens, temperature, top_p, seed, n, beam_width, backend, device, show_stats) -> None:
    """Generate a completion for one prompt, streaming text as it is decoded."""
    from trtpaged.runtime.llm import LLM
    from trtpaged.runtime.sampling_params import SamplingParams

    try:
        params = SamplingParams(
            max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed, n=n, beam_width=beam_width
        )
        llm = LLM(engine, backend=backend, device=device)
        request = llm.chat_prompt([{"role": "user", "content": prompt}]) if chat else prompt
        engine_ = llm.engine
        request_id = engine_.add_request(request, params)
    except (ValueError, FileNotFoundError) as e:
        raise click.ClickException(str(e)) from None
    streaming = n == 1 and beam_width == 1
    printed = 0
    final = None
    while engine_.has_unfinished():
        for out in engine_.step():
            if out.request_id != request_id:
                continue
            if streaming:
                text = out.outputs[0].text
                click.echo(text[printed:], nl=False)
                printed = len(text)
            if out.finished:
                final = out
    if streaming:
        click.echo()
    elif final is not None:
        for completion in final.outputs:
            click.echo(f"--- [{completion.index}] ({completion.finish_reason})")
            click.echo(completion.text)
    if show_stats:
        for key, value in llm.stats().items():
            click.echo(f"{key}: {value}", err=True)

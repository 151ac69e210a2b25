"""`trtpaged inspect ENGINE_DIR`: the manifest and the KV memory plan."""

from __future__ import annotations

from pathlib import Path

import click

from trtpaged.commands.option_types import Size, flag_error
from trtpaged.commands.stdout import echo

MAX_SEQ_LEN = 1 << 24  # trtpaged.config.MAX_SEQ_LEN, a model.yaml's bound (not imported: `inspect --help` stays fast)


@click.command(name="inspect")
@click.argument("engine_dir", type=click.Path(exists=True, path_type=Path))
@click.option("--avg-len", type=click.IntRange(1, MAX_SEQ_LEN), default=None,
              help="Also show how many sequences of this average length (prompt + output; at most max_seq_len) fit.")
@click.option("--memory", "memory", type=Size(), default=None,
              help="Free device memory to evaluate a `fraction` KV budget with, e.g. 24GiB (1 byte to 1 PiB).")
@click.option("--json", "as_json", is_flag=True, help="Print the manifest (trtpaged.json's fields) as JSON instead.")
@click.option("--verify", "full_verify", is_flag=True,
              help="Hash every file against the manifest even if this dir was verified before.")
@click.option("--draft", "draft_dir", default=None, type=click.Path(path_type=Path),
              help="Also check DIR as a speculative draft engine for this one (speculative_config method "
                   "draft_model: the same tokenizer, max_seq_len; docs/speculative.md) and show its KV pool.")
@click.option("--plan", "show_plan", is_flag=True,
              help="Also load the weights on this machine's CPU and print the execution plan the torch runner "
                   "would run (c_layers / fused / torch, and why; docs/architecture.md).")
def command(engine_dir: Path, avg_len: int | None, memory: int | None, as_json: bool, full_verify: bool,
            draft_dir: Path | None, show_plan: bool) -> None:  # fmt: skip
    """Print ENGINE_DIR's manifest and memory plan (bytes per token, blocks, concurrent sequences).

    The dir is checked as a load checks it (paths, sizes, safetensors headers, weight shapes against
    the dims, NaN/inf weights, the tokenizer, sha256 of every file unless verified before and
    unchanged); a broken dir exits 1.
    """
    import time

    from trtpaged.memory_plan import format_bytes, plan_memory
    from trtpaged.engine_files import held_weight_bytes, verify_engine_dir
    from trtpaged.manifest import read_manifest
    from trtpaged.models.loading import checked_weights
    from trtpaged.runtime.llm import load_tokenizer

    if engine_dir.is_file():  # a file of the engine dir (its trtpaged.json, engine.plan), as LLM(...) takes it
        engine_dir = engine_dir.parent
    try:
        manifest = read_manifest(engine_dir)
        _check_avg_len(avg_len, manifest)  # before the files are hashed (seconds for a large engine)
        if memory is not None and manifest.kv_cache.fraction is None:
            click.echo("--memory: not used: this engine's KV budget does not depend on free memory (it is "
                       f"{_budget(manifest)}; only a `fraction` budget does)", err=True)  # fmt: skip
        start = time.perf_counter()
        verified = verify_engine_dir(engine_dir, manifest, full=full_verify)
        seconds = time.perf_counter() - start
        for rank in range(manifest.tensor_parallel):
            checked_weights(engine_dir, manifest, rank)
        tokenizer = load_tokenizer(engine_dir, manifest)
        plan = plan_memory(manifest, memory)
        draft_plan = None
        if draft_dir is not None:
            from trtpaged.runtime.draft import check_draft
            from trtpaged.runtime.speculative import estimate_draft_token_cost

            draft_manifest = check_draft(str(draft_dir), manifest, tokenizer, manifest.limits.max_seq_len)
            draft_plan = plan_memory(draft_manifest, memory)
            draft_cost = estimate_draft_token_cost(held_weight_bytes(Path(draft_dir), draft_manifest),
                                                   held_weight_bytes(engine_dir, manifest))  # fmt: skip
    except (OSError, ValueError) as e:  # the draft's checks name speculative_config.model, which --draft sets here
        raise click.ClickException(flag_error(str(e), {"speculative_config.model": "--draft"})) from None
    if as_json:
        echo(manifest.to_json())
        return
    weight_bytes = held_weight_bytes(engine_dir, manifest)
    for line in _manifest_lines(manifest, weight_bytes):
        echo(line)
    if manifest.quantization:
        echo(f"  weights on a CUDA GPU (torch backend, still quantized): "
             f"{format_bytes(_cuda_weight_bytes(engine_dir, manifest))}")
    how = ("sha256 of every file" if verified.method == "sha256" else
           "unchanged since verified (stamp; --verify hashes again)")
    echo(f"verified: {verified.files} files, {format_bytes(verified.bytes)}: {how} ({seconds:.2f}s)")
    echo("memory plan:")
    for line in plan.lines(avg_len):
        echo(f"  {line}")
    if plan.num_kv_blocks is not None:
        echo(f"  weights + KV budget:  {format_bytes(weight_bytes + plan.num_kv_blocks * plan.bytes_per_block)}")
    from trtpaged.runtime.verify_cost import default_verify_row_cost

    echo(f"speculation: a verified draft token adds about {default_verify_row_cost(manifest.quantization):.2f} "
         "of a one-row step here (the default verify_row_cost for this engine's arithmetic)")
    if draft_plan is not None:
        echo(f"speculative draft {draft_dir}: compatible (same tokenizer, max_seq_len covers this engine's); "
             f"a draft step costs about {draft_cost:.2f} of a one-row step here (weight bytes: the default "
             "draft_token_cost); its own KV pool:")
        for line in draft_plan.lines(avg_len):
            echo(f"  {line}")
    if show_plan:
        echo(f"execution plan on this machine's CPU: {_execution_plan(engine_dir, manifest)}")


def _check_avg_len(avg_len: int | None, manifest) -> None:
    """Refuses an --avg-len no sequence of this engine reaches (prompt + output is at most max_seq_len): the plan
    printed 0 sequences of 10**29 tokens and went on."""
    limit = manifest.limits.max_seq_len
    if avg_len is not None and avg_len > limit:
        raise click.BadParameter(f"{avg_len} is more than the engine's max_seq_len {limit}, the longest a sequence "
                                 f"(prompt + output) can be; at most {limit}", param_hint="'--avg-len'")


def _budget(manifest) -> str:
    kv = manifest.kv_cache
    return f"num_kv_blocks {kv.num_kv_blocks}" if kv.num_kv_blocks is not None else f"memory {kv.memory_bytes} bytes"


def _execution_plan(engine_dir: Path, manifest) -> str:
    """The plan `TorchRunner` decides for this engine on this machine's CPU, from its loaded weights."""
    if "torch" not in manifest.backends:
        return f"none: the engine has no torch backend ({', '.join(manifest.backends)})"
    if manifest.tensor_parallel > 1:
        return "fused or torch: each tensor-parallel rank decides at load (c_layers would skip its all-reduces)"
    from trtpaged.models import load_step_model
    from trtpaged.models.execution_plan import decide_execution_plan

    try:
        model, _ = load_step_model(engine_dir, device="cpu")
        return str(decide_execution_plan(model))
    except (OSError, ValueError, RuntimeError) as e:
        raise click.ClickException(f"--plan: {e}") from None


def _cuda_weight_bytes(engine_dir: Path, manifest) -> int:
    """Rank 0's weight bytes as the torch backend holds them on a CUDA device (models/qlinear_cuda.py)."""
    from trtpaged.engine_files import read_safetensors_header
    from trtpaged.models.loading import quant_plan
    from trtpaged.models.qlinear_cuda import cuda_weight_bytes

    header = read_safetensors_header(engine_dir / manifest.rank_files(0)["weights_file"])
    return cuda_weight_bytes(header, quant_plan(engine_dir, manifest))


def _weights_line(m, weight_bytes: int) -> str:
    from trtpaged.memory_plan import format_bytes

    q = m.quantization
    if not q:
        return f"  weights: {m.dtype}, {format_bytes(weight_bytes)}"
    group = q.get("group_size") or "per channel"
    origin = ", ".join(f"{n} {what}" for what, n in sorted(q.get("origin", {}).items()))
    head = "int8" if q.get("lm_head") == "int8" else m.dtype
    return (f"  weights: {q['weights']} (group {group}; embedding/LM head {head}; "
            f"{q.get('activations', 'int8')} activations), {format_bytes(weight_bytes)}"
            f"{'; ' + origin if origin else ''}")


def _manifest_lines(m, weight_bytes: int) -> list[str]:
    d, lim = m.dims, m.limits
    verify = m.verification
    checked = ("skipped" if verify.get("skipped") else
               f"max abs diff {verify['max_abs_diff']:.3g} (tolerance {verify['tolerance']:.3g})" if verify else "none")
    source = m.source.get("package") or m.source.get("path") or m.source.get("kind")
    lines = [
        f"engine format {m.format_version}: {d.architecture} from {source}",
        f"  layers {d.num_layers}, hidden {d.hidden_size}, intermediate {d.intermediate_size}, "
        f"heads {d.num_heads} (kv {d.num_kv_heads}) x {d.head_dim}, vocab {d.vocab_size}",
        f"  rope theta {d.rope_theta:g}{', scaling ' + str(d.rope_scaling) if d.rope_scaling else ''}, "
        f"tied embeddings {d.tie_word_embeddings}, qkv bias {d.attention_bias}",
        f"  dtype {m.dtype}, kv_cache_dtype {m.kv_cache_dtype}",
        *([f"  tensor_parallel {m.tensor_parallel}: per rank {d.num_heads // m.tensor_parallel} heads "
           f"(kv {d.num_kv_heads // m.tensor_parallel}), intermediate {d.intermediate_size // m.tensor_parallel}; "
           f"shards {', '.join(s['weights_file'] for s in m.shards)}"] if m.tensor_parallel > 1 else []),
        _weights_line(m, weight_bytes),
        f"  limits: max_batch_size {lim.max_batch_size}, max_num_tokens {lim.max_num_tokens}, "
        f"max_seq_len {lim.max_seq_len}, block_size {lim.block_size}",
        f"  backends: {', '.join(m.backends) or 'none'}; verification: {checked}",
        f"  tokenizer: {m.tokenizer_dir}/ (bos {m.bos_token_id}, eos {m.eos_token_ids}, "
        f"chat template {'yes' if m.chat_template else 'no'})",
        *([f"  sampling_defaults (the model's generation config): "
           f"{', '.join(f'{k} {v}' for k, v in sorted(m.sampling_defaults.items()))}"] if m.sampling_defaults else []),
        "  files:",
    ]
    for key, describe in (("accuracy", _accuracy_line), ("kv_cache", _kv_cache_line)):
        if verify.get(key):
            try:
                lines.insert(-2, describe(verify[key]))
            except (KeyError, TypeError, ValueError, AttributeError):  # informational: a hand edit is not fatal
                lines.insert(-2, f"  verification.{key}: present, not in the form a build writes (not shown)")
    lines += [f"    {name:<34} {sha[:12]}" for name, sha in sorted(m.files.items())]
    return lines


def _accuracy_line(accuracy: dict) -> str:
    fp, q8 = accuracy["full_precision_activations"], accuracy["torch_backend"]
    return (f"  accuracy vs unquantized ({accuracy['prompts']} prompts, {fp['positions']} positions): top-1 "
            f"{fp['agreement']:.1%} (float activations) / {q8['agreement']:.1%} (torch backend, "
            f"{q8['activations']} activations), max |dlogit| {fp['max_abs_diff']:.3g} / {q8['max_abs_diff']:.3g}")


def _kv_cache_line(kv: dict) -> str:
    greedy = ", ".join(f"{p['greedy_prefix']}/{p['new_tokens']}" for p in kv["prompts"])
    lengths = ", ".join(str(p["prompt_tokens"]) for p in kv["prompts"])
    return (f"  KV cache {kv['kv_cache_dtype']} vs float32 cache: max |dlogit| {kv['max_abs_diff']:.3g}, "
            f"teacher-forced top-1 {kv['top1_agreement']:.1%} (tolerance {kv['threshold']:.0%}); "
            f"greedy identical for {greedy} tokens (prompts of {lengths} tokens)")

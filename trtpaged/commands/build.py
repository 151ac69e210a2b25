"""`trtpaged build model.yaml`: compile a model.yaml into an engine dir."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click

from trtpaged.config import MODEL_YAML_SCHEMA
from trtpaged.models.dims import SUPPORTED_ARCHITECTURES

_HELP = """Build an engine dir from MODEL_YAML.

\b
model.yaml keys (examples in examples/; unknown keys are errors; paths are relative to the yaml):
""" + MODEL_YAML_SCHEMA + """\
Supported: """ + ", ".join(SUPPORTED_ARCHITECTURES) + """ (docs/families.md).
Nothing is ever downloaded. kv_cache.num_kv_blocks is at most 2^31-1, and a fixed KV
budget beyond the memory of this machine's largest device is refused.
YAML aliases (*name), nesting deeper than 16 levels and files over 1 MiB are
refused.

\b
Stages: check, load, patch (trtpaged's step model), export (model.onnx +
weights.safetensors), verify, compile (engine.plan; skipped without TensorRT),
write (tokenizer/, trtpaged.json). The engine dir appears atomically: a
failed or interrupted build (Ctrl-C, SIGTERM) leaves nothing behind, and a
killed build's temp dir is removed by the next build into the same parent.
An existing engine dir is replaced only with --force. Long stages print a
line with the elapsed time every 10 s.

\b
Verification runs model.onnx on the CPU (onnx.reference, the paged-attention
node in numpy) over two chained packed steps (two prefills; then a decode, a
continuing chunk and a new prefill) and compares every token's logits with the
transformers forward. It fails when max |diff| > atol + rtol * max |logit|,
(atol, rtol) = float32 (1e-3, 2e-3), float16 (5e-2, 1e-2), bfloat16 (0.2, 3e-2), by
dtype or by a less precise 16-bit kv_cache_dtype. NaN or inf logits fail it
(and the accuracy stages) whatever the difference; NaN or inf weights, or a
checkpoint missing tensors of the architecture, fail the load stage.
"""


def _output(value: str | None, param) -> Path | None:
    """-o as a Path; an empty one (Path("") is the current directory) is refused."""
    if value is not None and not value.strip():
        raise click.BadParameter("must not be empty (a directory path)", param=param)
    return Path(value) if value is not None else None


def _model_yaml(value: Path, param: click.Parameter) -> Path:
    """MODEL_YAML; a directory (a TensorRT-LLM habit: `--checkpoint_dir DIR`) is refused with the yaml that
    builds it."""
    if value.is_dir():
        hint = f"model: {{hf_dir: {value}}}" if (value / "config.json").is_file() else "model: {hf_dir: DIR}"
        raise click.BadParameter(f"{str(value)!r} is a directory; build takes a model.yaml, e.g. one holding "
                                 f"`{hint}` (examples/*.yaml show the rest)", param=param)  # fmt: skip
    return value


@click.command(name="build", help=_HELP)
@click.argument("model_yaml", type=click.Path(path_type=Path), callback=lambda ctx, p, v: _model_yaml(v, p))
@click.option("-o", "--output", type=click.Path(file_okay=False), default=None,
              callback=lambda ctx, p, v: _output(v, p),
              help="Engine dir to write (default: `output` in the yaml).")
@click.option("--skip-verify", is_flag=True, help="Skip the ONNX-vs-transformers verification (big models).")
@click.option("--force", is_flag=True,
              help="Replace an existing engine dir at the output (once the new one is complete).")
def command(model_yaml: Path, output: Path | None, skip_verify: bool, force: bool) -> None:
    from trtpaged.builder import BuildError, build_engine
    from trtpaged.builder.export import ExportError
    from trtpaged.builder.interrupts import signals_interrupt_the_build
    from trtpaged.builder.verify import VerificationError
    from trtpaged.config import ConfigError, load_config

    try:
        with signals_interrupt_the_build():  # Ctrl-C and SIGTERM stop the build: the temp dir is removed
            config = load_config(model_yaml)
            build_engine(config, output, skip_verify=skip_verify, force=force, echo=click.echo)
    except (ConfigError, BuildError, ExportError, VerificationError) as e:
        raise click.ClickException(str(e)) from None
    except OSError as e:  # the disk filled up, a directory vanished: the temp dir is already gone
        raise click.ClickException(f"build failed writing {e.filename or 'the engine dir'}: "
                                   f"{e.strerror or e}") from None
    except KeyboardInterrupt:
        click.echo("build interrupted; nothing was written", err=True)
        # os._exit, not sys.exit: an interrupt that lands inside a nested interpreter run (a module being imported
        # runs code through one) leaves CPython flagged "unhandled KeyboardInterrupt", and a normal exit then kills
        # the process with SIGINT (status -2) instead of 130. The temp dir is already removed.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(130)

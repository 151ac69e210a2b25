"""`trtpaged build model.yaml`: compile a model.yaml into an engine dir."""

from __future__ import annotations

import sys
from pathlib import Path

import click

_HELP = """Build an engine dir from MODEL_YAML.

\b
model.yaml keys (examples in examples/; unknown keys are errors):
  model           exactly one of:
                    {hf_dir: PATH}      local HF dir (config.json + safetensors + tokenizer)
                    {gguf: FILE}        a GGUF file (config, weights, tokenizer from it)
                    {package: NAME}     an installed package shipping a GGUF (+ file: NAME.gguf)
                    {tiny: {...}}       random weights from inline LlamaConfig fields (tests)
                  Supported: LlamaForCausalLM (Llama, SmolLM2), MistralForCausalLM,
                  Qwen2ForCausalLM. Nothing is ever downloaded.
  dtype           float32 | float16 | bfloat16 (default float32; without a CUDA GPU
                  the build is forced to float32 with a warning)
  kv_cache_dtype  auto (= dtype) | float32 | float16 | bfloat16 | int8 | fp8_e4m3
                  (int8/fp8_e4m3: 1-byte codes + fp16 scale per token and head, torch
                  backend only; the build measures them against a float32 cache)
  max_batch_size  sequences per step (default 8)
  max_num_tokens  packed tokens per step, >= max_batch_size (default 512)
  max_seq_len     prompt + generated tokens per sequence (default 2048; 16 to 2^24)
  block_size      tokens per KV block: 8, 16, 32, 64, 128 (default 16)
  kv_cache        KV budget, one of {num_blocks: N}, {memory: "2GiB"},
                  {fraction: 0.9} of free device memory at serve time (default);
                  num_blocks up to 2^31-1, and a fixed budget beyond the memory of
                  this machine's largest device is refused
  backend         auto | tensorrt | torch (default auto: TensorRT where present)
  output          engine dir, relative to the yaml (overridden by -o)
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


@click.command(name="build", help=_HELP)
@click.argument("model_yaml", type=click.Path(dir_okay=False, path_type=Path))
@click.option("-o", "--output", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Engine dir to write (default: `output` in the yaml).")
@click.option("--skip-verify", is_flag=True, help="Skip the ONNX-vs-transformers verification (big models).")
@click.option("--force", is_flag=True, help="Replace an existing engine dir at the output (once the new one is complete).")
def command(model_yaml: Path, output: Path | None, skip_verify: bool, force: bool) -> None:
    from trtpaged.builder import BuildError, build_engine
    from trtpaged.builder.engine_dir import terminate_as_interrupt
    from trtpaged.builder.export import ExportError
    from trtpaged.builder.verify import VerificationError
    from trtpaged.config import ConfigError, load_config

    try:
        with terminate_as_interrupt():  # SIGTERM cleans up as Ctrl-C does: the temp dir is removed
            config = load_config(model_yaml)
            build_engine(config, output, skip_verify=skip_verify, force=force, echo=click.echo)
    except (ConfigError, BuildError, ExportError, VerificationError) as e:
        raise click.ClickException(str(e)) from None
    except OSError as e:  # the disk filled up, a directory vanished: the temp dir is already gone
        raise click.ClickException(f"build failed writing {e.filename or 'the engine dir'}: {e.strerror or e}") from None
    except KeyboardInterrupt:
        click.echo("build interrupted; nothing was written", err=True)
        sys.exit(130)

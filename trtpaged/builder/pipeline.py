"""`build_engine`: model.yaml config -> engine dir, in stages.

    check    validate what is cheap (output path, backend, architecture, GGUF header)
    load     transformers loads config, weights and tokenizer (float32)
    patch    trtpaged's step model built from the HF config and weights
    export   weights.safetensors + model.onnx (external data pointing into the safetensors);
             tensor_parallel N > 1: weights-rankR.safetensors + model-rankR.onnx per rank. A quantized
             model's graph (TensorRT's weight forms, model-tensorrt.safetensors) only where compile runs
             or with tensorrt.graph: always; the pool's form (tensorrt.kv_pool, quantized_pool) is
             applied to the graph after verify (builder/onnx_pool.py)
    verify   the ONNX graph on CPU vs HF's forward over two chained steps (the rank graphs jointly)
    compile  engine.plan with TensorRT (skipped where TensorRT or the plugin is missing)
    write    tokenizer, manifest with sha256 of every file, atomic rename into place
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable, Optional

import torch

from trtpaged import __version__
from trtpaged import tensorrt_env
from trtpaged.builder import compile as trt_compile
from trtpaged.builder import onnx_pool, tensorrt_graph
from trtpaged.builder.engine_dir import OutputDirError, check_output, file_hashes, staged_output, write_manifest
from trtpaged.builder.export import export_onnx, export_other_rank
from trtpaged.builder.accuracy import AccuracyError, graph_accuracy_reason, measure_accuracy, measure_graph_accuracy
from trtpaged.builder.kv_accuracy import measure_kv_accuracy
from trtpaged.builder.progress import Progress
from trtpaged.builder.saved_tokenizer import TokenizerRoundTripError, check_saved_tokenizer
from trtpaged.builder.quantize import check_dims, dequantized_hf_model, quantized_step_model
from trtpaged.builder.verify import unsupported_reason, verify_onnx
from trtpaged.builder.weights import save_weights
from trtpaged.config import BuildConfig, ConfigError
from trtpaged.kernels import KernelError
from trtpaged.kv_formats import QUANTIZED_KV_CACHE_DTYPES
from trtpaged.manifest import Manifest, ModelDims, check_dim_values
from trtpaged.models.dims import trained_max_seq_len
from trtpaged.models.tensor_parallel import check_tensor_parallel
from trtpaged.sampling_defaults import GENERATION_CONFIG_FIELDS, SamplingDefaultError, from_generation_config
from trtpaged.sampling_defaults import check as check_sampling_defaults
from trtpaged.kv_budget import budget_blocks, machine_memory_bytes

WEIGHTS_FILE = "weights.safetensors"
ONNX_FILE = "model.onnx"
PLAN_FILE = tensorrt_env.PLAN_FILE
TOKENIZER_DIR = "tokenizer"


class BuildError(RuntimeError):
    """A build failed; the message says at which stage and why."""


@dataclass(frozen=True)
class BuildResult:
    engine_dir: Path
    manifest: Manifest
    seconds: float


def build_engine(
    config: BuildConfig,
    output: Optional[Path | str] = None,
    *,
    skip_verify: bool = False,
    force: bool = False,
    echo: Callable[[str], None] = print,
) -> BuildResult:
    """Builds the engine dir for `config` at `output` (default: config.output); raises ConfigError or BuildError.

    An existing engine dir at `output` is replaced only with `force`.
    """
    from trtpaged.models import UnsupportedModelError, dims_from_hf_config, load_hf, source_architecture
    from trtpaged.models.loading import TORCH_DTYPES, nonfinite_tensors, step_model_from_hf

    progress = Progress(echo)
    with progress.stage("check") as st:
        config, out_dir = _preflight(config, output, progress, force)
        arch = source_architecture(config.model)
        st.note(f"{arch} from {config.model.kind} -> {out_dir}")
    with staged_output(out_dir, force) as tmp:
        with progress.stage("load") as st:
            try:
                hf = load_hf(config.model, torch.float32)
            except ConfigError:
                raise
            except Exception as e:  # noqa: BLE001  (transformers, gguf and tokenizers raise many types)
                # huggingface_hub's config validation errors wrap the ValueError that says what is wrong
                cause = e.__cause__ if e.__cause__ is not None and not isinstance(e, (OSError, ValueError)) else e
                raise BuildError(f"load: model.{config.model.kind} ({config.model.path or 'tiny'}): "
                                 f"{type(cause).__name__}: {cause}") from e
            broken = nonfinite_tensors(hf.model.state_dict())
            if broken:
                listed = ", ".join(f"{name} ({bad} of {numel})" for name, bad, numel in broken[:3])
                raise BuildError(f"load: model.{config.model.kind} ({config.model.path or 'tiny'}): NaN/inf weights "
                                 f"in {len(broken)} tensors: {listed}{', ...' if len(broken) > 3 else ''}")
            try:
                dims = dims_from_hf_config(hf.config, config.limits.max_seq_len)
            except UnsupportedModelError as e:
                raise ConfigError(f"model.{config.model.kind}: {e}") from None
            # what every reader of the engine dir refuses, refused here (was: built, with --skip-verify)
            check_dim_values(dims, lambda name, message, limit=None: ConfigError(
                f"model.{config.model.kind}: the model's {name.removeprefix('dims.')} {message}", limit=limit))
            _check_special_token_ids(hf, dims, f"model.{config.model.kind}")
            _check_chat_template(hf.tokenizer, f"model.{config.model.kind}")
            sampling_defaults = _sampling_defaults(config.model, f"model.{config.model.kind}")
            tp_blocker = check_tensor_parallel(dims, config.tensor_parallel, _config_plan(config, dims))
            if tp_blocker:
                raise ConfigError(tp_blocker)
            # one rank's pool holds its KV heads only; the KV budget is per rank
            block_bytes = (dims.kv_bytes_per_token(config.kv_cache_dtype) * config.limits.block_size
                           // config.tensor_parallel)
            _check_limits(config, dims, block_bytes)
            params = sum(p.numel() for p in hf.model.parameters())
            st.note(f"{params / 1e6:.1f}M parameters, {dims.num_layers} layers, vocab {dims.vocab_size}")
        with progress.stage("patch") as st:
            dtype = TORCH_DTYPES[config.dtype]
            step_model = step_model_from_hf(hf.model, dims, dtype)
            st.note(f"LlamaStepModel {config.dtype}, {dims.num_heads}/{dims.num_kv_heads} heads x {dims.head_dim}")
        quantized = None
        reference_hf = hf.model
        if config.quantization.enabled:
            with progress.stage("quantize") as st:
                blocker = check_dims(config.quantization, dims)
                if blocker:
                    raise ConfigError(blocker)
                float_bytes = sum(t.numel() * t.element_size() for t in step_model.state_dict().values())
                step_model, quantized = quantized_step_model(hf.model, config.model, dims, config.quantization, dtype)
                reference_hf = dequantized_hf_model(hf.model, dims, quantized)
                tp_blocker = check_tensor_parallel(dims, config.tensor_parallel, quantized.plan)
                if tp_blocker:
                    raise ConfigError(tp_blocker)
                st.note(f"{config.quantization.weights} (group {config.quantization.group_size or 'per channel'}): "
                        f"{quantized.summary()}; weights {quantized.weight_bytes / 2**20:.1f} MiB "
                        f"(float {float_bytes / 2**20:.1f} MiB)")
        # A quantized cache (int8, fp8_e4m3) is int8 bytes in the graph, its format a node attribute; the
        # kv_accuracy stage measures it against the full-precision cache.
        kv_quantized = config.kv_cache_dtype in QUANTIZED_KV_CACHE_DTYPES
        graph_kv_cache_dtype = config.kv_cache_dtype
        shards = shard_files(config.tensor_parallel)
        planned_blocker, warn_blocker = _compile_blocker(config)
        # The TensorRT graph form of the weights (model-tensorrt.safetensors, and an accuracy stage of its
        # own) only where the compile stage will take it, or where the model.yaml asks for it.
        write_graph = planned_blocker is None or config.tensorrt.graph == "always"
        with progress.stage("export") as st:
            plan = quantized.plan if quantized is not None else {}
            graph = (tensorrt_graph.plan_graph(quantized, hf.model, dims, dtype, config.quantization)
                     if quantized is not None and write_graph else None)
            no_graph = quantized is not None and graph is None
            if no_graph:  # the torch backend runs weights.safetensors; the ONNX graph is TensorRT's input only
                shards = [{**files, "onnx_file": None} for files in shards]
            spread = tensorrt_graph.spread_note(graph.state) if graph else None
            for line in [*(graph.notes if graph else ()), *([spread] if spread else [])]:
                progress.echo(f"export   TensorRT graph: {line}")
            for rank, files in enumerate(shards):
                model = rank_step_model(step_model, plan, config.tensor_parallel, rank, config.quantization)
                save_weights(model, tmp / files["weights_file"])
                if graph is not None:  # the graph holds the forms TensorRT takes (builder/tensorrt_graph.py)
                    source = graph.step_model()
                    if len(shards) > 1:
                        source = rank_step_model(source, graph.state.plan, config.tensor_parallel, rank,
                                                 config.quantization)
                    model = tensorrt_graph.to_tensorrt_graph(source)
                if files["onnx_file"] is None:
                    continue
                onnx_path, weights_path = tmp / files["onnx_file"], tmp / files["weights_file"]
                if rank > 0:  # traced once: the other ranks' graphs are rank 0's, rebound to their shards
                    export_other_rank(tmp / shards[0]["onnx_file"], model, rank, onnx_path, weights_path)
                else:
                    export_onnx(model, config.limits.block_size,
                                graph_kv_cache_dtype if kv_quantized else TORCH_DTYPES[graph_kv_cache_dtype],
                                onnx_path, weights_path)
            size = sum((tmp / f["weights_file"]).stat().st_size for f in shards) / 2**20
            reduces = f", {2 * dims.num_layers} all-reduce nodes each" if len(shards) > 1 else ""
            st.note(f"weights {size:.1f} MiB; no ONNX graph: the TensorRT graph of quantized weights is written "
                    f"where the compile stage runs ({planned_blocker}; tensorrt.graph: always writes it)" if no_graph
                    else f"{len(shards)} x {shards[0]['onnx_file']} ({dims.num_layers} paged-attention nodes"
                         f"{reduces}), weights {size:.1f} MiB")
        why_not = ("--skip-verify" if skip_verify else "no ONNX graph (see export)" if no_graph
                   else unsupported_reason(config.dtype, graph_kv_cache_dtype))
        if why_not:
            progress.skip("verify", why_not)
            verification: dict = {"skipped": True, "reason": why_not}
        else:
            with progress.stage("verify") as st:
                graph_reference = graph.reference if graph is not None and graph.notes else reference_hf
                try:
                    result = verify_onnx([tmp / f["onnx_file"] for f in shards], graph_reference, dims.vocab_size,
                                         config.limits.block_size, config.dtype, graph_kv_cache_dtype, step_model)
                except KernelError as e:
                    raise BuildError(f"verify: {e}") from None
                verification = result.as_dict()
                against = "HF with the same de-quantized weights" if reference_hf is not hf.model else "HF"
                if graph_reference is not reference_hf:
                    against = "HF with the TensorRT graph's de-quantized weights"
                if kv_quantized:
                    against = f"the eager step model with a {graph_kv_cache_dtype} cache"
                st.note(f"max abs diff {result.max_abs_diff:.3g} vs {against} (tolerance {result.tolerance:.3g}, "
                        f"{result.rows} logits rows, 2 steps)")
        graph_blocker = None  # why the TensorRT graph's re-quantized weights are too inaccurate to compile
        if quantized is not None and not skip_verify:
            with progress.stage("accuracy") as st:
                scheme = "exact" if reference_hf is hf.model else config.quantization.weights
                try:
                    report = measure_accuracy(hf.model, hf.tokenizer, reference_hf, step_model,
                                              config.limits.block_size, scheme)
                except AccuracyError as e:
                    raise BuildError(str(e)) from None
                except KernelError as e:
                    raise BuildError(f"accuracy: {e}") from None
                verification["accuracy"] = report.as_dict()
                line = report.line()
                if graph is not None and graph.notes:  # the TensorRT graph's re-quantized weights, measured too
                    graph_report = measure_graph_accuracy(hf.model, hf.tokenizer, graph.reference)
                    verification["accuracy"]["tensorrt_graph"] = asdict(graph_report)
                    graph_blocker = graph_accuracy_reason(graph_report, config.quantization.weights)
                    if graph_blocker and config.backend == "tensorrt":
                        raise BuildError(f"accuracy: {graph_blocker}")
                    if graph_blocker and config.backend == "auto" and tensorrt_env.unavailable_reason() is None:
                        # the torch engine (exact layout) is fine; no plan from this graph
                        progress.warn(f"backend auto: no TensorRT engine: {graph_blocker}")
                    g = graph_report
                    line += (f"; TensorRT graph (re-quantized): top-1 {g.agreement:.1%}, away from ties "
                             f"{g.agreement_away_from_ties:.1%}, max |dlogit| {g.max_abs_diff:.3g}")
                st.note(line)
        if kv_quantized and not skip_verify:
            with progress.stage("kv_accuracy") as st:
                try:
                    kv_report = measure_kv_accuracy(step_model, hf.tokenizer, config.kv_cache_dtype,
                                                    config.limits.block_size, config.limits.max_seq_len)
                except AccuracyError as e:
                    raise BuildError(str(e)) from None
                verification["kv_cache"] = kv_report.as_dict()
                st.note(kv_report.line())
        if not no_graph:  # tensorrt.kv_pool / quantized_pool: the pool's form in the graph, after verification
            for files in shards:
                for line in onnx_pool.apply_pool_form(tmp / files["onnx_file"], config.tensorrt.kv_pool,
                                                      config.tensorrt.quantized_pool, dims.num_layers):
                    progress.echo(f"export   {files['onnx_file']}: {line}")
        plan_built = False
        compile_blocker = planned_blocker
        if graph_blocker and not compile_blocker:
            compile_blocker = f"backend auto: {graph_blocker}"
        if warn_blocker:  # backend auto: what TensorRT cannot take is built for torch, with one warning
            progress.warn(f"backend auto: no TensorRT engine: {warn_blocker}")
        if compile_blocker:
            progress.skip("compile", compile_blocker)
        else:
            with progress.stage("compile") as st:
                profile = trt_compile.ShapeProfile.from_limits(config.limits, config.kv_cache, block_bytes)
                try:
                    trt_compile.compile_engine(tmp / ONNX_FILE, tmp / PLAN_FILE, profile, echo=progress.echo,
                                               model=f"{arch} from model.{config.model.kind}")
                    plan_built = True
                except trt_compile.CompileError as e:
                    if config.backend != "auto":
                        raise BuildError(f"compile: {e}") from e
                    for leftover in (tmp / PLAN_FILE, tmp / tensorrt_env.BUILD_INFO_FILE):
                        leftover.unlink(missing_ok=True)
                    progress.warn(f"backend auto: no TensorRT engine, the torch engine only: {e}")
                st.note(f"{PLAN_FILE} {(tmp / PLAN_FILE).stat().st_size / 2**20:.1f} MiB" if plan_built
                        else "no engine.plan (backend auto: torch)")
        with progress.stage("write") as st:
            _save_tokenizer(hf.tokenizer, tmp / TOKENIZER_DIR)
            manifest = _manifest(config, dims, hf, verification, file_hashes(tmp), plan_built,
                                 quantized.describe(config.quantization) if quantized is not None else {}, shards,
                                 {**config.tensorrt.describe(), "graph_written": graph is not None},
                                 sampling_defaults)  # fmt: skip
            write_manifest(tmp, manifest)
            st.note(f"{len(manifest.files) + 1} files, backends: {', '.join(manifest.backends)}")
    total = progress.total()
    echo(f"built {out_dir} in {total:.1f}s")
    return BuildResult(engine_dir=out_dir, manifest=manifest, seconds=total)


def _preflight(
    config: BuildConfig, output: Optional[Path | str], progress: Progress, force: bool
) -> tuple[BuildConfig, Path]:
    out = Path(output).resolve() if output is not None else config.output
    if out is None:
        raise ConfigError("output: not set; give `output:` in the model.yaml or `-o DIR`")
    try:
        check_output(out, force)
    except OutputDirError as e:
        raise ConfigError(str(e)) from None
    kv_quantized = config.kv_cache_dtype in QUANTIZED_KV_CACHE_DTYPES
    kv_reason = trt_compile.kv_cache_dtype_reason(config.kv_cache_dtype) if config.backend == "tensorrt" else None
    if kv_reason:
        raise ConfigError(f"{kv_reason} (or backend: auto)")
    blocker = tensorrt_env.unavailable_reason() if config.backend == "tensorrt" else None
    if blocker:
        raise ConfigError(f"backend: 'tensorrt' cannot be built here: {blocker}; use backend: auto or torch")
    if config.dtype != "float32" and not torch.cuda.is_available():
        # The CPU kernels read 16-bit and quantized caches directly (half the bytes of fp32 or less),
        # so a kv_cache_dtype the model.yaml names is kept; `auto` follows dtype to float32.
        keep_kv = kv_quantized or config.kv_cache_dtype_explicit
        progress.warn(f"dtype {config.dtype}: no CUDA device, building float32 for the CPU"
                      + ("" if keep_kv else " (kv_cache_dtype too)"))
        config = replace(config, dtype="float32", kv_cache_dtype=config.kv_cache_dtype if keep_kv else "float32")
    return config, out


def _compile_blocker(config: BuildConfig) -> tuple[Optional[str], Optional[str]]:
    """(why the compile stage will not run for `config` on this machine, known before the export, or None;
    the reason to warn about: backend auto on a TensorRT machine with what TensorRT cannot take, or None)."""
    if config.backend == "torch":
        return "backend: torch (no engine.plan)", None
    blocker = tensorrt_env.unavailable_reason()
    if blocker:
        return blocker, None
    if config.tensor_parallel > 1:
        return (f"tensor_parallel {config.tensor_parallel}: the rank graphs run on the torch backend "
                "(scripts/gpu_check.sh compiles them with the NCCL all-reduce plugin)"), None
    unsupported = trt_compile.kv_cache_dtype_reason(config.kv_cache_dtype) if config.backend == "auto" else None
    return (f"backend auto: {unsupported}", unsupported) if unsupported else (None, None)


def shard_files(tensor_parallel: int) -> list[dict[str, str]]:
    """Each rank's {"weights_file", "onnx_file"}: the usual names for one rank, rank-numbered for several."""
    if tensor_parallel == 1:
        return [{"weights_file": WEIGHTS_FILE, "onnx_file": ONNX_FILE}]
    return [{"weights_file": f"weights-rank{r}.safetensors", "onnx_file": f"model-rank{r}.onnx"}
            for r in range(tensor_parallel)]


def rank_step_model(step_model, plan: dict, tensor_parallel: int, rank: int, quantization):
    """One rank's step model (its shard of the weights, an all-reduce after the row-parallel layers), for
    export; the model itself for one rank."""
    if tensor_parallel == 1:
        return step_model
    from trtpaged.models.all_reduce import RankReduce
    from trtpaged.models.loading import with_weights
    from trtpaged.models.qlinear import set_activations
    from trtpaged.models.tensor_parallel import shard_dims, shard_plan, shard_state

    dims = step_model.dims
    state = shard_state(step_model.state_dict(), dims, tensor_parallel, rank, plan)
    model = with_weights(shard_dims(dims, tensor_parallel), step_model.dtype, state, "cpu",
                         shard_plan(plan, dims, tensor_parallel), RankReduce(rank, tensor_parallel))
    if plan:
        set_activations(model, quantization.activations)
    return model


def _config_plan(config: BuildConfig, dims: ModelDims) -> dict[str, tuple[int, int]]:
    """The row-parallel modules' (bits, group_size) that `config.quantization` asks for (per channel: all inputs)."""
    q = config.quantization
    if not q.enabled:
        return {}
    return {"layers.0.self_attn.o_proj": (q.bits, q.group_size or dims.num_heads * dims.head_dim),
            "layers.0.mlp.down_proj": (q.bits, q.group_size or dims.intermediate_size)}


def _check_limits(config: BuildConfig, dims: ModelDims, block_bytes: int) -> None:
    limits = config.limits
    trained, made_for = trained_max_seq_len(dims)
    if limits.max_seq_len > trained:
        raise ConfigError(f"max_seq_len: got {limits.max_seq_len}; the model was trained for {made_for}",
                          field="max_seq_len", limit=trained)
    budget = config.kv_cache
    try:
        blocks = budget_blocks(limits, budget, block_bytes)  # the runtime's count; None for a fraction
    except ValueError as exc:
        raise ConfigError(str(exc), field="kv_cache.memory") from exc
    if blocks is None:
        return
    fixed = budget.memory_bytes if budget.memory_bytes is not None else blocks * block_bytes
    machine = machine_memory_bytes()
    if fixed > machine:
        key = "kv_cache.num_kv_blocks" if budget.num_kv_blocks is not None else "kv_cache.memory"
        got = budget.num_kv_blocks if budget.num_kv_blocks is not None else budget.memory_bytes
        raise ConfigError(f"{key}: got {got}: a KV pool of {fixed / 2**30:.3g} GiB ({block_bytes} bytes a block); "
                          f"the most memory a device of this machine has is {machine / 2**30:.3g} GiB",
                          field=key, limit=machine)
    if budget.memory_bytes is not None and blocks < limits.max_blocks_per_seq:
        raise ConfigError(
            f"kv_cache.memory: {budget.memory_bytes} bytes hold {blocks} blocks of {block_bytes} bytes; "
            f"one sequence of max_seq_len {limits.max_seq_len} needs {limits.max_blocks_per_seq}"
        )


def _token_ids(*values) -> list[int]:
    out: list[int] = []
    for v in values:
        for i in v if isinstance(v, (list, tuple)) else [v]:
            if isinstance(i, int) and i not in out:
                out.append(i)
    return out


def _special_token_ids(hf) -> tuple[Optional[int], list[int]]:
    """(bos, eos ids) as the manifest records them: from generation_config.json, config.json and the tokenizer."""
    tok, gen = hf.tokenizer, getattr(hf.model, "generation_config", None)
    eos = _token_ids(getattr(gen, "eos_token_id", None), getattr(hf.config, "eos_token_id", None), tok.eos_token_id)
    bos = tok.bos_token_id if tok.bos_token_id is not None else getattr(hf.config, "bos_token_id", None)
    return bos, eos


def _check_special_token_ids(hf, dims: ModelDims, where: str) -> None:
    """The bos and eos ids inside the vocabulary, as every reader of the manifest requires (was: built, then
    refused at each load)."""
    bos, eos = _special_token_ids(hf)
    for name, token in [("bos_token_id", bos)] + [("eos_token_id", t) for t in eos]:
        if token is not None and not 0 <= token < dims.vocab_size:
            raise ConfigError(f"{where}: the model's {name} {token} is outside its vocabulary (vocab_size "
                              f"{dims.vocab_size}); fix it in config.json, generation_config.json or the tokenizer's "
                              "files")  # fmt: skip


def _check_chat_template(tokenizer, where: str) -> None:
    """The tokenizer's chat templates compile (jinja2 syntax, known filters and tests): was built, and every chat
    request on the engine then failed with jinja2's error. Each is checked by rendering one user message with it,
    which is also what compiles it; an error a template raises on purpose (raise_exception) is not a broken one.
    Named templates (a list in tokenizer_config.json, additional_chat_templates/*.jinja) are transformers' dict,
    from which apply_chat_template picks one by name (tool_use when a request has tools): each is checked."""
    template = getattr(tokenizer, "chat_template", None)
    for name, text in (template if isinstance(template, dict) else {"": template}).items():
        if isinstance(text, str):
            _check_one_chat_template(tokenizer, text, f"{where}: the tokenizer's chat template" +
                                     (f" {name!r}" if name else ""))


def _check_one_chat_template(tokenizer, template: str, what: str) -> None:
    import jinja2

    from trtpaged.deadline import CHAT_TEMPLATE_SECONDS, DeadlineExceeded, run_with_deadline

    try:
        run_with_deadline(lambda: tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                                                add_generation_prompt=True, chat_template=template),
                          CHAT_TEMPLATE_SECONDS)
    except (jinja2.TemplateSyntaxError, jinja2.TemplateAssertionError) as exc:
        raise ConfigError(f"{what} is not a valid template ({str(exc)[:200]}); fix chat_template in "
                          "tokenizer_config.json (or chat_template.jinja, additional_chat_templates/)") from None
    except DeadlineExceeded:
        raise ConfigError(f"{what} ran past {CHAT_TEMPLATE_SECONDS:g} s rendering one user message (a template that "
                          "loops without end)") from None
    except Exception:  # noqa: BLE001 - the template's own refusal of this conversation, or a key it needs
        pass


def _manifest(
    config: BuildConfig, dims: ModelDims, hf, verification: dict, files: dict[str, str], plan_built: bool = False,
    quantization: Optional[dict] = None, shards: Optional[list[dict[str, str]]] = None,
    tensorrt: Optional[dict] = None, sampling_defaults: Optional[dict] = None,
) -> Manifest:
    tok = hf.tokenizer
    bos, eos = _special_token_ids(hf)
    source = config.model.describe()
    source.update({"model_yaml": str(config.source_file) if config.source_file else None,
                   "trtpaged_version": __version__})
    return Manifest(
        dims=dims,
        limits=config.limits,
        kv_cache=config.kv_cache,
        dtype=config.dtype,
        kv_cache_dtype=config.kv_cache_dtype,
        tokenizer_dir=TOKENIZER_DIR,
        bos_token_id=bos,
        eos_token_ids=eos,
        chat_template=tok.chat_template if isinstance(tok.chat_template, str) else None,
        weights_file=shards[0]["weights_file"] if shards else WEIGHTS_FILE,
        onnx_file=shards[0]["onnx_file"] if shards else ONNX_FILE,  # None: no graph (a quantized torch build)
        plan_file=PLAN_FILE if plan_built else None,
        backends=["torch", "tensorrt"] if plan_built else ["torch"],
        files=files,
        source=source,
        verification=verification,
        quantization=quantization or {},
        tensor_parallel=config.tensor_parallel,
        shards=list(shards) if shards and len(shards) > 1 else [],
        tensorrt=tensorrt or {},
        sampling_defaults=sampling_defaults or {},
    )


def _save_tokenizer(tokenizer, out: Path) -> None:
    """tokenizer.save_pretrained, whose Rust writer reports a full disk as a plain Exception ("No space left on
    device (os error 28)"): raised as the OSError it is, so the build fails in one line naming the dir. Then checked
    to encode as `tokenizer` does once reloaded (builder/saved_tokenizer.py)."""
    try:
        tokenizer.save_pretrained(str(out))
    except OSError:
        raise
    except Exception as e:  # noqa: BLE001 - the tokenizers library's own error type for I/O failures
        if "os error" not in str(e):
            raise
        raise OSError(None, f"{str(e).strip()[:200]}", str(out)) from None
    try:
        check_saved_tokenizer(tokenizer, out)
    except TokenizerRoundTripError as e:
        raise BuildError(str(e)) from None


def _sampling_defaults(model, where: str) -> dict:
    """The sampling settings the model's generation_config.json recommends (trtpaged/sampling_defaults.py), read
    from the file as vLLM reads it; none for a model without one (a GGUF, a package, a tiny model: transformers'
    config made from config.json, whose legacy sampling keys vLLM does not take either). Checked before anything is
    written: a value no request could take refuses the build, naming the file's field."""
    path = model.path / "generation_config.json" if model.kind == "hf_dir" else None
    if path is None or not path.is_file():
        return {}
    from transformers import GenerationConfig

    try:
        generation_config = GenerationConfig.from_pretrained(str(model.path), local_files_only=True)
    except Exception as e:  # noqa: BLE001 - transformers raises many types for a bad file
        raise ConfigError(f"{where}: generation_config.json: transformers cannot read it ({type(e).__name__}: "
                          f"{str(e).strip()[:200]})") from None
    values = from_generation_config(generation_config)
    try:
        check_sampling_defaults(values)
    except SamplingDefaultError as e:
        theirs = {ours: name for name, ours in GENERATION_CONFIG_FIELDS.items()}[e.field]
        raise ConfigError(f"{where}: generation_config.json: {theirs}: {e.message}") from None
    return values

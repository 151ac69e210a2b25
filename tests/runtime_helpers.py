"""Shared helpers for the runtime tests: in-memory engines, a random-logits engine, HF references."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import pytest
import torch

from trtpaged.runtime.runners import StepBatch, TorchRunner
from trtpaged.runtime.llm_engine import LLMEngine
from trtpaged.runtime.outputs import RequestOutput
from trtpaged.runtime.runtime_config import RuntimeConfig
from trtpaged.runtime.sampling_params import SamplingParams

REPO = Path(__file__).resolve().parents[1]


def openai_client(url: str, api_key: str = "none") -> Any:
    """The official `openai` client on a test server at `url` (no retries; the test skips without the package)."""
    import pytest

    openai = pytest.importorskip("openai", reason="the openai package is not installed (pip install openai)")
    return openai.OpenAI(base_url=url + "/v1", api_key=api_key, max_retries=0, timeout=60)


def cpu_isas(among: Optional[Sequence[str]] = None) -> list[str]:
    """The CPU kernels' instruction sets this machine runs (kernels.set_cpu_isa accepts them), lowest first, of
    `among` when given (e.g. one per compiled copy: AVX-VNNI runs the AVX2 copies); ["scalar"] without the kernel
    library. The best is restored afterwards."""
    from trtpaged import kernels

    if not kernels.available():
        return ["scalar"]
    names = []
    try:
        for name in kernels.CPU_ISAS:
            if among is not None and name not in among:
                continue
            try:
                kernels.set_cpu_isa(name)
                names.append(name)
            except kernels.KernelError:
                pass
    finally:
        kernels.set_cpu_isa(None)
    return names


def for_each_cpu_isa(check: Callable[[str], None]) -> None:
    """Runs check(isa) with the CPU kernels forced to each of scalar, AVX2 and AVX-512 VNNI that this CPU has;
    the best is restored afterwards, whatever check raised."""
    from trtpaged import kernels

    try:
        for isa in cpu_isas(("scalar", "avx2", "avx512vnni")):
            kernels.set_cpu_isa(isa)
            check(isa)
    finally:
        kernels.set_cpu_isa(None)


class RandomLogitsEngine:
    """A `ModelRunner` without a model: logits depend only on each sequence's last input token.

    Enough to drive the scheduler, forks and beams in property tests.
    """

    backend = "fake"

    def __init__(self, num_kv_blocks: int, vocab: int = 32) -> None:
        self.num_kv_blocks = num_kv_blocks
        self.table = torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(0))
        self.copies: list[tuple[int, int]] = []
        self.batches: list[StepBatch] = []

    def step(self, batch: StepBatch) -> torch.Tensor:
        self.batches.append(batch)
        last = batch.input_ids[batch.logits_index.long()].long() % self.table.shape[0]
        return self.table[last]

    def copy_blocks(self, pairs):
        self.copies += list(pairs)

    def swap_out(self, pairs):
        pass

    def swap_in(self, pairs):
        pass


def runtime_config(num_kv_blocks: int = 64, block_size: int = 16, **kw: Any) -> RuntimeConfig:
    values = dict(max_batch_size=8, max_num_tokens=256, max_seq_len=512)
    values.update(kw)
    return RuntimeConfig(block_size=block_size, num_kv_blocks=num_kv_blocks, **values)


def tiny_hf():
    """The tiny example model (examples/tiny.yaml) as transformers builds it."""
    from trtpaged.config import load_config
    from trtpaged.models import load_hf

    return load_hf(load_config(REPO / "examples" / "tiny.yaml").model)


def hf_from_engine_dir(engine_dir: Path):
    """The transformers model an engine dir was built from (its manifest records the source); see shared_hf."""
    from trtpaged.models import spec_from_manifest
    from trtpaged.manifest import read_manifest

    return shared_hf(spec_from_manifest(read_manifest(engine_dir)))


_FILE_MODELS: dict[tuple, Any] = {}


def shared_hf(spec):
    """load_hf(spec) in float32. A model read from a GGUF file (SmolLM2 takes 15-40 s on 2 cores) is loaded
    once per test session per file version and shared, so callers must not change it; other sources are
    loaded afresh each time."""
    from trtpaged.models import load_hf

    if spec.kind not in ("gguf", "package"):
        return load_hf(spec)
    stat = Path(spec.path).stat()
    key = (str(Path(spec.path).resolve()), stat.st_size, stat.st_mtime_ns)
    if key not in _FILE_MODELS:
        _FILE_MODELS[key] = load_hf(spec)
    return _FILE_MODELS[key]


def step_engine(hf, config: RuntimeConfig) -> TorchRunner:
    """A torch backend over the HF model's weights, without writing an engine dir."""
    from trtpaged.models import dims_from_hf_config, step_model_from_hf

    model = step_model_from_hf(hf.model, dims_from_hf_config(hf.config))
    return TorchRunner(model, model.new_kv_cache(config.num_kv_blocks, config.block_size), config.num_host_blocks)


def run_staggered(
    engine: LLMEngine, requests: Sequence[tuple[Any, SamplingParams]], every: int = 1
) -> list[RequestOutput]:
    """Submits one request every `every` steps while stepping; returns outputs in submission order."""
    ids: list[str] = []
    done: dict[str, RequestOutput] = {}
    pending = list(requests)
    while pending or engine.has_unfinished():
        if pending:
            ids.append(engine.add_request(*pending.pop(0)))
        for _ in range(every if pending else 1):
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
    return [done[i] for i in ids]


def hf_greedy(hf, prompt: Sequence[int], max_new_tokens: int, eos: Optional[int]) -> list[int]:
    """HF generate(do_sample=False), generated tokens up to and including EOS."""
    kwargs = dict(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos, pad_token_id=eos)
    with torch.no_grad():
        out = hf.model.generate(torch.tensor([list(prompt)]),
                                attention_mask=torch.ones(1, len(prompt), dtype=torch.long), **kwargs)
    tokens = out[0, len(prompt) :].tolist()
    return tokens[: tokens.index(eos) + 1] if eos is not None and eos in tokens else tokens


def hf_beams(hf, prompt: Sequence[int], max_new_tokens: int, width: int, eos: Union[int, list[int]],
             **kw: Any) -> list[list[int]]:  # fmt: skip
    """HF beam search: every returned sequence's generated tokens, best first, padding removed. `eos`: one id, or
    several (each ends a beam)."""
    with torch.no_grad():
        out = hf.model.generate(
            torch.tensor([list(prompt)]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new_tokens, do_sample=False, num_beams=width, num_return_sequences=width,
            eos_token_id=eos, pad_token_id=eos if isinstance(eos, int) else eos[0], return_dict_in_generate=True,
            **kw,
        )
    seqs = []
    for row, idx in zip(out.sequences, out.beam_indices):
        length = int((idx >= 0).sum())
        seqs.append(row[len(prompt) : len(prompt) + length].tolist())
    return seqs


def serve_one_completion(engine_dir: Any, prompt: str, max_tokens: int, speculative_config: Any) -> tuple[str, dict]:
    """A real loopback server with `speculative_config`: the official openai client's greedy completion text,
    then the server's trtpaged:spec_decode* and vllm:spec_decode* metrics (name with labels -> value)."""
    import urllib.request

    import pytest

    from trtpaged.server import start_server

    openai = pytest.importorskip("openai", reason="the openai package is not installed (pip install openai)")
    handle = start_server(engine_dir, port=0, device="cpu", speculative_config=speculative_config)
    try:
        client = openai.OpenAI(base_url=handle.url + "/v1", api_key="none", max_retries=0, timeout=60)
        got = client.completions.create(model=handle.model_name, prompt=prompt, max_tokens=max_tokens, temperature=0.0)
        with urllib.request.urlopen(handle.url + "/metrics", timeout=60) as resp:
            metrics = resp.read().decode()
    finally:
        handle.shutdown()
    values = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
              if line.startswith(("trtpaged:spec_decode", "vllm:spec_decode"))}  # fmt: skip
    return got.choices[0].text, values


def slowed_steps(handle: Any, seconds: float) -> Callable[[], None]:
    """Slows every engine step of a running server (`start_server`'s handle) by `seconds`, so that a request lasts
    long enough for what a test does meanwhile (hang up, fill the queue, scrape gauges); returns the call that puts
    the steps back to full speed."""
    import time

    backend = handle.llm.engine.runner
    real_step = backend.step

    def slow_step(batch: Any) -> Any:
        time.sleep(seconds)
        return real_step(batch)

    handle.loop.call(lambda e: setattr(backend, "step", slow_step))
    return lambda: handle.loop.call(lambda e: backend.__dict__.pop("step", None))


@contextlib.contextmanager
def small_tmpfs(path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of `size` (e.g. "16k") mounted at `path` for the block: a real full disk. Skips the test where it
    cannot be mounted (not root, or no permission to mount)."""
    import os
    import subprocess

    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                                           capture_output=True).returncode != 0:  # fmt: skip
        pytest.skip("needs a small tmpfs (mount as root) for a real full disk")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)


@contextlib.contextmanager
def server_with_request_log(engine_dir: Path, path: Path, log_prompts: bool = False) -> Iterator[tuple[Any, Callable]]:
    """A tiny-engine server on loopback writing its request log to `path` (each prompt's token ids too with
    `log_prompts`), and a reader of the lines logged so far: lines(count, timeout) waits for `count` of them."""
    import json
    import time

    from trtpaged.server import ServerOptions, start_server

    handle = start_server(engine_dir, port=0, served_model_name="tiny", device="cpu",
                          options=ServerOptions(request_log=str(path), request_log_prompts=log_prompts))  # fmt: skip

    def lines(count: int, timeout: float = 20.0) -> list[dict]:
        deadline = time.monotonic() + timeout
        while True:
            got = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
            if len(got) >= count or time.monotonic() > deadline:
                return got
            time.sleep(0.05)

    try:
        yield handle, lines
    finally:
        handle.shutdown(timeout=0)


def one_line_failure(result: Any, *words: str) -> str:
    """A CLI run (click's CliRunner result) that failed with one "Error: ..." line, no traceback, holding every one of
    `words`; returns that line."""
    lines = result.output.strip().splitlines()
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), (result.output, result.exception)
    assert lines and lines[-1].startswith("Error: ") and "Traceback" not in result.output, result.output
    for w in words:
        assert w in lines[-1], lines[-1]
    return lines[-1]


def run_trace_command(command: str, path: Path, engine: Path, *args: str) -> Any:
    """`trtpaged bench memory|throughput|serve ... --trace PATH` or `trtpaged diagnose PATH` through click's
    CliRunner, on `engine` (serve at a URL where nothing listens, throughput without its baseline): the run of a
    trace file that is to be refused before anything loads or is sent."""
    from click.testing import CliRunner

    from trtpaged.cli import main

    if command == "serve":
        argv = ["bench", "serve", "--base-url", "http://127.0.0.1:9", "--trace", str(path)]
    elif command == "diagnose":
        argv = ["diagnose", str(path), "--engine", str(engine)]
    else:
        argv = ["bench", command, str(engine), "--trace", str(path)] + (["--baseline", "none"]
                                                                       if command == "throughput" else [])  # fmt: skip
    return CliRunner().invoke(main, argv + list(args))

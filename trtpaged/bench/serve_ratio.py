"""`trtpaged bench serve-ratio ENGINE`: how much of the engine's speed a `trtpaged serve` user gets.

In one run, on the same engine and the same chat prompts (greedy, `ignore_eos`), alternating:

- single stream: the decode rate seen by the official `openai` client streaming from `trtpaged serve` (a
  separate process on loopback, as a user runs it): the tokens that arrived after its first content chunk over
  the time from that chunk to the last (`window_rate`; each chunk's token count from
  `stream_options.continuous_usage_stats`: with a stream interval, or a first token whose text is held back, the
  first chunk holds several tokens), against the Python API's rate over the same tokens (from the output that
  completed the tokens the server's first chunk held, to its last output: with one token a chunk,
  127 / (t(128 tokens) - t(1 token)));
- concurrent: `LLM.generate`'s useful tok/s (output tokens / wall time) on N requests against N
  concurrent streaming `openai` clients' output tokens / wall time;
- the same N streams read by a bare reader (`bench/sse_reader.py`) that spends almost no CPU: what the
  server itself reaches when no client parses chunks on the same cores (informational, not a target).

Each serve round also reads the server's `/metrics` (`engine_step_seconds_total`, `engine_steps_total`,
`engine_handoff_wait_seconds_total`; `serve_bench.engine_side`), so the engine's own step time in the server, and
its wait for the event loop after each step, are printed next to the API's step, and the CPU seconds per
generated token of each side (the API's process; the server's engine thread with its OpenMP workers, its
HTTP event loop and the rest; the `openai` client), which other processes' load leaves nearly unchanged
where it swings the rates: what the front end costs, against the CPU the kernels need. Each ratio is the median over
the rounds of serve / API within the round. The verdicts come from the 90% interval of that median (bench/noise.py
`interval_verdict`, from 5 rounds on): given when the rounds put it on one side of the target, refused when they
straddle it or other processes took more than half a core; with fewer rounds, the spread rule decides.

With several `--stream-interval` values, one `serve` child runs per value (tokens per streamed chunk; see
`ServerOptions.stream_interval`) and every round runs each of them right after the API's run, in a rotating
order: the intervals' ratios come from the same rounds, so load drifting between separate runs does not
decide which interval looks faster.
"""

from __future__ import annotations

import asyncio
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from trtpaged.bench.child_process import popen_tied
from trtpaged.bench.noise import NoiseMonitor, assess, interval_verdict
from trtpaged.bench.serve_bench import engine_side
from trtpaged.bench.server_metrics import parse_prometheus
from trtpaged.bench.sse_reader import bare_batch_rate

TARGET = 0.90  # serve / API, for both ratios
PASSAGE = ("The river runs past the old mill, where the stones still turn on a windless day. Children gather at the "
           "bank to watch the water carry leaves toward the sea, and the miller tells them stories of floods and "
           "droughts, of the year the ice stopped the wheel and the town baked no bread for a week. In spring the "
           "meadows fill with flowers, and in autumn the orchards drop their apples into the long grass.")  # fmt: skip
SERVED_NAME = "bench"


def conversation(i: int) -> list[dict[str, str]]:
    """The i-th chat prompt: ask to repeat the passage (about 130 tokens with SmolLM2's template)."""
    head = "Repeat this passage exactly" + (f" (copy {i})" if i else "")
    return [{"role": "user", "content": f"{head}:\n\n{PASSAGE}"}]


@dataclass
class Series:
    """Repeated measurements of one figure (higher is better)."""

    name: str
    values: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.values) if self.values else 0.0

    def describe(self, unit: str) -> str:
        shown = " / ".join(f"{v:.1f}" for v in self.values)
        return f"{self.name:<44}{self.median:8.1f} {unit}  ({shown})"


class ServerError(RuntimeError):
    """The benchmark's `trtpaged serve` child failed; the message ends with what it wrote last."""


class ServerStartError(ServerError):
    """The benchmark's `trtpaged serve` child did not start; the message ends with what it wrote last."""


class ServerProcess:
    """`trtpaged serve ENGINE --port 0` in a child process (the environment it inherits decides OpenMP). Its
    stderr goes to a temporary file (a pipe nobody reads could fill and stall it), quoted if it fails to start."""

    def __init__(self, engine: Path, extra_args: tuple[str, ...] = (), timeout_s: float = 300.0,
                 env: Optional[dict[str, str]] = None) -> None:  # fmt: skip
        cmd = [sys.executable, "-m", "trtpaged.cli", "serve", str(engine), "--port", "0",
               "--served-model-name", SERVED_NAME, *extra_args]  # fmt: skip
        self._stderr = tempfile.TemporaryFile(mode="w+", encoding="utf-8", errors="replace")
        self.proc = popen_tied(cmd, stdout=subprocess.PIPE, stderr=self._stderr, text=True, env=env)
        deadline = time.monotonic() + timeout_s
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            found = re.search(r"ready at (http://\S+)", line)
            if found:
                self.url = found.group(1)
                return
            if time.monotonic() > deadline:
                break
        self.close()
        raise ServerStartError(f"trtpaged serve {' '.join(extra_args)} did not start (exit {self.proc.poll()})"
                               + self.last_words())  # fmt: skip

    def last_words(self) -> str:
        """": " and the last three lines the server wrote on stderr, or "" when it wrote none."""
        self._stderr.seek(0)
        said = [line.strip() for line in self._stderr.read()[-4000:].splitlines() if line.strip()][-3:]
        return ": " + " | ".join(said) if said else ""

    def metrics(self) -> dict[str, float]:
        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as resp:
            return parse_prometheus(resp.read().decode())

    def thread_cpu_seconds(self) -> dict[str, float]:
        """CPU seconds so far of the server's threads by role (from their OS names, see server/thread_names.py):
        "engine" (the engine thread and the kernels' OpenMP workers it started), "http" (uvicorn's event loop:
        SSE chunks, HTTP, sockets) and "other"; {} off Linux."""
        from trtpaged.server import thread_names

        roles = {thread_names.ENGINE: "engine", thread_names.HTTP: "http"}
        totals = {"engine": 0.0, "http": 0.0, "other": 0.0}
        try:
            tids = os.listdir(f"/proc/{self.proc.pid}/task")
        except OSError:
            return {}
        for tid in tids:
            task = f"/proc/{self.proc.pid}/task/{tid}"
            try:
                with open(f"{task}/stat") as f:
                    stat = f.read()
            except OSError:  # the thread ended
                continue
            comm, rest = stat[stat.index("(") + 1:stat.rindex(")")], stat.rsplit(")", 1)[1].split()
            seconds = _schedstat_seconds(task)
            if seconds is None:  # no schedstat: the clock ticks (10 ms each) of utime + stime
                seconds = (int(rest[11]) + int(rest[12])) / os.sysconf("SC_CLK_TCK")
            totals[roles.get(comm, "other")] += seconds
        return totals

    def voluntary_switches(self) -> int:
        """Voluntary context switches of all the server's threads so far (an OpenMP thread that sleeps at a
        barrier makes one); 0 off Linux."""
        total = 0
        try:
            for tid in os.listdir(f"/proc/{self.proc.pid}/task"):
                with open(f"/proc/{self.proc.pid}/task/{tid}/status") as f:
                    total += sum(int(line.split()[1]) for line in f if line.startswith("voluntary_ctxt_switches"))
        except OSError:
            return 0
        return total

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def round_ratios(served: list[float], api: list[float]) -> list[float]:
    """Each round's serve / API, the round's two runs back to back (robust to load drifting between rounds,
    which a ratio of the two medians is not)."""
    return [s / a for s, a in zip(served, api) if a > 0]


def paired_ratio(served: list[float], api: list[float]) -> float:
    """Median over the rounds of serve / API."""
    return statistics.median(round_ratios(served, api))


class CpuPerToken:
    """CPU microseconds per generated token, by who spent them, summed over the rounds (load-robust where
    wall-clock rates are not: other processes' load stretches a run's time, not its own CPU seconds)."""

    KEYS = ("api", "engine", "http", "other", "client")

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(self.KEYS, 0.0)
        self.tokens = 0  # counted on the serve side: the API side generates the same tokens

    def add(self, tokens: int, **seconds: float) -> None:
        self.tokens += tokens
        for key, value in seconds.items():
            self.seconds[key] += value

    def per_token_us(self) -> dict[str, float]:
        return {k: 1e6 * v / self.tokens if self.tokens else 0.0 for k, v in self.seconds.items()}


def _schedstat_seconds(task: str) -> Optional[float]:
    """A thread's time on a CPU from /proc/.../schedstat (nanoseconds; a short run's engine or event loop may not
    reach one 10 ms clock tick), or None where the kernel does not keep it."""
    try:
        with open(f"{task}/schedstat") as f:
            return int(f.read().split()[0]) / 1e9
    except (OSError, ValueError, IndexError):
        return None


def _cpu_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before.get(k, 0.0) for k in after}


class ApiSide:
    """The Python API on the engine, in this process."""

    def __init__(self, engine: Path) -> None:
        from trtpaged import LLM

        self.llm = LLM(engine)

    def _params(self, max_tokens: int) -> Any:
        from trtpaged import SamplingParams

        return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    def decode_points(self, max_tokens: int) -> tuple[list[tuple[float, int]], str, float]:
        """((time, tokens so far) at each output, the text, mean step ms) of one request, as `LLM.chat` runs it."""
        import dataclasses

        from trtpaged.runtime.outputs import RequestOutputKind

        engine = self.llm.engine
        params = dataclasses.replace(self._params(max_tokens), output_kind=RequestOutputKind.DELTA)
        steps0, seconds0 = engine.num_steps, sum(engine.phase_seconds.values())
        rid = engine.add_request(self.llm.chat_prompt(conversation(0)), params)
        points: list[tuple[float, int]] = []
        tokens, text = 0, ""
        while engine.has_unfinished():
            for out in engine.step():
                if out.request_id != rid or not out.outputs or not out.outputs[0].token_ids:
                    continue
                now = time.perf_counter()
                tokens += len(out.outputs[0].token_ids)
                text += out.outputs[0].text
                points.append((now, tokens))
        step_ms = 1000.0 * (sum(engine.phase_seconds.values()) - seconds0) / max(1, engine.num_steps - steps0)
        return points, text, step_ms

    def batch_rate(self, num_requests: int, max_tokens: int) -> tuple[float, list[str], float]:
        """(useful tok/s, texts, mean step ms) of `LLM.generate` on the N chat prompts."""
        engine = self.llm.engine
        prompts = [self.llm.chat_prompt(conversation(i)) for i in range(num_requests)]
        steps0, seconds0 = engine.num_steps, sum(engine.phase_seconds.values())
        start = time.perf_counter()
        outs = self.llm.generate(prompts, self._params(max_tokens), use_tqdm=False)
        wall = time.perf_counter() - start
        step_ms = 1000.0 * (sum(engine.phase_seconds.values()) - seconds0) / max(1, engine.num_steps - steps0)
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        return tokens / wall, [o.outputs[0].text for o in outs], step_ms


def window_rate(points: Sequence[tuple[float, int]], from_tokens: Optional[int] = None) -> float:
    """Decode tok/s over a window of one stream's (time, tokens so far) points: the tokens that arrived after its
    start over the time from its start to the last point. The window starts at the first point, or where the
    tokens so far first reach `from_tokens` (another stream's first point: both rates then count the same
    tokens). ValueError when the window holds no later point."""
    i = 0 if from_tokens is None else next((k for k, (_, n) in enumerate(points) if n >= from_tokens), len(points))
    if i >= len(points) - 1 or points[-1][0] <= points[i][0]:
        total = points[-1][1] if points else 0
        raise ValueError(f"single stream: the {total}-token answer came in "
                         f"{'one chunk' if len(points) < 2 else 'chunks with nothing after the window start'}, "
                         "so it has no decode rate: give --max-tokens more than every --stream-interval (and more "
                         "than one chunk's worth)")  # fmt: skip
    return (points[-1][1] - points[i][1]) / (points[-1][0] - points[i][0])


def client_decode_points(url: str, max_tokens: int, messages: Optional[list[dict[str, str]]] = None,
                         ) -> tuple[list[tuple[float, int]], str, float]:
    """((time, tokens so far) at each chunk that added tokens, the text, the client's CPU seconds for the request:
    the client made beforehand, as the API's `LLM` is) of one streamed chat request, `messages` or the first
    `conversation`; the tokens so far come from `stream_options.continuous_usage_stats` (a chunk may hold several
    tokens)."""
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="none")
    cpu = time.thread_time()
    points: list[tuple[float, int]] = []
    text = ""
    stream = client.chat.completions.create(
        model=SERVED_NAME, messages=messages or conversation(0), max_tokens=max_tokens, temperature=0.0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},  # type: ignore[typeddict-unknown-key]
        extra_body={"ignore_eos": True})  # fmt: skip
    for chunk in stream:
        now = time.perf_counter()
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
        if chunk.choices and chunk.usage and chunk.usage.completion_tokens > (points[-1][1] if points else 0):
            points.append((now, chunk.usage.completion_tokens))
    cpu = time.thread_time() - cpu
    client.close()
    if not points:
        raise ValueError("single stream: the server sent no per-chunk usage (stream_options.continuous_usage_stats)")
    return points, text, cpu


async def _client_batch(url: str, num_requests: int, max_tokens: int) -> tuple[float, list[str], float]:
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)

    async def one(i: int) -> tuple[int, str]:
        stream = await client.chat.completions.create(
            model=SERVED_NAME, messages=conversation(i), max_tokens=max_tokens, temperature=0.0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})  # fmt: skip
        tokens, text = 0, ""
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                text += chunk.choices[0].delta.content
            if chunk.usage:
                tokens = chunk.usage.completion_tokens
        return tokens, text

    start, cpu = time.perf_counter(), time.thread_time()
    results = await asyncio.gather(*(one(i) for i in range(num_requests)))
    wall, cpu = time.perf_counter() - start, time.thread_time() - cpu
    await client.close()
    return sum(t for t, _ in results) / wall, [text for _, text in results], cpu


def bare_bodies(num_requests: int, max_tokens: int) -> list[dict[str, Any]]:
    """The chat requests the `openai` clients send, as JSON bodies for the bare reader."""
    return [{"model": SERVED_NAME, "messages": conversation(i), "max_tokens": max_tokens, "temperature": 0.0,
             "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
            for i in range(num_requests)]  # fmt: skip


def client_batch_rate(url: str, num_requests: int, max_tokens: int) -> tuple[float, list[str], float]:
    """(output tok/s over the wall time, texts, the client's CPU seconds over that time) of N concurrent
    streamed chat requests."""
    return asyncio.run(_client_batch(url, num_requests, max_tokens))


def check_stream_intervals(stream_intervals: Sequence[int], server_args: Sequence[str],
                           max_tokens: Optional[int] = None) -> tuple[int, ...]:  # fmt: skip
    """The intervals to compare (one `serve` each), checked: distinct integers >= 1, none also in `server_args`,
    each below `max_tokens` (a single stream needs a chunk after its first to have a decode rate)."""
    intervals = tuple(stream_intervals) or (1,)
    for n in intervals:
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"stream_interval: must be an integer >= 1, got {n!r}")
    if len(set(intervals)) != len(intervals):
        raise ValueError(f"stream_interval: each value at most once, got {list(intervals)}")
    if any(a == "--stream-interval" or a.startswith("--stream-interval=") for a in server_args):
        raise ValueError("server_args: --stream-interval is set by the benchmark's own --stream-interval option")
    if max_tokens is not None and max_tokens <= max(intervals):
        raise ValueError(f"--max-tokens {max_tokens}: must be more than every --stream-interval (got "
                         f"{max(intervals)}): the single stream's decode rate is timed from its first chunk to its "
                         "last, so it needs two chunks")  # fmt: skip
    return intervals


class ServeArm:
    """One `trtpaged serve` child at one `--stream-interval`, and what its rounds measured."""

    MODES = ("single", "batch", "bare")

    def __init__(self, engine: Path, interval: int, server_args: tuple[str, ...], concurrency: int) -> None:
        self.interval = interval
        self.server = ServerProcess(engine, (*server_args, "--stream-interval", str(interval)))
        at = f", interval {interval}"
        self.series = {"single": Series(f"serve, openai client, 1 stream{at} (tok/s)"),
                       "batch": Series(f"serve, {concurrency} streams{at} (tok/s)"),
                       "bare": Series(f"serve, {concurrency} streams, bare reader{at} (tok/s)")}  # fmt: skip
        self.api_single = Series(f"Python API decode, the tokens after serve's first chunk{at} (tok/s)")
        self.steps = {m: Series(m) for m in self.MODES}
        self.handoff = {m: Series(m) for m in self.MODES}  # the engine's wait for the event loop, ms a step
        self.cpu = {m: CpuPerToken() for m in self.MODES}
        self.same_single, self.same = True, {"batch": concurrency, "bare": concurrency}

    def measure(self, mode: str, run: Callable[[str], tuple[float, Any, float]], tokens: int,
                api_cpu: float) -> tuple[Any, float]:  # fmt: skip
        """Runs one timed client run against this server and records its rate, engine step and CPU per token;
        returns (the texts, the rate). ServerError when the run cannot talk to the server (it exited, or answered
        with an error), naming the run and what the server said last."""
        import httpx
        import openai

        try:
            before, threads = self.server.metrics(), self.server.thread_cpu_seconds()
            rate, texts, client_cpu = run(self.server.url)
            # the threads' CPU first: the /metrics scrape (milliseconds of the HTTP thread) is not the run's
            threads_after, after = self.server.thread_cpu_seconds(), self.server.metrics()
        # ValueError: the bare reader's error status ("the server answered 404"), a stream without usage
        except (OSError, ValueError, httpx.HTTPError, openai.OpenAIError) as exc:
            code = self.server.proc.poll()
            state = ("is still running" if code is None else
                     f"was killed by signal {-code}" if code < 0 else f"exited (code {code})")  # fmt: skip
            raise ServerError(f"the {mode} run against trtpaged serve (--stream-interval {self.interval}) failed: "
                              f"{type(exc).__name__}: {exc}; the server {state}"
                              + self.server.last_words()) from exc  # fmt: skip
        self.cpu[mode].add(tokens, api=api_cpu, client=client_cpu, **_cpu_delta(threads, threads_after))
        self.series[mode].values.append(rate)
        server = engine_side(before, after)
        self.steps[mode].values.append(server["engine_step_ms"] or 0.0)
        self.handoff[mode].values.append(server["handoff_wait_ms"] or 0.0)
        return texts, rate


def check_room(llm: Any, concurrency: int, max_tokens: int, server_args: Sequence[str] = ()) -> None:
    """Refuses a --max-tokens the engine's max_seq_len (or a smaller one the servers are given, `--max-seq-len` /
    `--max-model-len` among `server_args`) leaves no room for beside the longest of the prompts, before any server
    starts (the server refused every request, and the benchmark ended in the client's traceback)."""
    longest = max(len(llm.chat_prompt(conversation(i))) for i in range(max(concurrency, 1)))
    limit = min([llm.config.max_seq_len, *_server_seq_lens(server_args)])
    room = limit - longest
    if max_tokens > room:
        raise ValueError(f"--max-tokens {max_tokens}: the benchmark's longest prompt has {longest} tokens on this "
                         f"engine, so its max_seq_len ({limit}) leaves room for at most {room}")


def _server_seq_lens(server_args: Sequence[str]) -> list[int]:
    """The max_seq_len values among the servers' arguments (`--max-seq-len N`, `--max-model-len=N`)."""
    found, args = [], list(server_args)
    for i, arg in enumerate(args):
        name, eq, value = arg.partition("=")
        if name in ("--max-seq-len", "--max-model-len"):
            value = value if eq else (args[i + 1] if i + 1 < len(args) else "")
            if value.isdigit():
                found.append(int(value))
    return found


def run_serve_ratio(engine: Path, repeats: int = 5, max_tokens: int = 128, concurrency: int = 16,
                    server_args: tuple[str, ...] = (), progress: Callable[[str], None] = lambda _: None,
                    stream_intervals: Sequence[int] = (1,)) -> dict:  # fmt: skip
    """Runs the comparison (API and serve rounds alternating; with several `stream_intervals`, one server
    each, their runs in a rotating order after the API's in every round) and returns the report (see
    `format_ratio`)."""
    intervals = check_stream_intervals(stream_intervals, server_args, max_tokens)
    progress("loading the engine in this process and starting trtpaged serve"
             + (f" at stream intervals {', '.join(map(str, intervals))}" if len(intervals) > 1 else ""))
    api = ApiSide(engine)
    check_room(api.llm, concurrency, max_tokens, server_args)
    arms: list[ServeArm] = []
    monitor = NoiseMonitor()
    api_series = {"single": Series("Python API decode (tok/s)"),
                  "batch": Series(f"LLM.generate, {concurrency} requests (tok/s)")}  # fmt: skip
    api_steps = {m: Series(m) for m in api_series}
    bodies = bare_bodies(concurrency, max_tokens)
    try:
        for n in intervals:
            arms.append(ServeArm(engine, n, tuple(server_args), concurrency))
        # Warm both sides, and leave every round the same prefix-cache state: the rounds' prompts are
        # cached from here on (without this the first round alone prefilled the 16 prompts in full, and
        # read as a slow first batch).
        api.decode_points(8)
        api.batch_rate(concurrency, 8)
        for arm in arms:
            client_decode_points(arm.server.url, 8)
            client_batch_rate(arm.server.url, concurrency, 8)
            bare_batch_rate(arm.server.url, bare_bodies(concurrency, 8))
        with monitor:
            for r in range(repeats):
                progress(f"round {r + 1}/{repeats}")
                order = arms[r % len(arms):] + arms[: r % len(arms)]  # no server always right after the API
                api_cpu = time.process_time()  # this process: the API's thread and its OpenMP workers
                api_points, api_text, step = api.decode_points(max_tokens)
                api_cpu = time.process_time() - api_cpu
                api_series["single"].values.append(window_rate(api_points))
                api_steps["single"].values.append(step)
                for arm in order:

                    def single(url: str, arm: ServeArm = arm) -> tuple[float, str, float]:
                        points, text, cpu = client_decode_points(url, max_tokens)
                        # the API's rate over the tokens this stream's rate counts: those after its first chunk
                        arm.api_single.values.append(window_rate(api_points, points[0][1]))
                        return window_rate(points), text, cpu

                    text, _ = arm.measure("single", single, max_tokens, api_cpu)
                    arm.same_single &= text == api_text
                api_cpu = time.process_time()
                rate, api_texts, step = api.batch_rate(concurrency, max_tokens)
                api_cpu = time.process_time() - api_cpu
                api_series["batch"].values.append(rate)
                api_steps["batch"].values.append(step)
                for arm in order:
                    texts, _ = arm.measure("batch", lambda url: client_batch_rate(url, concurrency, max_tokens),
                                           concurrency * max_tokens, api_cpu)  # fmt: skip
                    arm.same["batch"] = min(arm.same["batch"], sum(a == b for a, b in zip(api_texts, texts)))
                    texts, _ = arm.measure("bare", lambda url: bare_batch_rate(url, bodies), concurrency * max_tokens,
                                           0.0)  # the batch run's API side serves both  # fmt: skip
                    arm.same["bare"] = min(arm.same["bare"], sum(a == b for a, b in zip(api_texts, texts)))
    finally:
        for arm in arms:
            arm.server.close()
    # the verdicts are on the paired ratios, so their noise is the spread of the rounds' ratios (a machine whose
    # speed drifts between rounds moves both runs of a round together; the runs' own spreads are in the report)
    for arm in arms:
        monitor.add_samples(round_ratios(arm.series["single"].values, arm.api_single.values))
        monitor.add_samples(round_ratios(arm.series["batch"].values, api_series["batch"].values))
    # the servers are our own children: the monitor counts their CPU as ours, not other processes' load
    noise = assess(max(monitor.spreads, default=None), monitor.foreign_cores(), os.cpu_count() or 1)
    series = {f"api_{m}": s for m, s in api_series.items()}
    steps = {f"api_{m}": s for m, s in api_steps.items()}
    handoffs: dict[str, Series] = {}
    by_interval = {}
    for arm in arms:
        series.update({f"serve_{m}@{arm.interval}": s for m, s in arm.series.items()})
        steps.update({f"serve_{m}@{arm.interval}": s for m, s in arm.steps.items()})
        handoffs.update({f"serve_{m}@{arm.interval}": s for m, s in arm.handoff.items()})
        singles = round_ratios(arm.series["single"].values, arm.api_single.values)
        batches = round_ratios(arm.series["batch"].values, api_series["batch"].values)
        single, batch = statistics.median(singles), statistics.median(batches)
        by_interval[str(arm.interval)] = {
            "single_ratio": single, "batch_ratio": batch,
            "bare_ratio": paired_ratio(arm.series["bare"].values, api_series["batch"].values),
            "same_text_single": arm.same_single, "same_text_batch": f"{arm.same['batch']}/{concurrency}",
            "same_text_bare": f"{arm.same['bare']}/{concurrency}",
            "cpu_us_per_token": {m: c.per_token_us() for m, c in arm.cpu.items()},
            "single_rounds": singles, "batch_rounds": batches, "api_single": arm.api_single.values,
            "verdict_single": interval_verdict(singles, TARGET, True, noise),
            "verdict_batch": interval_verdict(batches, TARGET, True, noise),
        }  # fmt: skip
    return {
        "engine": str(engine), "repeats": repeats, "max_tokens": max_tokens, "concurrency": concurrency,
        "server_args": list(server_args), "stream_intervals": list(intervals),
        "env": {k: os.environ[k] for k in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT") if k in os.environ},
        "series": {k: s.values for k, s in series.items()},
        "step_ms": {k: s.values for k, s in steps.items()},
        "handoff_ms": {k: s.values for k, s in handoffs.items()},
        "labels": {k: s.name for k, s in series.items()},
        "by_interval": by_interval,
        "noise": noise.to_dict(), "noise_text": noise.describe(),
    }  # fmt: skip


def format_ratio(report: dict) -> str:
    """The report as text: each figure's median and repeats, the engine step times, then per stream interval
    the CPU per token by side and the ratios."""
    lines = []
    for key, values in report["series"].items():
        s = Series(report["labels"][key], values)
        steps, handoff = report["step_ms"][key], report.get("handoff_ms", {}).get(key)
        wait = f" + hand-over wait {statistics.median(handoff):.2f} ms" if handoff else ""
        lines.append(f"{s.describe('')}  engine step {statistics.median(steps):.2f} ms{wait}")
    streams = f"{report['concurrency']} streams"
    # a noisy run's ratios are shown, but only as indicative (its verdicts are refused; docs/benchmarks.md)
    noisy = "" if report["noise"]["trustworthy"] else "; noisy run: indicative only"
    for interval, r in report["by_interval"].items():
        lines.append(f"--stream-interval {interval}:")
        if r.get("api_single"):
            api = Series("Python API decode, the tokens serve's rate counts (tok/s)", r["api_single"])
            lines.append(f"  {api.describe('')}")
        for mode, label in (("single", "1 stream"), ("batch", streams), ("bare", f"{streams}, bare reader")):
            us = r["cpu_us_per_token"][mode]
            serve = us["engine"] + us["http"] + us["other"]
            api = "" if mode == "bare" else f"API {us['api']:.0f} | "  # the bare run shares the batch run's API side
            lines.append(f"  CPU us/token, {label}: {api}serve {serve:.0f} = engine+kernels "
                         f"{us['engine']:.0f} + HTTP/event loop {us['http']:.0f} + other {us['other']:.0f} | "
                         f"{'bare reader' if mode == 'bare' else 'openai client'} {us['client']:.0f}")  # fmt: skip
        rounds = {m: " / ".join(f"{x:.2f}" for x in r.get(f"{m}_rounds", [])) for m in ("single", "batch")}
        lines.append(f"  single stream: serve / API = {r['single_ratio']:.2f} (median of the rounds' ratios "
                     f"{rounds['single']}; target >= {TARGET:.2f}{noisy}): {r['verdict_single']}; "
                     f"same text: {r['same_text_single']}")  # fmt: skip
        lines.append(f"  {streams}:  serve / LLM.generate = {r['batch_ratio']:.2f} (rounds {rounds['batch']}; "
                     f"target >= {TARGET:.2f}{noisy}): {r['verdict_batch']}; "
                     f"same texts: {r['same_text_batch']}")  # fmt: skip
        lines.append(f"  {streams}, bare reader: serve / LLM.generate = {r['bare_ratio']:.2f} (the server "
                     f"without a client's parsing on the same cores; not a target{noisy}); "
                     f"same texts: {r['same_text_bare']}")  # fmt: skip
    lines.append(report["noise_text"])
    return "\n".join(lines)

"""`trtpaged bench neighbour`: decode speed beside a busy process, thread budget on (`auto`) against off (`fixed`).

Two child processes hold the engine, one with TRTPAGED_CPU_THREADS=auto (the default: runtime/cpu_share.py) and
one with `fixed` (torch's thread count throughout). Each round times both, in turn (the order alternating), on a
quiet machine and then beside a process that spins on one of this process's cores. A child is driven over its
stdin/stdout: one line "run" in, one line of JSON (tokens a second, the thread count at the end) out.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Optional

from trtpaged.bench.child_process import popen_tied
from trtpaged.bench.noise import spread

ARMS = ("auto", "fixed")
SPINNER = "import time\nwhile True:\n    pass\n"

_CHILD = """import json, sys, time
import torch
from trtpaged import LLM, SamplingParams
engine, tokens, batch = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
llm = LLM(engine, device="cpu")
params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
prompts = [f"Request {i}: the history of the city begins" for i in range(batch)]
llm.generate(prompts, params, use_tqdm=False)
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    print(json.dumps({"tok_s": tokens * batch / seconds, "threads": torch.get_num_threads()}), flush=True)
"""


class _Arm:
    """One child process holding the engine under one TRTPAGED_CPU_THREADS setting."""

    def __init__(self, setting: str, engine: Path, tokens: int, batch: int) -> None:
        env = {**os.environ, "TRTPAGED_CPU_THREADS": setting}
        self.proc = popen_tied([sys.executable, "-c", _CHILD, str(engine), str(tokens), str(batch)], env=env,
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._read()  # loaded and warmed

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"bench neighbour: the engine's child process exited (code {self.proc.wait()})")
        return json.loads(line)

    def run(self) -> dict:
        self.proc.stdin.write("run\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        self.proc.kill()
        self.proc.wait()
        self.proc.stdout.close()


def run_neighbour_bench(engine: Path, rounds: int = 3, tokens: int = 256, batch: int = 1,
                        progress: Callable[[str], None] = lambda m: None) -> dict:
    """{condition: {arm: [tok/s per round], "threads": {arm: [...]}, "ratio": [auto / fixed per round]}}."""
    arms: dict[str, _Arm] = {}
    spinner: Optional[subprocess.Popen] = None
    results = {c: {"tok_s": {a: [] for a in ARMS}, "threads": {a: [] for a in ARMS}, "ratio": []}
               for c in ("quiet", "busy")}
    try:
        for arm in ARMS:
            progress(f"loading {engine} (TRTPAGED_CPU_THREADS={arm})")
            arms[arm] = _Arm(arm, engine, tokens, batch)
        for r in range(rounds):
            for condition in ("quiet", "busy"):
                if condition == "busy":
                    spinner = popen_tied([sys.executable, "-c", SPINNER])
                    time.sleep(0.5)
                order = ARMS if r % 2 == 0 else ARMS[::-1]
                got = {arm: arms[arm].run() for arm in order}
                if spinner is not None:
                    spinner.kill()
                    spinner.wait()
                    spinner = None
                entry = results[condition]
                for arm in ARMS:
                    entry["tok_s"][arm].append(got[arm]["tok_s"])
                    entry["threads"][arm].append(got[arm]["threads"])
                entry["ratio"].append(got["auto"]["tok_s"] / got["fixed"]["tok_s"])
                progress(f"round {r + 1}/{rounds} {condition}: auto {got['auto']['tok_s']:.1f} tok/s, "
                         f"fixed {got['fixed']['tok_s']:.1f} tok/s")
    finally:
        if spinner is not None:
            spinner.kill()
            spinner.wait()
        for arm in arms.values():
            arm.close()
    return {"engine": str(engine), "rounds": rounds, "tokens": tokens, "batch": batch,
            "cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
            **results}


def describe(report: dict) -> str:
    """The report as text: per condition, each arm's median tok/s and thread count, and the median ratio."""
    lines = [f"bench neighbour: {report['engine']}, {report['batch']} x {report['tokens']} tokens, greedy, "
             f"{report['rounds']} rounds, {report['cpus']} cores; busy: a process spinning beside the engine"]
    for condition in ("quiet", "busy"):
        entry = report[condition]
        arms = ", ".join(f"{arm} {statistics.median(entry['tok_s'][arm]):.1f} tok/s (spread "
                         f"{spread(entry['tok_s'][arm]):.0%}, threads {sorted(set(entry['threads'][arm]))})"
                         for arm in ARMS)
        ratios = " ".join(f"{x:.2f}" for x in entry["ratio"])
        lines.append(f"{condition}: {arms}; auto / fixed {statistics.median(entry['ratio']):.2f} "
                     f"(rounds: {ratios})")
    return "\n".join(lines)

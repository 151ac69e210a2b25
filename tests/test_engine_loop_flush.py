"""The engine thread hands each step's outputs to the event loop and waits, within a bound, for the loop to run the
readers they woke (server/engine_loop.py, `EngineLoop._wait_flushed`): every output still arrives, in order, and a
loop busy with something else costs the engine that bound once, not at every step."""

from __future__ import annotations

import asyncio
import threading
import time

from trtpaged import LLM, SamplingParams
from trtpaged.runtime.outputs import RequestOutputKind
from trtpaged.server.engine_loop import EngineLoop
from trtpaged.server.metrics import ServerMetrics

PROMPT = [5, 17, 42, 9, 100, 3]
MAX_TOKENS = 400  # far more steps than a blocked loop lets through if each step waited the bound


async def _never() -> bool:
    return False


def test_a_busy_event_loop_is_waited_on_once_not_every_step(tiny_engine_dir):
    """The loop is blocked for BLOCK_S while a request streams. With a wait of `flush_wait_s` at every step the
    engine could make at most BLOCK_S / flush_wait_s = 10 steps in that time; it makes the steps its own speed
    allows (all that are left of the request, or at least 40). The tokens the reader got are `LLM.generate`'s."""
    block_s, wait_s = 1.0, 0.1
    truth = LLM(tiny_engine_dir, device="cpu").generate(
        [PROMPT], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))[0].outputs[0].token_ids
    llm, loop = EngineLoop.start_loaded(lambda: LLM(tiny_engine_dir, device="cpu"), lambda llm: llm.engine,
                                        ServerMetrics())  # fmt: skip
    loop.flush_wait_s = wait_s
    aio = asyncio.new_event_loop()
    thread = threading.Thread(target=aio.run_forever, daemon=True)
    thread.start()
    got: list[int] = []
    started = threading.Event()
    window: dict[str, int] = {}

    async def read() -> None:
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True,
                                output_kind=RequestOutputKind.DELTA)  # as the server asks: each output's new tokens
        sub = await loop.submit([("r0", list(PROMPT), params)])
        async for out in sub.outputs(_never):
            got.extend(out.outputs[0].token_ids)
            if len(got) >= 5:
                started.set()

    def block() -> None:  # runs on the event loop: nothing else runs there meanwhile
        window["before"], window["tokens_before"] = llm.engine.num_steps, len(got)
        time.sleep(block_s)
        window["after"] = llm.engine.num_steps

    try:
        reading = asyncio.run_coroutine_threadsafe(read(), aio)
        assert started.wait(60), "the request did not start streaming"
        aio.call_soon_threadsafe(block)
        reading.result(120)
    finally:
        loop.shutdown()
        aio.call_soon_threadsafe(aio.stop)
        thread.join(10)
    assert got == list(truth)
    steps = window["after"] - window["before"]
    left = MAX_TOKENS - window["tokens_before"]
    assert steps >= min(left - 1, 40), (
        f"the engine made {steps} steps while the event loop was blocked {block_s} s ({left} tokens were left): "
        f"it waited for the loop at every step")
    assert steps > block_s / wait_s + 1

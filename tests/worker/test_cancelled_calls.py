"""Engine calls whose waiting task is cancelled: clean-up still runs, and a placement that ran anyway
is undone, so a cancelled gRPC handler never leaves a KV block behind. A real LLMEngine on the
embedded model; the engine thread is held inside a call to make the cancellation land mid-call."""

from __future__ import annotations

import asyncio
import threading

import pytest

from pdserve.decode_worker.worker import DecodeWorker
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.params import SamplingParams
from pdserve.worker.host import run_or_undo, submit_quietly
from pdserve.worker.loop import EngineLoop

WAIT_S = 10
PROMPT = [5, 17, 42, 99, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]


def engine_for(embedded_dir) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(embedded_dir), num_kv_blocks=64, block_size=16, dtype="float32"))


@pytest.fixture
def loop(embedded_dir):
    loop = EngineLoop(engine_for(embedded_dir), lambda outputs: None)
    loop.start()
    yield loop
    loop.stop()


def hold_engine_thread(loop: EngineLoop) -> threading.Event:
    """Keep the engine thread busy in a call until the returned event is set."""
    entered, release = threading.Event(), threading.Event()
    loop.submit(lambda e: (entered.set(), release.wait(WAIT_S)))
    assert entered.wait(WAIT_S)
    return release


async def cancel_soon(task: asyncio.Task) -> None:
    await asyncio.sleep(0.05)  # the task is waiting on the engine thread by now
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_a_clean_up_call_runs_although_its_waiter_was_cancelled(loop):
    release = hold_engine_thread(loop)
    ran = threading.Event()
    await cancel_soon(asyncio.create_task(submit_quietly(loop, lambda e: ran.set())))
    release.set()
    assert await asyncio.to_thread(ran.wait, WAIT_S)


async def test_a_call_cancelled_before_it_started_neither_runs_nor_is_undone(loop):
    release = hold_engine_thread(loop)
    calls = []
    task = asyncio.create_task(run_or_undo(loop, lambda e: calls.append("ran"), lambda e, r: calls.append("undone")))
    await cancel_soon(task)
    release.set()
    await asyncio.wrap_future(loop.submit(lambda e: None))  # every call queued before has run
    assert calls == []


async def test_a_call_that_ran_after_its_waiter_was_cancelled_is_undone_on_the_engine_thread(loop):
    entered, release, undone = threading.Event(), threading.Event(), []

    def slow(engine):
        entered.set()
        release.wait(WAIT_S)
        return 42

    task = asyncio.create_task(
        run_or_undo(loop, slow, lambda e, r: undone.append((r, threading.current_thread().name)))
    )
    assert await asyncio.to_thread(entered.wait, WAIT_S)
    await cancel_soon(task)
    release.set()
    await asyncio.wrap_future(loop.submit(lambda e: None))
    assert undone == [(42, "engine-loop")]


@pytest.mark.parametrize("reserve", [True, False], ids=["reserve_kv", "admit_kv"])
async def test_a_kv_placed_for_a_cancelled_push_leaves_no_block(embedded_dir, reserve):
    """The PushKv handler is cancelled while its KV is being placed: the blocks go back."""
    prefill = engine_for(embedded_dir)
    prefill.add_request("r", PROMPT, SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True))
    payload = prefill.extract_kv(prefill.step()[0].seq)
    worker = DecodeWorker(engine_for(embedded_dir))
    engine, entered, release = worker.engine, threading.Event(), threading.Event()
    place = engine.reserve_kv if reserve else engine.admit_kv

    def slow_place(e, preempt):
        entered.set()
        release.wait(WAIT_S)
        return place(payload, preempt)

    worker.host.start()
    try:
        worker._pending["r"] = asyncio.get_running_loop().create_future()  # a Decode stream waits for it
        task = asyncio.create_task(worker._place("r", slow_place, reserve))
        assert await asyncio.to_thread(entered.wait, WAIT_S)
        await cancel_soon(task)
        release.set()
        held = await asyncio.wrap_future(worker.host.loop.submit(lambda e: (e.blocks.num_used, e.has_work())))
        assert held == (0, False)
    finally:
        await worker.host.stop()

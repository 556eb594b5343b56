"""EngineLoop: calls run on the engine thread between steps, outputs and step errors reach their
callbacks, and a stopped loop refuses calls. A real LLMEngine on the embedded model."""

from __future__ import annotations

import threading
import time

import pytest

from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine, StepError
from pdserve.engine.params import SamplingParams
from pdserve.engine.scheduling.sequence import FinishReason
from pdserve.worker.loop import EngineLoop

PROMPTS = {"a": [5, 17, 42, 99], "b": [7, 8, 9, 10, 11, 12], "c": [300, 200, 100]}
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
WAIT_S = 10


@pytest.fixture
def engine(embedded_dir):
    return LLMEngine(EngineConfig(model=str(embedded_dir), num_kv_blocks=64, dtype="float32"))


class Recorder:
    """on_outputs / on_step_error callbacks that keep what they were given and on which thread."""

    def __init__(self) -> None:
        self.tokens: dict[str, list[int]] = {}
        self.prefill: dict[str, list[bool]] = {}
        self.finished: set[str] = set()
        self.threads: set[str] = set()
        self.errors: list[StepError] = []
        self.steps = 0
        self.changed = threading.Condition()

    def on_outputs(self, outputs) -> None:
        with self.changed:
            self.steps += 1
            self.threads.add(threading.current_thread().name)
            for out in outputs:
                rid = out.seq.request_id
                self.tokens.setdefault(rid, []).append(out.token)
                self.prefill.setdefault(rid, []).append(out.prefill)
                if out.seq.finish_reason is not None:
                    self.finished.add(rid)
            self.changed.notify_all()

    def on_step_error(self, err: StepError) -> None:
        with self.changed:
            self.threads.add(threading.current_thread().name)
            self.errors.append(err)
            self.changed.notify_all()

    def wait(self, predicate) -> None:
        with self.changed:
            assert self.changed.wait_for(predicate, timeout=WAIT_S), "the engine thread did not get there in time"


@pytest.fixture
def running(engine):
    rec = Recorder()
    loop = EngineLoop(engine, rec.on_outputs, rec.on_step_error)
    loop.start()
    yield loop, rec
    loop.stop()


def add_all(prompts: dict[str, list[int]], sampling: SamplingParams = GREEDY):
    """One engine call that queues every prompt (so they share the first step)."""
    return lambda e: [e.add_request(rid, p, sampling) for rid, p in prompts.items()]


def test_submit_runs_on_the_engine_thread_and_returns_the_result(engine, running):
    loop, _ = running
    fut = loop.submit(lambda e: (threading.current_thread().name, e is engine, e.stats()["num_waiting"]))
    assert fut.result(WAIT_S) == ("engine-loop", True, 0)
    assert threading.current_thread().name != "engine-loop"


def test_an_exception_in_a_call_reaches_its_future_and_the_loop_goes_on(running):
    loop, _ = running
    with pytest.raises(ValueError, match="prompt is empty"):
        loop.submit(lambda e: e.add_request("empty", [], GREEDY)).result(WAIT_S)
    with pytest.raises(ZeroDivisionError):
        loop.submit(lambda e: 1 / 0).result(WAIT_S)
    assert loop.submit(lambda e: e.stats()["num_running"] + 41).result(WAIT_S) == 41


def test_outputs_reach_on_outputs_on_the_engine_thread_with_the_offline_tokens(embedded_dir, running):
    # the reference comes from an engine of its own: the loop's engine belongs to its thread
    reference = LLMEngine(EngineConfig(model=str(embedded_dir), num_kv_blocks=64, dtype="float32"))
    expected = dict(zip(PROMPTS, reference.generate(list(PROMPTS.values()), GREEDY)))
    loop, rec = running
    seqs = loop.submit(add_all(PROMPTS)).result(WAIT_S)
    rec.wait(lambda: rec.finished == set(PROMPTS))
    assert rec.tokens == expected
    assert rec.threads == {"engine-loop"}
    for rid in PROMPTS:
        # the first token of each request comes from its prefill, the others from decode steps
        assert rec.prefill[rid] == [True] + [False] * (GREEDY.max_tokens - 1)
    assert all(s.finish_reason == FinishReason.LENGTH for s in seqs)
    assert loop.submit(lambda e: (e.has_work(), e.blocks.num_used)).result(WAIT_S) == (False, 0)


def test_calls_run_between_steps_never_during_one(engine, running):
    loop, rec = running
    in_step = threading.Event()
    step = engine.step

    def watched_step():
        in_step.set()
        try:
            return step()
        finally:
            in_step.clear()

    engine.step = watched_step
    gate = threading.Event()
    original = rec.on_outputs

    def gated(outputs):  # hold the engine thread after its first step until a call is queued
        original(outputs)
        if rec.steps == 1:
            assert gate.wait(WAIT_S)

    loop._on_outputs = gated
    loop.submit(add_all({"long": PROMPTS["a"]}, SamplingParams(temperature=0.0, max_tokens=30)))
    rec.wait(lambda: rec.steps >= 1)
    fut = loop.submit(lambda e: (in_step.is_set(), e.has_work(), len(rec.tokens["long"])))
    gate.set()
    # the call ran after the first step and before the request finished, with no step under way
    assert fut.result(WAIT_S) == (False, True, 1)
    for _ in range(10):
        assert loop.submit(lambda e: in_step.is_set()).result(WAIT_S) is False
    rec.wait(lambda: "long" in rec.finished)
    assert len(rec.tokens["long"]) == 30


def test_a_failed_step_reports_its_sequences_freed_and_the_loop_survives(engine, running):
    loop, rec = running
    run = engine.runner.run
    calls = []

    def fail_once(batch):
        calls.append(batch)
        if len(calls) == 1:
            raise RuntimeError("injected forward failure")
        return run(batch)

    engine.runner.run = fail_once
    failing = {"a": PROMPTS["a"], "b": PROMPTS["b"]}
    loop.submit(add_all(failing)).result(WAIT_S)
    rec.wait(lambda: rec.errors)
    (err,) = rec.errors
    assert isinstance(err, StepError) and "injected forward failure" in str(err)
    assert {s.request_id for s in err.seqs} == set(failing)
    assert all(s.finish_reason == FinishReason.ERROR for s in err.seqs)
    assert rec.threads == {"engine-loop"} and not rec.tokens
    assert loop.submit(lambda e: (e.has_work(), e.blocks.num_used)).result(WAIT_S) == (False, 0)
    # the next request runs normally
    loop.submit(add_all({"c": PROMPTS["c"]})).result(WAIT_S)
    rec.wait(lambda: "c" in rec.finished)
    assert len(rec.tokens["c"]) == GREEDY.max_tokens and len(rec.errors) == 1


def test_a_failed_step_without_an_error_callback_does_not_stop_the_loop(engine):
    outputs = []
    loop = EngineLoop(engine, outputs.append)
    engine.runner.run = lambda batch: (_ for _ in ()).throw(RuntimeError("injected"))
    loop.start()
    try:
        loop.submit(add_all({"a": PROMPTS["a"]})).result(WAIT_S)
        deadline = time.monotonic() + WAIT_S
        while loop.submit(lambda e: e.has_work()).result(WAIT_S):
            assert time.monotonic() < deadline
        assert loop._thread.is_alive() and outputs == []
        assert loop.submit(lambda e: e.blocks.num_used).result(WAIT_S) == 0
    finally:
        loop.stop()


def test_an_exception_in_on_outputs_fails_those_requests_and_the_loop_goes_on(engine):
    """A callback that raises (a KV extraction out of memory, say) must not kill the engine thread:
    the step's sequences end with ERROR, their blocks are freed, and later calls still run."""
    rec = Recorder()
    raised = []

    def on_outputs(outputs) -> None:
        if not raised:
            raised.append([o.seq.request_id for o in outputs])
            raise MemoryError("injected in on_outputs")
        rec.on_outputs(outputs)

    loop = EngineLoop(engine, on_outputs, rec.on_step_error)
    loop.start()
    try:
        loop.submit(add_all({"a": PROMPTS["a"]})).result(WAIT_S)
        rec.wait(lambda: rec.errors)
        (err,) = rec.errors
        assert "injected in on_outputs" in str(err) and [s.request_id for s in err.seqs] == raised[0] == ["a"]
        assert err.seqs[0].finish_reason == FinishReason.ERROR
        assert loop.submit(lambda e: (e.has_work(), e.blocks.num_used)).result(WAIT_S) == (False, 0)
        loop.submit(add_all({"c": PROMPTS["c"]})).result(WAIT_S)
        rec.wait(lambda: "c" in rec.finished)
        assert len(rec.tokens["c"]) == GREEDY.max_tokens
    finally:
        loop.stop()


def test_an_exception_outside_the_forward_pass_fails_the_held_requests(engine, running):
    loop, rec = running
    schedule = engine.scheduler.schedule
    engine.scheduler.schedule = lambda: (_ for _ in ()).throw(RuntimeError("injected in schedule"))
    loop.submit(add_all({"a": PROMPTS["a"], "b": PROMPTS["b"]})).result(WAIT_S)
    rec.wait(lambda: rec.errors)
    assert {s.request_id for s in rec.errors[0].seqs} == {"a", "b"}
    engine.scheduler.schedule = schedule
    assert loop.submit(lambda e: (e.has_work(), e.blocks.num_used)).result(WAIT_S) == (False, 0)
    loop.submit(add_all({"c": PROMPTS["c"]})).result(WAIT_S)
    rec.wait(lambda: "c" in rec.finished)


def test_a_cancelled_call_is_skipped(running):
    loop, _ = running
    release, ran = threading.Event(), []
    blocker = loop.submit(lambda e: release.wait(WAIT_S))
    skipped = loop.submit(lambda e: ran.append("skipped"))
    assert skipped.cancel()
    release.set()
    assert blocker.result(WAIT_S) is True
    assert loop.submit(lambda e: ran.append("after")).result(WAIT_S) is None
    assert ran == ["after"]


def test_stop_ends_the_thread_mid_run_and_later_calls_fail(engine, running):
    loop, rec = running
    loop.submit(add_all(PROMPTS, SamplingParams(temperature=0.0, max_tokens=1000))).result(WAIT_S)
    rec.wait(lambda: rec.steps >= 2)
    t = time.monotonic()
    loop.stop()
    assert time.monotonic() - t < 5
    assert not loop._thread.is_alive()
    steps = rec.steps
    time.sleep(0.2)
    assert rec.steps == steps, "steps went on after stop()"
    assert engine.has_work(), "stop() waited for the requests to finish instead of the current step"
    fut = loop.submit(lambda e: 1)
    assert fut.done()
    with pytest.raises(RuntimeError, match="stopped"):
        fut.result()

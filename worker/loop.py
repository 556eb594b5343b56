"""Runs an LLMEngine on its own thread; other threads talk to it through submitted calls."""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
from collections.abc import Callable
from typing import TypeVar

from pdserve.engine.llm_engine import LLMEngine, StepError, StepOutput
from pdserve.engine.scheduling.sequence import FinishReason

T = TypeVar("T")
log = logging.getLogger(__name__)


class EngineLoop:
    """Owns the engine thread.

    ``submit(fn)`` runs ``fn(engine)`` on the engine thread between two steps and returns a
    ``concurrent.futures.Future`` with its result or exception. After every step ``on_outputs`` is
    called on the engine thread with that step's outputs; ``on_step_error`` with the StepError
    (which names the failed sequences, already finished with ERROR and freed) when a step failed.
    An exception outside the forward pass (in the scheduler, or raised by ``on_outputs``) fails the
    sequences it may have left half-done the same way, and the thread goes on serving the rest.
    """

    def __init__(
        self,
        engine: LLMEngine,
        on_outputs: Callable[[list[StepOutput]], None],
        on_step_error: Callable[[StepError], None] | None = None,
    ) -> None:
        self.engine = engine
        self._on_outputs = on_outputs
        self._on_step_error = on_step_error
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Ask the thread to exit after the current step and wait up to ``timeout`` seconds."""
        self._stop.set()
        self._calls.put(None)
        self._thread.join(timeout)

    def submit(self, fn: Callable[[LLMEngine], T]) -> concurrent.futures.Future[T]:
        """Run ``fn(engine)`` on the engine thread; RuntimeError in the future if the loop stopped."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        if self._stop.is_set():
            fut.set_exception(RuntimeError("engine loop is stopped"))
        else:
            self._calls.put((fn, fut))
        return fut

    def _fail(self, exc: Exception, seqs: list) -> None:
        """Finish ``seqs`` with ERROR (freeing their blocks) and report them as a failed step, so
        that their callers get an error and the thread goes on serving the others."""
        for seq in seqs:
            self.engine.scheduler.finish(seq, FinishReason.ERROR)
        err = StepError(exc, seqs)
        err.__cause__ = exc
        self._report(err)

    def _report(self, err: StepError) -> None:
        log.error("engine step failed: %s", err, exc_info=err.__cause__ or err)
        if self._on_step_error is not None:
            try:
                self._on_step_error(err)
            except Exception:
                log.exception("reporting a failed step failed")

    def _drain(self, block: bool) -> None:
        try:
            item = self._calls.get(block=block, timeout=0.5 if block else None)
        except queue.Empty:
            return
        while item is not None:
            fn, fut = item
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(self.engine))
                except Exception as exc:  # reported to the caller through the future
                    fut.set_exception(exc)
            try:
                item = self._calls.get_nowait()
            except queue.Empty:
                return

    def _run(self) -> None:
        while not self._stop.is_set():
            self._drain(block=not self.engine.has_work())
            if self._stop.is_set() or not self.engine.has_work():
                continue
            try:
                outputs = self.engine.step()
            except StepError as exc:
                self._report(exc)
                continue
            except Exception as exc:  # the step failed outside the forward pass: fail what it may have touched
                held = [*self.engine.scheduler.waiting, *self.engine.scheduler.running]
                self._fail(exc, held)
                continue
            if outputs:
                try:
                    self._on_outputs(outputs)
                except Exception as exc:  # e.g. a KV extraction that ran out of memory
                    self._fail(exc, [o.seq for o in outputs])
        # fail calls that arrived while stopping
        while True:
            try:
                item = self._calls.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item[1].set_exception(RuntimeError("engine loop is stopped"))

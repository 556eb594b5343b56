"""Which cores each CPU worker of one machine is pinned to, and the pinning itself (``pdserve
serve``'s workers, and the serving probe's of ``pdserve profile``, pinned alike). Linux only."""

from __future__ import annotations

import contextlib
import os


def cpu_shares(num_workers: int, cpus_per_worker: int, num_cpus: int) -> list[list[int]] | None:
    """Disjoint CPU ids for each of ``num_workers`` CPU workers, ``cpus_per_worker`` apiece in
    order (worker ``i``: ``[i*c, (i+1)*c)``), when they all fit in ``num_cpus``; else None (the
    workers then share cores as the OS schedules them)."""
    c = cpus_per_worker
    if num_workers * c > num_cpus:
        return None
    return [list(range(i * c, (i + 1) * c)) for i in range(num_workers)]


def _threads() -> list[int]:
    """Thread ids of this process."""
    return [int(tid) for tid in os.listdir("/proc/self/task")]


def pin_process(cpus: list[int]) -> None:
    """Pin every thread of this process to ``cpus``: the engine's and torch's threads, the event
    loop, and the gRPC and Ray threads started before this call (``os.sched_setaffinity`` sets one
    thread's mask; threads started later inherit their creator's)."""
    for tid in _threads():
        try:
            os.sched_setaffinity(tid, cpus)
        except ProcessLookupError:  # the thread ended meanwhile
            pass


def process_affinity() -> list[int]:
    """CPU ids any thread of this process may run on."""
    allowed: set[int] = set()
    for tid in _threads():
        try:
            allowed |= os.sched_getaffinity(tid)
        except ProcessLookupError:
            pass
    return sorted(allowed)


@contextlib.contextmanager
def pinned_thread(cpus: list[int]):
    """The calling thread pinned to ``cpus`` for the block (threads it starts meanwhile inherit the
    mask), its own mask restored after."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def worker_cpu(device: str, threads: int | None) -> int | None:
    """The CPU to pin a measurement of one worker's engine to, as ``pdserve serve`` pins a worker of
    one thread (the first of this process's CPUs); None on a GPU, with other thread counts, or off
    Linux. A thread left to move between cores loses its caches: on a 2-core Xeon the decode steps
    of 2-8 rows took 1.2x a pinned thread's (docs/measurements.md)."""
    if device != "cpu" or threads != 1 or not hasattr(os, "sched_setaffinity"):
        return None
    return min(os.sched_getaffinity(0))

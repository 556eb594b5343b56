"""Which cores each CPU worker of one machine is pinned to (``pdserve serve``'s workers, and the
serving probe's of ``pdserve profile``, pinned alike)."""

from __future__ import annotations


def cpu_shares(num_workers: int, cpus_per_worker: int, num_cpus: int) -> list[list[int]] | None:
    """Disjoint CPU ids for each of ``num_workers`` CPU workers, ``cpus_per_worker`` apiece in
    order (worker ``i``: ``[i*c, (i+1)*c)``), when they all fit in ``num_cpus``; else None (the
    workers then share cores as the OS schedules them)."""
    c = cpus_per_worker
    if num_workers * c > num_cpus:
        return None
    return [list(range(i * c, (i + 1) * c)) for i in range(num_workers)]

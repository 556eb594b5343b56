"""How fast the machine is just before each system of ``benchmarks/peers.py`` runs, and what the
report says when that moved: a shared machine drifts (a 2-core VM measured its one-thread read
bandwidth at 12.6, 11.4 and 10.9 GB/s within one hour), and a sweep runs one system after another,
so the later systems may meet a slower machine than the first."""

from __future__ import annotations

DRIFT_NOTE = 0.05  # a probe spread above this share of its largest reading gets a line in the report
GEMM_SHAPE = (256, 768, 3072)  # rows, k, n: a 256-token prompt through a small model's MLP


def machine_probe() -> dict[str, float]:
    """One thread's read bandwidth (``read_gbps``, GB/s: a float32 sum over 512 MiB) and bfloat16
    GEMM rate (``bf16_tflops``, TFLOP/s, the shape ``GEMM_SHAPE`` through pdserve's linear), the
    figures ``pdserve throughput`` bounds its runs with. About a second."""
    import torch

    from pdserve.cli.throughput import matmul_tflops, memory_gbps

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cpu = torch.device("cpu")
        matmul_tflops(*GEMM_SHAPE, torch.bfloat16, cpu)  # untimed: a process's first GEMMs read 15-20 % low
        return {"read_gbps": memory_gbps(cpu), "bf16_tflops": matmul_tflops(*GEMM_SHAPE, torch.bfloat16, cpu)}
    finally:
        torch.set_num_threads(threads)


def probe_note(probes: dict[str, dict[str, float]]) -> list[str]:
    """The report's lines on ``probes`` (system -> ``machine_probe()`` before it): each system's
    figures, and a warning when either figure's spread is over ``DRIFT_NOTE`` of its largest
    reading. [] without probes."""
    if not probes:
        return []
    each = ", ".join(f"{s} {p['read_gbps']:.1f} GB/s, {p['bf16_tflops']:.2f} TFLOP/s" for s, p in probes.items())
    lines = [f"Machine probe just before each system (one thread: read bandwidth, bf16 GEMM at 256 rows): {each}."]
    for key, what in (("read_gbps", "read bandwidth"), ("bf16_tflops", "GEMM rate")):
        values = [p[key] for p in probes.values()]
        spread = (max(values) - min(values)) / max(values)
        if spread > DRIFT_NOTE:
            lines.append(
                f"The machine's {what} moved {spread:.0%} between systems: their rows met different machines; "
                f"compare them with care, or rerun."
            )
    return lines

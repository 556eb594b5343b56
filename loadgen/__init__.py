"""The load generator behind ``pdserve bench`` and ``pdserve compare``: workloads (traces, arrival
processes, prompt sets), the targets it drives (pdserve's gRPC API, any OpenAI-compatible server),
per-request records, serving metrics and plots (no torch, no ray)."""

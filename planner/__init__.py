"""Placement planning from measurements.

``profile`` measures the real engine on this hardware (prefill, decode and mixed step times, and
the KV hand-off over loopback gRPC) and fits a step-time model to the points; ``step_model`` holds
that model (``StepModel``), which answers how long a step or a hand-off takes. ``pdserve profile``
writes the measurement as JSON. Nothing here imports torch at package import time.
"""

"""../shared/datasets, beside the checkout: the traces and prompt sets the loadgen tests read when it is there."""

from __future__ import annotations

from pathlib import Path

DATASETS = Path(__file__).resolve().parents[3] / "shared" / "datasets"

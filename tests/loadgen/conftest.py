"""Fixtures of the loadgen tests: the datasets folder and the traces in it, and the embedded model's tokenizer.

``datasets_dir`` skips a module's tests when the folder of ../shared/datasets that the module names in its
``DATASET`` is absent (the datasets folder itself when the module names none)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.engine.text.tokenizer import Tokenizer
from pdserve.loadgen.workload import TraceRow, load_trace
from tests.loadgen._datasets import DATASETS


@pytest.fixture(scope="module")
def datasets_dir(request) -> Path:
    folder = DATASETS / getattr(request.module, "DATASET", "")
    if not folder.is_dir():
        pytest.skip(f"{folder} is absent")
    return DATASETS


@pytest.fixture(scope="module")
def conv(datasets_dir) -> list[TraceRow]:
    return load_trace("azure-conv", datasets_dir)


@pytest.fixture(scope="module")
def conversation(datasets_dir) -> list[TraceRow]:
    return load_trace("mooncake-conversation", datasets_dir)


@pytest.fixture(scope="module")
def tokenizer(embedded_dir) -> Tokenizer:
    return Tokenizer.from_folder(embedded_dir)

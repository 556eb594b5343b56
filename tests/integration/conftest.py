"""Fixtures of the integration tests: ``datasets`` skips a test that replays a trace when ../shared/datasets is
absent."""

from __future__ import annotations

import pytest

from pdserve.loadgen.dataset_files import dataset_file


@pytest.fixture(scope="module")
def datasets():
    try:
        dataset_file("azure_llm_trace_2023/AzureLLMInferenceTrace_conv.csv")
    except FileNotFoundError:
        pytest.skip("../shared/datasets is absent")

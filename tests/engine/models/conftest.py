"""Fixtures of the tiny-checkpoint layout tests (test_model_layouts.py, test_model_load_errors.py)."""

from __future__ import annotations

import pytest
import torch

from tests.engine.models._layout_cases import Case, _spec, _to_legacy
from tests.engine.models._tiny_models import build_model


@pytest.fixture(scope="module")
def _one_thread():
    """The models are tiny: one intra-op thread is fastest and avoids oversubscribing shared cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    built: dict[str, Case] = {}

    def get(name: str) -> Case:
        if name not in built:
            folder = tmp_path_factory.mktemp(name)
            if name.startswith("legacy_"):
                model_cls, config, kwargs = _spec(name.removeprefix("legacy_"))
                build_model(folder, model_cls, config, **kwargs)
                _to_legacy(folder)
            else:
                model_cls, config, kwargs = _spec(name)
                build_model(folder, model_cls, config, **kwargs)
            built[name] = Case(name, folder)
        return built[name]

    return get

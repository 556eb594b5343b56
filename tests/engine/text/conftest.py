"""Tokenizer folders for the text tests: stories260K (when ../shared has it) and a byte-level BPE
tokenizer built here; ``any_dir`` runs a test on each."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.engine.text.tokenizer import Tokenizer
from tests.engine.text._tokenizers import build_bytelevel, stories_folder


@pytest.fixture(scope="session")
def stories_dir() -> Path:
    return stories_folder()


@pytest.fixture(scope="session")
def bytelevel_dir(tmp_path_factory) -> Path:
    return build_bytelevel(tmp_path_factory.mktemp("bytelevel"))


@pytest.fixture(scope="session", params=["stories", "bytelevel"])
def any_dir(request) -> Path:
    return request.getfixturevalue(f"{request.param}_dir")


@pytest.fixture(scope="module")
def tok(any_dir):
    return Tokenizer.from_folder(any_dir)

"""The weights digest in every worker's model fingerprint: computed once per file set, cached, and
the same for workers that start side by side on a folder no one has hashed yet."""

from __future__ import annotations

import hashlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from pdserve.engine.models.loader import weights_hash


@pytest.fixture
def folder(tmp_path) -> Path:
    d = tmp_path / "model"
    d.mkdir()
    (d / "model-00001.safetensors").write_bytes(b"a" * 3_000_000)
    (d / "model-00002.safetensors").write_bytes(b"b" * 5_000_000)
    return d


def expected(folder: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(folder.glob("*.safetensors")):
        h.update(p.name.encode())
        h.update(p.read_bytes())
    return h.hexdigest()


def test_the_digest_covers_names_and_bytes_and_is_cached(folder, tmp_path):
    cache = tmp_path / "cache"
    assert weights_hash(folder, cache) == expected(folder)
    (cached,) = (cache / "weights-hash").iterdir()
    assert cached.read_text() == expected(folder)
    assert weights_hash(folder, cache) == expected(folder)


def test_a_malformed_cached_digest_is_recomputed(folder, tmp_path):
    cache = tmp_path / "cache"
    weights_hash(folder, cache)
    (cached,) = (cache / "weights-hash").iterdir()
    for bad in ("", "0123", "z" * 64):  # a half-written file, a cut one, garbage
        cached.write_text(bad)
        assert weights_hash(folder, cache) == expected(folder)


def test_workers_starting_side_by_side_agree(folder, tmp_path):
    for attempt in range(5):  # each attempt on a cold cache
        cache = tmp_path / f"cache{attempt}"
        with ThreadPoolExecutor(8) as pool:
            digests = set(pool.map(weights_hash, [folder] * 16, [cache] * 16))
        assert digests == {expected(folder)}
        assert [p.suffix for p in (cache / "weights-hash").iterdir()] == [""]  # no temporary file left

"""Where the load generator finds its dataset files: traces and prompt sets under one folder.

The folder is ``--datasets-dir`` when given, else ``$PDSERVE_DATASETS``, else the first existing of a
few places near the source tree and the working directory (:func:`default_datasets_dirs`).
:func:`dataset_file` resolves a path under it and, when the file is absent, raises a
FileNotFoundError that says where it looked and how to point elsewhere.
"""

from __future__ import annotations

import os
from pathlib import Path

DATASETS_ENV = "PDSERVE_DATASETS"


def resolve_datasets_dir(datasets_dir: str | Path | None = None) -> Path:
    """The datasets folder: ``datasets_dir`` if given, else ``$PDSERVE_DATASETS``, else the first
    existing of ``<source tree>/../shared/datasets``, ``./shared/datasets`` and ``../shared/datasets``
    (relative to the working directory, for an installed package run from a checkout)."""
    if datasets_dir is not None:
        return Path(datasets_dir)
    env = os.environ.get(DATASETS_ENV)
    if env:
        return Path(env)
    candidates = default_datasets_dirs()
    return next((c for c in candidates if c.is_dir()), candidates[0])


def default_datasets_dirs() -> list[Path]:
    """Where the datasets folder is looked for when neither a folder nor ``$PDSERVE_DATASETS`` is given."""
    return [
        Path(__file__).resolve().parent.parent.parent / "shared" / "datasets",
        Path.cwd() / "shared" / "datasets",
        Path.cwd().parent / "shared" / "datasets",
    ]


def dataset_file(relative: str, datasets_dir: str | Path | None = None) -> Path:
    """``relative`` under the datasets folder; FileNotFoundError (saying how to point elsewhere) if absent."""
    path = resolve_datasets_dir(datasets_dir) / relative
    searched = [] if datasets_dir is not None or os.environ.get(DATASETS_ENV) else default_datasets_dirs()
    if not path.is_file() and searched and not any(c.is_dir() for c in searched):
        raise FileNotFoundError(
            f"dataset file {relative} not found: no datasets folder at "
            f"{', '.join(str(c) for c in searched)}; point at it with --datasets-dir "
            f"(or the {DATASETS_ENV} environment variable)"
        )
    if not path.is_file():
        raise FileNotFoundError(
            f"dataset file {path} not found; point at the datasets folder with --datasets-dir "
            f"(or the {DATASETS_ENV} environment variable)"
        )
    return path

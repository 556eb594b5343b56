"""The results folder a command writes (``--out``): made and checked before the work, and taken
away again when the command fails before writing anything into a folder it made."""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path


def prepare_out_dir(out: str) -> Path:
    """The folder ``--out`` names, created (parents too) and checked writable before any request is
    sent. ValueError (one line) when it cannot be created or written."""
    path = Path(out)
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        raise ValueError(f"cannot write results to --out {out}: {exc.strerror or exc}") from None
    return path


def drops_empty_out(cmd):
    """Decorate a command (``cmd(args)``, ``args.out`` its results folder): when it raises (an
    error, Ctrl-C), the folders ``--out`` made that are still empty are removed, so a failed run
    leaves no empty timestamped folder behind."""

    @functools.wraps(cmd)
    def run(args):
        path = Path(args.out).absolute()
        made = [p for p in (path, *path.parents) if not p.exists()]  # leaf first
        try:
            return cmd(args)
        except BaseException:
            for folder in made:
                try:
                    folder.rmdir()  # only an empty folder goes
                except OSError:
                    break
            raise

    return run

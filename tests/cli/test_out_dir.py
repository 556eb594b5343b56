"""A failed command leaves no empty results folder behind (``cli/out_dir.py``)."""

from __future__ import annotations

import argparse

import pytest

from pdserve.cli.out_dir import drops_empty_out, prepare_out_dir


def command(fail: bool, write: bool = False):
    @drops_empty_out
    def cmd(args) -> int:
        path = prepare_out_dir(args.out)
        if write:
            (path / "partial.jsonl").write_text("{}\n")
        if fail:
            raise ValueError("a mistake found after the folder was made")
        return 0

    return cmd


def test_a_failure_removes_the_folders_it_made(tmp_path):
    out = tmp_path / "results" / "20261207-120000"
    with pytest.raises(ValueError):
        command(fail=True)(argparse.Namespace(out=str(out)))
    assert not (tmp_path / "results").exists() and tmp_path.exists()


def test_a_success_a_folder_with_files_and_a_folder_there_before_are_kept(tmp_path):
    out = tmp_path / "results" / "run"
    assert command(fail=False)(argparse.Namespace(out=str(out))) == 0 and out.is_dir()
    with pytest.raises(ValueError):  # there before: kept, though empty
        command(fail=True)(argparse.Namespace(out=str(out)))
    assert out.is_dir()
    other = tmp_path / "other"
    with pytest.raises(ValueError):  # written into: kept, with what was written
        command(fail=True, write=True)(argparse.Namespace(out=str(other)))
    assert (other / "partial.jsonl").exists()


def test_ctrl_c_removes_it_too(tmp_path):
    @drops_empty_out
    def cmd(args) -> int:
        prepare_out_dir(args.out)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        cmd(argparse.Namespace(out=str(tmp_path / "x")))
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--router", "127.0.0.1:1"], "error: no router answers at 127.0.0.1:1"),
        (["--backend", "openai"], "error: --backend openai needs --url"),
    ],
)
def test_a_bench_that_reaches_no_server_leaves_no_folder(args, needle, tmp_path, capsys):
    from pdserve.cli.main import main

    out = tmp_path / "bench_results" / "run"
    flow = ["--prompts", "random", "--arrival", "poisson", "--rate", "1", "--num-requests", "2", "--input-len", "8"]
    assert main(["bench", *args, *flow, "--output-len", "4", "--out", str(out)]) == 2
    assert capsys.readouterr().err.startswith(needle)
    assert not (tmp_path / "bench_results").exists()

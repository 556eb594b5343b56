"""A flag given a word where it takes a number names what it expected, not the parser's own name
(argparse prints a type function's ``__name__`` for a plain ValueError: "invalid positive_float value")."""

from __future__ import annotations

import pytest

from pdserve.cli.main import main


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["serve", "--kv-cache-gib", "abc"], "argument --kv-cache-gib: expected a number, got 'abc'"),
        (["serve", "--max-num-seqs", "1.5"], "argument --max-num-seqs: expected an integer, got '1.5'"),
        (["serve", "--port", "http"], "argument --port: expected an integer, got 'http'"),
        (["serve", "--kv-cache-gib", "0"], "argument --kv-cache-gib: must be a finite number > 0, got 0"),
        (["bench", "--temperature", "-1"], "argument --temperature: must be a number >= 0, got -1"),
        (["generate", "--temperature", "nan"], "argument --temperature: must be a number >= 0, got nan"),
    ],
)
def test_a_word_for_a_number_is_named(argv, expected, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and expected in err, err
    assert "invalid" not in err

"""``pdserve bench`` from the command line: flag checks, the synthetic fallback, the output folder
and the summary, against a stand-in backend (no server)."""

from __future__ import annotations

import argparse
import json
import time

import pytest

from pdserve.cli import bench as cli
from pdserve.cli.main import main
from pdserve.cli.out_dir import prepare_out_dir
from pdserve.engine.text.tokenizer import Tokenizer
from pdserve.loadgen.args import build_specs, fall_back_without_datasets, slo_from_args
from pdserve.loadgen.dataset_files import DATASETS_ENV
from pdserve.loadgen.metrics import SLO, RequestRecord, summarize
from pdserve.loadgen.prompt_datasets import PROMPT_SETS
from pdserve.loadgen.prompts import make_prompt_pool
from pdserve.loadgen.targets import ServerInfo

# the command a new user ran against an OpenAI-compatible server, with no datasets folder anywhere
USER_COMMAND = (
    "bench",
    "--backend",
    "openai",
    "--url",
    "http://127.0.0.1:8000",
    "--input-len",
    "16",
    "--output-len",
    "4",
    "--rate",
    "2",
    "--num-requests",
    "2",
    "--prompts",
    "random",
)


def _bench_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_bench_parser(parser.add_subparsers())
    return parser.parse_args(list(argv))


@pytest.fixture
def no_datasets(tmp_path, monkeypatch):
    """No datasets folder: $PDSERVE_DATASETS names one that is not there."""
    monkeypatch.setenv(DATASETS_ENV, str(tmp_path / "absent"))


class FakeBackend:
    """Answers ``info()`` and every request: ``error`` set fails each one, else exactly its tokens."""

    name = "openai"

    def __init__(self, error: str = "") -> None:
        self.error, self.sent, self.connected = error, [], False

    async def __aenter__(self):
        self.connected = True
        return self

    async def __aexit__(self, *exc) -> None:
        pass

    async def info(self) -> ServerInfo:
        return ServerInfo("stand-in", 4096, "openai")

    async def prefix_counters(self) -> None:
        return None

    async def send(self, spec, rec, t0, timeout_s, temperature) -> None:
        self.sent.append(spec)
        if self.error:
            rec.finish_reason, rec.error = "error", self.error
            return
        rec.token_times_s = [time.perf_counter() - t0] * spec.max_tokens
        rec.finish_reason = "length"


@pytest.fixture
def backend(monkeypatch):
    """Install a FakeBackend as the one ``pdserve bench`` drives; set ``.error`` to fail its requests."""
    fake = FakeBackend()
    monkeypatch.setattr(cli, "make_backend", lambda args: fake)
    return fake


# --- 1. --prompts random needs no dataset ------------------------------------------------------------


def test_random_prompts_without_datasets_fall_back_to_synthetic_arrivals(no_datasets, embedded_dir):
    args = _bench_args(*USER_COMMAND)
    note = fall_back_without_datasets(args)
    assert note is not None and "poisson arrivals" in note
    assert (args.arrival, args.rate, args.prompts, args.input_len, args.output_len) == ("poisson", 2.0, "random", 16, 4)
    specs = build_specs(args, Tokenizer.from_folder(embedded_dir), 4096, args.rate)
    assert [(len(s.prompt_token_ids), s.max_tokens, s.prompt_source) for s in specs] == [(16, 4, "random")] * 2


def test_random_prompts_without_datasets_run_end_to_end(no_datasets, embedded_dir, backend, tmp_path, capsys):
    out = tmp_path / "out"
    assert main([*USER_COMMAND, "--tokenizer", str(embedded_dir), "--out", str(out)]) == 0
    printed = capsys.readouterr()
    assert "no datasets folder found" in printed.out and "not found" not in printed.err
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [(r["prompt_tokens"], r["output_tokens"], r["ok"]) for r in records] == [(16, 4, True)] * 2


def test_trace_arrivals_named_without_datasets_say_what_needs_the_trace(no_datasets, embedded_dir):
    args = _bench_args(*USER_COMMAND, "--arrival", "trace")
    assert fall_back_without_datasets(args) is None  # named: not replaced
    with pytest.raises(FileNotFoundError) as info:
        build_specs(args, Tokenizer.from_folder(embedded_dir), 4096, args.rate)
    message = str(info.value)
    assert "arrival times (--arrival trace" in message and "--arrival poisson" in message
    assert "request lengths" not in message  # both lengths are fixed


def test_missing_trace_for_lengths_says_so(embedded_dir, tmp_path):
    args = _bench_args(
        "bench",
        "--arrival",
        "poisson",
        "--rate",
        "2",
        "--output-len",
        "4",
        "--prompts",
        "random",
        "--datasets-dir",
        str(tmp_path),
    )
    with pytest.raises(FileNotFoundError, match=r"request lengths \(--input-len with --output-len") as info:
        build_specs(args, Tokenizer.from_folder(embedded_dir), 4096, args.rate)
    assert "arrival times" not in str(info.value)


def test_a_missing_trace_is_named_before_any_request(backend, tmp_path, capsys):
    missing = str(tmp_path / "missing.csv")
    assert main(["bench", "--router", "127.0.0.1:1", "--trace", missing, "--num-requests", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: trace '{missing}' is neither a file") and "arrival times" in err
    assert not backend.sent and not backend.connected


# --- 2. an unknown prompt set is refused before anything is read --------------------------------------


def test_unknown_prompt_set_is_a_parse_error_listing_random(no_datasets, backend, capsys):
    with pytest.raises(SystemExit) as info:
        main(["bench", "--prompts", "nosuchset", "--out", "unused"])
    assert info.value.code == 2 and not backend.sent
    err = capsys.readouterr().err
    assert "argument --prompts: unknown prompt set(s) nosuchset" in err and "not found" not in err
    valid = err.split("valid: ", 1)[1].split()
    assert [v.rstrip(",") for v in valid] == [*PROMPT_SETS, "random"]


@pytest.mark.parametrize("value,expected", [(" vicuna, mt-bench ", "vicuna,mt-bench"), ("random", "random")])
def test_prompt_sets_are_normalized(value, expected):
    assert _bench_args("bench", "--prompts", value).prompts == expected


@pytest.mark.parametrize("value,message", [("random,vicuna", "cannot be mixed"), (",", "none given")])
def test_bad_prompt_set_lists_are_parse_errors(value, message, capsys):
    with pytest.raises(SystemExit):
        _bench_args("bench", "--prompts", value)
    assert message in capsys.readouterr().err


def test_make_prompt_pool_checks_names_before_reading(embedded_dir, tmp_path):
    with pytest.raises(ValueError, match=r"unknown prompt set\(s\) nosuchset; valid: .*, random$"):
        make_prompt_pool("vicuna,nosuchset", Tokenizer.from_folder(embedded_dir), 0, tmp_path / "absent")


# --- 3. a run in which every request failed ----------------------------------------------------------


def _failed(index: int, error: str) -> RequestRecord:
    return RequestRecord(
        index=index,
        request_id=f"bench-{index}",
        scheduled_s=0.0,
        sent_s=0.0,
        prompt_tokens=16,
        max_tokens=4,
        finish_reason="error",
        error=error,
    )


def test_summary_of_a_run_with_no_success_names_the_errors(capsys):
    records = [_failed(0, "ConnectError: refused"), _failed(1, "ConnectError: refused"), _failed(2, "HTTP 500: x")]
    cli.print_summary(summarize(records), "openai @ 2 req/s", cli.first_errors(records))
    out = capsys.readouterr().out
    assert "no request succeeded (3 of 3 failed)" in out
    assert "first errors: ConnectError: refused | HTTP 500: x" in out
    assert "nan" not in out and "ttft" not in out


def test_first_errors_are_distinct_and_few():
    records = [_failed(i, f"e{i % 4}") for i in range(8)]
    aborted = RequestRecord(index=9, request_id="bench-9", scheduled_s=0.0, prompt_tokens=1, max_tokens=1)
    aborted.finish_reason = "abort"
    records.append(aborted)
    assert cli.first_errors(records) == ["e0", "e1", "e2"]
    assert cli.first_errors(records[8:]) == ["finished with reason 'abort'"]


def test_bench_where_every_request_fails_exits_1_with_the_error(no_datasets, embedded_dir, backend, tmp_path, capsys):
    backend.error = "HTTP 503: overloaded"
    assert main([*USER_COMMAND, "--tokenizer", str(embedded_dir), "--out", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "no request succeeded (2 of 2 failed); first error: HTTP 503: overloaded" in out
    assert "nan" not in out
    assert json.loads((tmp_path / "summary.json").read_text())["failed"] == 2


# --- 4. the output folder is checked before any request ---------------------------------------------


@pytest.mark.parametrize("where", ["/proc/nope", "file/under-a-file"])
def test_unwritable_out_fails_before_any_request(where, no_datasets, embedded_dir, backend, tmp_path, capsys):
    (tmp_path / "file").write_text("")
    out = where if where.startswith("/") else str(tmp_path / where)
    assert main([*USER_COMMAND, "--tokenizer", str(embedded_dir), "--out", out]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: cannot write results to --out {out}: ") and "\n" not in err
    assert not backend.sent


def test_out_folder_is_created_before_the_run(tmp_path):
    out = tmp_path / "a" / "b"
    assert prepare_out_dir(str(out)) == out and out.is_dir() and not any(out.iterdir())


# --- 5. the SLOs go together -----------------------------------------------------------------------


@pytest.mark.parametrize("given,missing", [("--slo-ttft-ms", "--slo-tpot-ms"), ("--slo-tpot-ms", "--slo-ttft-ms")])
def test_one_slo_alone_is_refused_before_any_request(given, missing, backend, embedded_dir, capsys):
    assert main([*USER_COMMAND, "--tokenizer", str(embedded_dir), given, "100"]) == 2
    err = capsys.readouterr().err.strip()
    assert (
        err == f"error: {given} needs {missing} too: goodput counts the requests that meet both SLOs, so "
        f"give both or neither"
    )
    assert not backend.sent


def test_both_slos_or_neither():
    assert slo_from_args(_bench_args("bench", "--slo-ttft-ms", "100", "--slo-tpot-ms", "20")) == SLO(0.1, 0.02)
    assert slo_from_args(_bench_args("bench")) is None


# --- 6. --url must be a URL --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "url",
    [
        "notaurl",
        "127.0.0.1:8000",
        "localhost:8000",
        "ftp://127.0.0.1:21",
        "http://",
        "http://127.0.0.1:notaport",
        "http://127.0.0.1:99999",
    ],
)
def test_invalid_url_is_refused_as_such(url, backend, capsys):
    with pytest.raises(SystemExit) as info:
        main(["bench", "--backend", "openai", "--url", url])
    assert info.value.code == 2 and not backend.sent
    err = capsys.readouterr().err
    assert f"argument --url: invalid URL {url!r}" in err and "non-loopback" not in err


@pytest.mark.parametrize("url", ["http://127.0.0.1:8000", "https://[::1]:8443/", "http://localhost"])
def test_valid_urls_parse(url):
    assert _bench_args("bench", "--backend", "openai", "--url", url).url == url


def test_a_valid_remote_url_still_needs_allow_remote(backend, capsys):
    assert main(["bench", "--backend", "openai", "--url", "http://192.0.2.1:8000"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "error: refusing to load-test non-loopback address http://192.0.2.1:8000 (pass --allow-remote)"
    assert not backend.sent and not backend.connected

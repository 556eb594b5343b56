"""``pdserve generate`` as a user runs it: flags refused with the flag named and its range, prompts
that are not UTF-8, top_k as the router and the HTTP API take it, and Ctrl-C mid-stream against a
gRPC GenerateService on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
import shlex
import signal
import subprocess
import sys

import pytest

from pdserve.cli.main import build_parser, main
from pdserve.engine.text.tokenizer import Tokenizer
from pdserve.router.client import make_request
from pdserve.router.openai_protocol import BadRequest, CompletionRequest, parse
from pdserve.router.validation import InvalidRequest, validate
from pdserve.rpc.server import start_server
from pdserve.v1 import generate_pb2 as PB
from pdserve.v1 import generate_pb2_grpc

# main() with SIGINT raising KeyboardInterrupt, as in a terminal, whatever this process inherited
PDSERVE = [
    sys.executable,
    "-c",
    "import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "from pdserve.cli.main import main; sys.exit(main(sys.argv[1:]))",
]
TOP_K_REFUSED = "must be >= -1 (-1 or 0 disables), got -2"


def refusal(capsys, *argv: str) -> str:
    """The last stderr line of ``pdserve generate hi ARGV`` refused while parsing its flags."""
    with pytest.raises(SystemExit) as info:
        main(["generate", "hi", *argv])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


@pytest.mark.parametrize(
    "argv, line",
    [
        (
            ["--max-tokens", "99999999999999999999999"],
            "argument --max-tokens: must be in 1..4294967295, got 99999999999999999999999",
        ),
        (["--max-tokens", "0"], "argument --max-tokens: must be >= 1, got 0"),
        (["--port", "0"], "argument --port: must be in 1..65535 (the router's port), got 0"),
        (["--max-tokens", "lots"], "argument --max-tokens: invalid integer value: 'lots'"),
        (["--seed", str(1 << 64)], f"argument --seed: must be in 0..{(1 << 64) - 1}, got {1 << 64}"),
        (["--top-k", str(1 << 31)], f"argument --top-k: must be in -1..{(1 << 31) - 1}, got {1 << 31}"),
        (["--top-k", "-2"], f"argument --top-k: {TOP_K_REFUSED}"),
        (["--stop", "\udcfe"], "argument --stop: is not valid UTF-8 text: byte 0xfe at byte 0 is not part"),
    ],
)
def test_a_flag_out_of_range_is_named_with_its_range(capsys, argv, line):
    assert f"pdserve generate: error: {line}" in refusal(capsys, *argv)


@pytest.mark.parametrize(
    "prompt, words",
    [
        (b"caf\xe9 au lait", "byte 0xe9 at byte 3 is not part of a UTF-8 character"),  # a Latin-1 prompt file
        ("ab\udcff".encode("utf-8", "surrogatepass"), "byte 0xed at byte 2"),  # bash's $'ab\udcff'
    ],
)
def test_a_prompt_that_is_not_utf8_says_so(prompt, words):
    run = subprocess.run([*PDSERVE, "generate", prompt, "--port", "1"], capture_output=True, timeout=60)
    err = run.stderr.decode("utf-8", "replace")
    assert run.returncode == 2, err
    assert f"argument prompt: is not valid UTF-8 text: {words}" in err
    assert "codec" not in err and "Traceback" not in err


def test_top_k_minus_one_and_zero_disable_top_k_in_the_cli_the_router_and_the_http_api(capsys, embedded_dir):
    tok = Tokenizer.from_folder(embedded_dir)
    for top_k in ("-1", "0"):
        args = build_parser().parse_args(["generate", "hi", "--top-k", top_k])
        request = make_request(args.prompt, max_tokens=args.max_tokens, top_k=args.top_k)
        assert validate(request, tok, 2048, tok.vocab_size).sampling.top_k == 0
        over_http = parse(CompletionRequest, json.dumps({"prompt": "hi", "top_k": int(top_k)})).to_generate_request()
        assert validate(over_http, tok, 2048, tok.vocab_size).sampling.top_k == 0
    assert refusal(capsys, "--top-k", "-2").endswith(TOP_K_REFUSED)
    with pytest.raises(InvalidRequest) as grpc_refusal:
        validate(make_request("hi", top_k=-2), tok, 2048, tok.vocab_size)
    assert str(grpc_refusal.value) == f"top_k {TOP_K_REFUSED}"
    with pytest.raises(BadRequest) as http_refusal:
        parse(CompletionRequest, json.dumps({"prompt": "hi", "top_k": -2}))
    assert str(http_refusal.value) == f"top_k {TOP_K_REFUSED}"


class Endless(generate_pb2_grpc.GenerateServiceServicer):
    """Streams one chunk of text with no newline, then nothing more until the call ends."""

    async def Generate(self, request, context):
        yield PB.GenerateResponse(chunk=PB.Chunk(token_ids=[1, 2], text="Once upon"))
        await asyncio.Event().wait()


async def test_ctrl_c_mid_line_prints_interrupted_on_a_line_of_its_own():
    server, port = await start_server(
        [(generate_pb2_grpc.add_GenerateServiceServicer_to_server, Endless(), "pdserve.v1.GenerateService")]
    )
    proc = await asyncio.create_subprocess_exec(
        *PDSERVE,
        "generate",
        "hi",
        "--router",
        f"127.0.0.1:{port}",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    try:
        seen = b""
        while b"Once upon" not in seen:
            chunk = await asyncio.wait_for(proc.stdout.read(4096), 60)
            assert chunk, seen
            seen += chunk
        proc.send_signal(signal.SIGINT)
        seen += await asyncio.wait_for(proc.stdout.read(), 60)
        assert await asyncio.wait_for(proc.wait(), 60) == 130
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        await server.stop(0)
    assert seen.decode() == "Once upon\ninterrupted\n"


class Chatty(generate_pb2_grpc.GenerateServiceServicer):
    """Streams a line of text every millisecond until the call ends (at most 30 s)."""

    async def Generate(self, request, context):
        for _ in range(30_000):
            yield PB.GenerateResponse(chunk=PB.Chunk(token_ids=[1], text="Once upon a time\n"))
            await asyncio.sleep(0.001)


async def test_a_reader_that_goes_away_ends_it_quietly(tmp_path):
    server, port = await start_server(
        [(generate_pb2_grpc.add_GenerateServiceServicer_to_server, Chatty(), "pdserve.v1.GenerateService")]
    )
    err, status = tmp_path / "stderr", tmp_path / "status"
    command = shlex.join([*PDSERVE, "generate", "hi", "--router", f"127.0.0.1:{port}"])
    pipeline = f"{command} 2>{err} | head -c 20; echo ${{PIPESTATUS[0]}} >{status}"
    proc = await asyncio.create_subprocess_exec("bash", "-c", pipeline, stdout=asyncio.subprocess.PIPE)
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), 60)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        await server.stop(0)
    assert out == b"Once upon a time\nOnc"
    assert "Traceback" not in err.read_text() and "BrokenPipe" not in err.read_text(), err.read_text()
    assert status.read_text().strip() == "141"

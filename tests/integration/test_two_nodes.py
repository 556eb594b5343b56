"""Two Ray nodes, for real: a Ray head and a Ray worker node in two network namespaces joined by a veth
pair (``pdserve.cluster.netns``; Ray token auth on both), and ``pdserve serve --address HEAD:6379``
with prefill pinned to the head and decode to the worker node, so every KV cache crosses the link.

Greedy output equals the transformers reference; a cross-node internal call (worker stats) without
the cluster secret is UNAUTHENTICATED and with it answers (the KV pushes carry it too, or no output
would come back); after the remote decode worker's process is SIGKILLed, new requests succeed again
within 30 s. Skips where network namespaces cannot be made (not root, no iproute2, a refusing kernel).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import hf_greedy, mixed_prompts

pytest.importorskip("ray")
pytestmark = pytest.mark.timeout(300)

CLIENT = Path(__file__).with_name("_two_nodes_client.py")
SERVING = re.compile(r"serving on (\S+) \(gRPC\).*\(workers: (.*)\); Ctrl-C")
RECOVERED = re.compile(r"decode worker recovered: (\S+) replaces (\S+),")
SERVE_START_S = 180.0  # two Ray nodes and two workers on 2 cores
CLIENT_TIMEOUT_S = 90.0
RECOVERY_S = 30.0
MAX_TOKENS = 16
PROMPTS = mixed_prompts()[:7]  # a few tokens up to a few hundred, English and Chinese


@pytest.fixture(scope="module")
def nodes():
    from pdserve.cluster.netns import NetnsUnavailable, make_namespaces, start_ray_nodes

    try:
        made = make_namespaces()
    except NetnsUnavailable as exc:
        pytest.skip(f"network namespaces cannot be made here: {exc}")
    try:
        start_ray_nodes(made)
        yield made
    finally:
        made.close()


class Serve:
    """``pdserve serve`` in the head's namespace, its output collected line by line."""

    def __init__(self, nodes, model: str, secret: str) -> None:
        from pdserve.cluster.netns import DECODE_RESOURCE, PREFILL_RESOURCE

        env = nodes.env(PDSERVE_CLUSTER_SECRET=secret)
        env.pop("PDSERVE_API_KEY", None)
        self.lines: list[str] = []
        self.proc = nodes.popen(nodes.head_ns, [
            sys.executable, "-m", "pdserve.cluster.cli", "serve", "--model", model, "--dtype", "float32",
            "--address", nodes.head_address, "--port", "0", "--http-port", "0",
            "--prefill-resource", PREFILL_RESOURCE, "--decode-resource", DECODE_RESOURCE],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    def log_tail(self) -> str:
        return "".join(self.lines[-40:])

    def wait_for(self, pattern: re.Pattern, timeout_s: float) -> re.Match:
        """The first output line matching ``pattern``; fails past ``timeout_s`` or when serve exits."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if m := pattern.search(line):
                    return m
            if self.proc.poll() is not None:
                pytest.fail(f"pdserve serve exited ({self.proc.returncode}):\n{self.log_tail()}")
            time.sleep(0.2)
        pytest.fail(f"no {pattern.pattern!r} from pdserve serve after {timeout_s:.0f}s:\n{self.log_tail()}")

    def stop(self) -> None:
        """Ctrl-C-like stop (SIGTERM), SIGKILL after 30 s."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def _client(nodes, ns: str, router: str, secret: str, stats: list[str], call_timeout_s: float,
            until_ok_s: float = 0.0) -> dict:
    """Run _two_nodes_client.py inside ``ns``; its JSON result. Seconds: per request, and to keep retrying."""
    env = nodes.env(PDSERVE_CLUSTER_SECRET=secret)
    res = nodes.run(ns, [sys.executable, str(CLIENT), router, "--prompts", json.dumps(PROMPTS),
                         "--max-tokens", str(MAX_TOKENS), "--call-timeout", str(call_timeout_s),
                         "--until-ok", str(until_ok_s), "--stats", *stats],
                    timeout_s=CLIENT_TIMEOUT_S, env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_prefill_and_decode_on_two_ray_nodes(nodes, embedded_dir):
    from pdserve.engine.text.tokenizer import Tokenizer

    secret = secrets.token_hex(32)
    serve = Serve(nodes, str(embedded_dir), secret)
    try:
        m = serve.wait_for(SERVING, SERVE_START_S)
        router = m[1]
        workers = {role: address for role, address in (w.split("@") for w in m[2].split(", "))}
        # prefill on the head, decode on the worker node: the KV crosses the veth pair
        assert workers["prefill"].startswith(f"{nodes.head_ip}:"), m[0]
        assert workers["decode"].startswith(f"{nodes.worker_ip}:"), m[0]
        tok = Tokenizer.from_folder(embedded_dir)
        expected = [hf_greedy(embedded_dir, tok.encode(p), MAX_TOKENS) for p in PROMPTS]

        # a caller in the head's namespace: greedy output; decode's stats (on the other node) want the secret
        out = _client(nodes, nodes.head_ns, router, secret, stats=[workers["decode"]], call_timeout_s=60.0)
        assert out["tokens"] == expected, f"{out}\n{serve.log_tail()}"
        assert out["stats"][workers["decode"]] == ["UNAUTHENTICATED", "OK"]

        # SIGKILL the remote decode worker's process; new requests succeed again within 30 s
        pids = nodes.pids_titled(nodes.worker_ns, "ray::WorkerActor")
        assert len(pids) == 1, pids
        os.kill(pids[0], signal.SIGKILL)
        killed_at = time.time()  # the client's clock: the same machine's
        out = _client(nodes, nodes.worker_ns, router, secret, stats=[workers["prefill"]],
                      call_timeout_s=10.0, until_ok_s=RECOVERY_S)
        assert out["tokens"] == expected, f"not serving again after {RECOVERY_S:.0f}s: {out}\n{serve.log_tail()}"
        assert out["ok_at"] - killed_at < RECOVERY_S, out
        assert out["stats"][workers["prefill"]] == ["UNAUTHENTICATED", "OK"]
        new, old = serve.wait_for(RECOVERED, 10.0).groups()
        assert old == workers["decode"] and new.startswith(f"{nodes.worker_ip}:")  # Ray kept it on its node
        assert serve.proc.poll() is None
    finally:
        serve.stop()
    assert serve.proc.returncode == 0, serve.log_tail()


def test_role_resources_pin_split_roles_only():
    from pdserve.cluster.config import ClusterConfig
    from pdserve.engine.config import EngineConfig

    engine = EngineConfig(model="embedded")
    cfg = ClusterConfig(engine=engine, prefill_resource="pdserve_prefill", decode_resource="pdserve_decode")
    assert cfg.role_resources("prefill") == {"pdserve_prefill": 1.0}
    assert cfg.role_resources("decode") == {"pdserve_decode": 1.0}
    assert ClusterConfig(engine=engine).role_resources("decode") == {}
    with pytest.raises(ValueError, match="colocated"):
        ClusterConfig(engine=engine, placement="colocated", decode_resource="pdserve_decode")


def test_two_node_soak_makes_its_own_cluster(capsys):
    from pdserve.cluster.cli import main

    assert main(["soak", "--two-nodes", "--address", "10.0.0.1:6379"]) == 2
    assert "--two-nodes makes its own Ray cluster" in capsys.readouterr().err

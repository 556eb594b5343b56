"""Two Ray nodes, for real: a Ray head and a Ray worker node in two network namespaces joined by a veth
pair (``pdserve.soak.netns``; Ray token auth on both), and ``pdserve serve --address HEAD:6379``
with prefill pinned to the head and decode to the worker node, so every KV cache crosses the link.

Greedy output equals the transformers reference; a cross-node internal call (worker stats) without
the cluster secret is UNAUTHENTICATED and with it answers (the KV pushes carry it too, or no output
would come back); after the remote decode worker's process is SIGKILLed, new requests succeed again
within 30 s. Link faults between the nodes (``pdserve.soak.link_chaos``: a slow link, loss,
delay where netem exists, cuts of 5, 15 and 35 s while KV is in flight): every request ends with
its tokens or a clear error within its bound, none hangs, no KV block leaks (``pytest -s`` prints
the table). A call on a connection its server dropped during a cut ends within the keepalive bound
instead of waiting for its deadline. Skips where network namespaces cannot be made (not root, no
iproute2, a refusing kernel).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import hf_greedy, mixed_prompts

pytest.importorskip("ray")
pytestmark = pytest.mark.timeout(300)

CLIENT = Path(__file__).with_name("_two_nodes_client.py")
PROBE = Path(__file__).with_name("_link_probe.py")
RECOVERED = re.compile(r"decode worker recovered: (\S+) replaces (\S+),")
SERVE_START_S = 180.0  # two Ray nodes and two workers on 2 cores
CLIENT_TIMEOUT_S = 90.0
RECOVERY_S = 30.0
MAX_TOKENS = 16
PROBE_PORT, PROBE_CUT_S = 50_051, 25.0
PROBE_BOUND_S = 35.0  # keepalive: a ping every 10 s, answered within 20 s (rpc/server.py), and slack
PROMPTS = mixed_prompts()[:7]  # a few tokens up to a few hundred, English and Chinese


@pytest.fixture(scope="module")
def nodes():
    from pdserve.soak.netns import NetnsUnavailable, make_namespaces
    from pdserve.soak.ray_nodes import start_ray_nodes

    try:
        made = make_namespaces()
    except NetnsUnavailable as exc:
        pytest.skip(f"network namespaces cannot be made here: {exc}")
    try:
        start_ray_nodes(made)
        yield made
    finally:
        made.close()


def _serve(nodes, model: str, secret: str):
    """``pdserve serve`` (float32) in the head's namespace."""
    from pdserve.soak.link_chaos import ServeOnTwoNodes

    env = nodes.env(PDSERVE_CLUSTER_SECRET=secret)
    env.pop("PDSERVE_API_KEY", None)
    return ServeOnTwoNodes(nodes, ["--model", model, "--dtype", "float32", "--port", "0", "--http-port", "0"], env)


def _client(
    nodes, ns: str, router: str, secret: str, stats: list[str], call_timeout_s: float, until_ok_s: float = 0.0
) -> dict:
    """Run _two_nodes_client.py inside ``ns``; its JSON result. Seconds: per request, and to keep retrying."""
    env = nodes.env(PDSERVE_CLUSTER_SECRET=secret)
    res = nodes.run(
        ns,
        [
            sys.executable,
            str(CLIENT),
            router,
            "--prompts",
            json.dumps(PROMPTS),
            "--max-tokens",
            str(MAX_TOKENS),
            "--call-timeout",
            str(call_timeout_s),
            "--until-ok",
            str(until_ok_s),
            "--stats",
            *stats,
        ],
        timeout_s=CLIENT_TIMEOUT_S,
        env=env,
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_prefill_and_decode_on_two_ray_nodes(nodes, embedded_dir):
    from pdserve.engine.text.tokenizer import Tokenizer

    secret = secrets.token_hex(32)
    serve = _serve(nodes, str(embedded_dir), secret)
    try:
        router, _, workers = serve.wait_serving(SERVE_START_S)
        # prefill on the head, decode on the worker node: the KV crosses the veth pair
        assert workers["prefill"].startswith(f"{nodes.head_ip}:"), workers
        assert workers["decode"].startswith(f"{nodes.worker_ip}:"), workers
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
        out = _client(
            nodes,
            nodes.worker_ns,
            router,
            secret,
            stats=[workers["prefill"]],
            call_timeout_s=10.0,
            until_ok_s=RECOVERY_S,
        )
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


def test_link_shapes_and_the_loss_filter():
    from pdserve.soak.link_faults import LinkShape, loss_bytecode

    assert loss_bytecode(0) == "4,32 0 0 4294963256,53 1 0 0,6 0 0 4294967295,6 0 0 0"  # never matches
    assert loss_bytecode(100).split(",")[2] == "53 1 0 4294967295"  # matches all but one value in 2**32
    assert loss_bytecode(5).split(",")[2] == f"53 1 0 {int(0.05 * 2**32)}"
    assert str(LinkShape(rate_mbit=16, loss_pct=5)) == "16 Mbit/s, loss 5%" and str(LinkShape()) == "clean"
    for bad in ({"rate_mbit": 0}, {"loss_pct": 101}, {"delay_ms": -1}):
        with pytest.raises(ValueError):
            LinkShape(**bad)


def test_link_chaos_checks_flag_hangs_late_ends_errors_and_leaks():
    from pdserve.soak.link_chaos_report import problems, table_lines

    ok = {
        "fault": "cut-35s (...)",
        "name": "cut-35s",
        "requests": 2,
        "bound_s": 95.0,
        "how": "htb+bpf",
        "completed": 1,
        "hung": 0,
        "errors": {"UNAVAILABLE": 1},
        "migrated": 1,
        "max_end_s": 40.0,
        "leaked": {"prefill@a": 0, "decode@b": 0},
        "messages": ["UNAVAILABLE: the KV cache did not reach ..."],
        "short": 0,
        "mismatches": 0,
        "router_node": "head (prefill)",
        "cut_at_s": 0.4,
        "in_flight_at_cut": 1,
    }
    assert problems([ok]) == []
    assert "| 1 (UNAVAILABLE 1) |" in table_lines([ok])[2]
    bad = [
        dict(ok, hung=1),
        dict(ok, max_end_s=96.0),
        dict(ok, name="cut-5s"),
        dict(ok, messages=["UNKNOWN: "]),
        dict(ok, mismatches=1),
        dict(ok, leaked={"prefill@a": 0, "decode@b": 3}),
        dict(ok, leaked={"decode@b": -1}),
    ]
    assert [len(problems([row])) for row in bad] == [1] * len(bad)
    assert problems([{"fault": "delay", "name": "delay", "skipped": "no netem"}]) == []


def test_two_node_soak_makes_its_own_cluster(capsys):
    from pdserve.cli.main import main

    assert main(["soak", "--two-nodes", "--address", "10.0.0.1:6379"]) == 2
    assert "--two-nodes makes its own Ray cluster" in capsys.readouterr().err


@pytest.mark.timeout(900)
def test_link_faults_between_prefill_and_decode(nodes):
    """One serve, every case of pdserve.soak.link_chaos in turn; prints the table."""
    from pdserve.soak.link_chaos import CASES, run_link_chaos
    from pdserve.soak.link_chaos_report import problems, table_lines

    rows, log = run_link_chaos(nodes, list(CASES.values()))
    print("\n" + "\n".join(table_lines(rows)))
    assert [r["name"] for r in rows] == list(CASES)
    ran = {r["name"]: r for r in rows if "skipped" not in r}
    assert {"none", "slow", "loss", "cut-5s", "cut-15s", "cut-35s"} <= set(ran), rows  # tc htb + bpf at least
    for name in ("cut-5s", "cut-15s", "cut-35s"):  # each cut came while a KV push was under way
        assert ran[name]["in_flight_at_cut"] >= 1, ran[name]
    # the shaping took hold: on a quiet machine the slow case takes 5-7x the clean one; 2x leaves room
    # for a busy machine, where the clean case slows too, and still tells shaped from unshaped
    assert ran["slow"]["max_end_s"] > 2 * ran["none"]["max_end_s"], rows
    assert problems(rows) == [], f"{problems(rows)}\n{log[-4000:]}"


def test_a_call_on_a_connection_dropped_during_a_cut_ends(nodes):
    """A stream from the worker node's namespace to the head's: the link is cut for 25 s. The
    server's side of the connection gives up after 20 s of unacknowledged data (gRPC sets
    TCP_USER_TIMEOUT); the caller, which sends nothing, only learns it through keepalive pings,
    so the call must end UNAVAILABLE within keepalive's 30 s of the cut, not at its 90 s deadline."""
    from pdserve.soak.link_faults import set_link

    address = f"{nodes.worker_ip}:{PROBE_PORT}"
    server = nodes.popen(
        nodes.worker_ns, [sys.executable, str(PROBE), "serve", address], stdout=subprocess.PIPE, text=True
    )
    client = None
    try:
        assert server.stdout.readline().strip() == "serving"
        client = nodes.popen(
            nodes.head_ns,
            [sys.executable, str(PROBE), "call", address, "--timeout", "90"],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert client.stdout.readline().strip() == "first"
        set_link(nodes, False)
        cut_at = time.monotonic()
        try:
            time.sleep(PROBE_CUT_S)
        finally:
            set_link(nodes, True)
        out, _ = client.communicate(timeout=120)
        ended = time.monotonic() - cut_at
        res = json.loads(out.strip().splitlines()[-1])
        assert res["code"] == "UNAVAILABLE" and ended < PROBE_BOUND_S, (res, ended)
    finally:
        for proc in (client, server):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(10)

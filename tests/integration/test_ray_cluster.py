"""The real thing: a local Ray instance with 1 prefill + 1 decode worker and the router on loopback."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pdserve.router.client import Client, make_request
from tests.conftest import STORIES_REFERENCES, hf_greedy, mixed_prompts

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def split_cluster(request):
    from pdserve.cluster.config import ClusterConfig
    from pdserve.cluster.launch import start_cluster
    from pdserve.engine.config import EngineConfig
    from tests.conftest import STORIES

    model = STORIES if (STORIES / "model.safetensors").is_file() else "embedded"
    cluster = start_cluster(
        ClusterConfig(
            engine=EngineConfig(model=str(model), dtype="float32", num_kv_blocks=512), placement="split", router_port=0
        )
    )
    yield cluster
    cluster.stop()
    assert not ray.is_initialized()


async def _used_blocks(cluster) -> int:
    """Through WorkerService, which wants the cluster's secret (a stranger gets UNAUTHENTICATED)."""
    from pdserve.v1 import worker_pb2, worker_pb2_grpc

    total = 0
    for address in cluster.workers:
        async with grpc.aio.insecure_channel(address) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await worker_pb2_grpc.WorkerServiceStub(ch).GetStats(worker_pb2.GetStatsRequest())
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        metadata = (("x-pdserve-cluster-secret", cluster.secret),)
        async with grpc.aio.insecure_channel(address) as ch:
            s = await worker_pb2_grpc.WorkerServiceStub(ch).GetStats(worker_pb2.GetStatsRequest(), metadata=metadata)
            total += s.used_kv_blocks + s.num_running + s.num_waiting
    return total


async def assert_no_blocks_left(cluster, wait_s: float = 5.0) -> None:
    """Every worker's KV blocks and sequences are freed within ``wait_s`` seconds."""
    for _ in range(int(wait_s / 0.05)):
        if await _used_blocks(cluster) == 0:
            return
        await asyncio.sleep(0.05)
    pytest.fail(f"blocks still in use: {await _used_blocks(cluster)}")


def test_split_cluster_on_ray(split_cluster):
    cluster = split_cluster
    assert sorted(cluster.workers.values()) == ["decode", "prefill"]
    assert all(a.startswith("127.0.0.1:") for a in [cluster.address, *cluster.workers])
    import os

    if (os.cpu_count() or 1) >= 2:  # each CPU worker pinned to a core of its own
        pinned = ray.get([a.affinity.remote() for a in cluster._actors[:2]])
        assert sorted(pinned) == [[0], [1]]

    async def run():
        async with Client(cluster.address) as client:
            info = await client.model_info(cluster_secret=cluster.secret)  # the admin view: its folder
            assert info.placement == "split" and info.model in ("embedded", "stories260K-hf")  # no path
            model_dir = info.model_path
            prompts = mixed_prompts()
            results = await asyncio.gather(
                *[client.generate(make_request(p, max_tokens=16, temperature=0)) for p in prompts]
            )
            from pdserve.engine.text.tokenizer import Tokenizer

            tok = Tokenizer.from_folder(model_dir)
            for p, res in zip(prompts, results):
                assert res.token_ids == hf_greedy(model_dir, tok.encode(p), 16)
                assert res.text == tok.decode(res.token_ids)
            if model_dir.endswith("stories260K-hf"):
                for p, ref in STORIES_REFERENCES.items():
                    assert (await client.generate(make_request(p, max_tokens=40, temperature=0))).token_ids == ref
            # a cancelled stream and a bad request in between
            call = client.stub.Generate(make_request("cancel me " * 10, max_tokens=1000, ignore_eos=True))
            async for _ in call:
                call.cancel()
                break
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await client.generate(make_request("", max_tokens=3))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            one = await client.generate(make_request("one", max_tokens=1))
            assert len(one.token_ids) == 1
        await assert_no_blocks_left(cluster)

    asyncio.run(run())


def _loopback(ip: str) -> bool:
    import ipaddress

    addr = ipaddress.ip_address(ip.split("%")[0])
    return addr.is_loopback or (addr.version == 6 and addr.ipv4_mapped is not None and addr.ipv4_mapped.is_loopback)


def test_the_local_ray_session_listens_on_loopback_only(split_cluster):
    """Every listening TCP socket of this driver and its descendants (Ray's GCS, raylet, agents,
    autoscaler monitor and core workers, pdserve's workers and router) is on loopback."""
    import os

    import psutil

    me = psutil.Process()
    procs = {me.pid: me, **{p.pid: p for p in me.children(recursive=True)}}
    listening = {}  # (ip, port) -> owner
    for c in psutil.net_connections(kind="tcp"):
        if c.status == psutil.CONN_LISTEN and c.pid in procs:
            try:
                owner = procs[c.pid].name()
            except psutil.Error:  # gone since
                continue
            listening[c.laddr.ip, c.laddr.port] = f"{owner} ({c.pid})"
    outside = {f"{ip}:{port}": owner for (ip, port), owner in listening.items() if not _loopback(ip)}
    assert not outside, f"listening outside loopback: {outside}"
    owners = " ".join(listening.values())
    assert "gcs_server" in owners and "raylet" in owners and f"({os.getpid()})" in owners, listening
    ports = {port for _, port in listening}
    for address in [split_cluster.address, *split_cluster.workers]:  # pdserve's servers are among them
        assert int(address.rpartition(":")[2]) in ports, (address, listening)


def test_killed_workers_come_back_without_a_router_restart(split_cluster):
    """SIGKILL the prefill actor's process, then the decode one's: Ray restarts each, the supervisor
    starts its server again and the router routes to the new address. A stream in flight on the
    killed decode worker migrates to the restarted one (same tokens as undisturbed) or, when no
    live worker appears within the migration wait, ends with an in-band error: never a hang."""
    import os
    import signal
    import time

    cluster = split_cluster
    calls: list[int] = []

    async def generate_once(client) -> bool:
        try:
            # a new prompt, longer than --local-prefill-tokens and with no cached prefix: the prefill
            # worker must serve it, not the decode worker (conditional disaggregation)
            calls.append(len(calls))
            res = await client.generate(
                make_request(f"{len(calls)} Once upon a time " * 12, max_tokens=4, temperature=0), timeout=10
            )
        except grpc.aio.AioRpcError:
            return False
        return not res.error and len(res.token_ids) == 4

    async def kill_and_recover(role: str) -> float:
        old = next(a for a, r in cluster.workers.items() if r == role)
        actor = next(s.actor for s in cluster.supervisor.workers if s.address == old)
        pid = ray.get(actor.pid.remote())
        async with Client(cluster.address) as client:
            assert await generate_once(client)
            streaming = None
            if role == "decode":
                long = make_request("story", max_tokens=1000, ignore_eos=True, temperature=0)
                undisturbed = await client.generate(long, timeout=60)
                streaming = asyncio.create_task(client.generate(long, timeout=60))
                await asyncio.sleep(0.5)
            os.kill(pid, signal.SIGKILL)
            t0 = time.monotonic()
            if streaming is not None:
                # migrated once the restarted worker serves, or an in-band error when that took too long
                res = await asyncio.wait_for(streaming, 30.0)
                if res.error:
                    assert "UNAVAILABLE" in res.error and time.monotonic() - t0 < 6.0, res.error
                else:
                    assert res.token_ids == undisturbed.token_ids
            while not await generate_once(client):
                assert time.monotonic() - t0 < 30, f"{role} worker not back after 30 s"
                await asyncio.sleep(0.5)
            recovered = time.monotonic() - t0
            info = await client.model_info(cluster_secret=cluster.secret)
            live = {w.address for w in info.workers if w.healthy}
            assert old not in live and len(live) == 2
        assert old not in cluster.workers and sorted(cluster.workers.values()) == ["decode", "prefill"]
        return recovered

    async def run():
        for role in ("prefill", "decode"):
            await kill_and_recover(role)

    asyncio.run(run())

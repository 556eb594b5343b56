"""A supervised worker that is only out of reach for a while (a cut link between Ray nodes): once it
answers again, the supervisor forgets the outage, so its next fall is reported to the router again."""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")


class _Remote:
    def __init__(self, fn):
        self.remote = fn


class _Actor:
    address = _Remote(lambda: "ping")


class _Router:
    def __init__(self) -> None:
        self.restarting: list[str] = []
        self.worker_restarting = _Remote(self.restarting.append)


def test_a_worker_back_in_reach_is_reported_again_when_it_goes_down(monkeypatch):
    from pdserve.cluster import supervisor as sup

    answers = iter(["timeout", "10.0.0.2:5000", "timeout"])  # unreachable, back, unreachable again

    def fake_get(ref, timeout=None):
        answer = next(answers)
        if answer == "timeout":
            raise ray.exceptions.GetTimeoutError("no answer")
        return answer

    monkeypatch.setattr(sup.ray, "get", fake_get)
    router = _Router()
    w = sup.Supervised(_Actor(), "decode", (), "10.0.0.2:5000")
    s = sup.Supervisor([w], router)
    s._check(w)
    assert router.restarting == ["10.0.0.2:5000"] and w.down_since is not None
    s._check(w)  # it answers with its own address: it was not restarted
    assert w.down_since is None and w.address == "10.0.0.2:5000"
    s._check(w)
    assert router.restarting == ["10.0.0.2:5000", "10.0.0.2:5000"]

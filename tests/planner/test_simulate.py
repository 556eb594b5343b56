"""``pdserve simulate``: the simulator runs the engine's own scheduling (the same steps as a real
engine driven offline with the same step times), writes bench's summary keys, charges the KV
hand-off in split placement, and refuses a bad profile or bad flags with one line."""

from __future__ import annotations

import contextlib
import io
import json
import random

import pytest

from pdserve.cli.main import main
from pdserve.engine.config import EngineConfig, ModelConfig, for_role
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.models.embedded import embedded_model_dir
from pdserve.engine.params import SamplingParams
from pdserve.engine.scheduling.batch import batch_shape
from pdserve.loadgen.metrics import SLO, summarize
from pdserve.loadgen.workload import RequestSpec
from pdserve.planner.simulate import SimConfig, Simulator
from pdserve.planner.step_model import SCHEMA, StepModel

BENCH_EXTRA_KEYS = {
    "placement",
    "model",
    "rate_rps",
    "sent",
    "scheduled",
    "interrupted",
    "arrival",
    "prompts",
    "backend",
    "target",
    "prefix_cache",
    "host_cores",
    "serving_costs",
}  # fmt: skip  (cli/bench.py cmd_bench's summary.update)
WORKLOAD = ["--arrival", "poisson", "--rate", "20", "--num-requests", "12", "--input-len", "48", "--output-len", "6"]


def toy_profile(h0: float = 0.05) -> dict:
    def fit(**values):
        return {"coefficients": {k: {"value": v, "unit": "s"} for k, v in values.items()}}

    return {
        "schema": SCHEMA,
        "machine": {"dtype": "float32"},
        "settings": {"model_spec": "embedded"},
        "points": {},
        "fits": {
            "prefill": fit(p0=0.01, p1=1e-4, p2=1e-8, p3=0.0),
            "decode": fit(d0=0.005, d1=2e-4, d2=1e-7),
            "mixed": fit(m1=2e-4, m2=1e-7),
            "handoff": fit(h0=h0, h1=1e9),
        },
    }


def trace(n: int = 10, seed: int = 0) -> list[RequestSpec]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, 250) for _ in range(40)]  # a prefix some prompts share (prefix cache)
    specs, t = [], 0.0
    for i in range(n):
        tail = [rng.randrange(3, 250) for _ in range(rng.randrange(5, 90))]
        specs.append(RequestSpec(i, t, tuple((shared if i % 2 else []) + tail), rng.randrange(1, 9), "random"))
        t += rng.uniform(0.0, 0.03)
    return specs


def offline_steps(cfg: EngineConfig, model: StepModel, specs: list[RequestSpec]) -> list:
    """A real LLMEngine (weights, KV cache) driven step by step, time advanced by the model."""
    engine, steps, clock = LLMEngine(cfg), [], [0.0]
    real_run = engine.runner.run

    def run(batch):
        steps.append([(s.request_id, n) for s, n in zip(batch.seqs, batch.num_query_tokens)])
        clock[0] += model.batch_s(*batch_shape(batch))
        return real_run(batch)

    engine.runner.run = run
    pending = list(specs)
    while pending or engine.has_work():
        while pending and pending[0].send_at_s <= clock[0]:
            s = pending.pop(0)
            sampling = SamplingParams(temperature=0.0, max_tokens=s.max_tokens, ignore_eos=True)
            engine.add_request(f"sim-{s.index}", list(s.prompt_token_ids), sampling)
        if not engine.has_work():
            clock[0] = pending[0].send_at_s
            continue
        engine.step()
    return steps


def test_simulator_takes_the_steps_a_real_engine_takes():
    model = StepModel.from_profile(toy_profile())
    engine = EngineConfig(model="embedded", max_num_batched_tokens=64, max_num_seqs=4, num_kv_blocks=24)
    sim = Simulator(SimConfig(engine, "colocated", 1, 0), model, "float32")
    sim.workers[0].engine.runner.trace = steps = []
    specs = trace()
    records = sim.run(specs)
    assert all(r.ok for r in records) and [r.output_tokens for r in records] == [s.max_tokens for s in specs]
    expected = offline_steps(for_role(engine, "colocated"), model, specs)
    assert any(len(step) > 1 for step in expected) and any(n > 1 for step in expected for _, n in step)
    assert steps == expected


def run_cli(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return code, out.getvalue(), err.getvalue()


@pytest.fixture
def profile_path(tmp_path):
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(toy_profile()))
    return str(path)


def test_summary_has_the_keys_bench_writes(tmp_path, profile_path):
    out = tmp_path / "run"
    code, stdout, _ = run_cli(
        "simulate", "--profile", profile_path, "--prompts", "random", *WORKLOAD, "--out", str(out),
        "--slo-ttft-ms", "500", "--slo-tpot-ms", "100",
    )  # fmt: skip
    assert code == 0, stdout
    summary = json.loads((out / "summary.json").read_text())
    bench_keys = set(summarize([], SLO(0.5, 0.1)))  # what cmd_bench summarises, before its update
    assert set(summary) == bench_keys | BENCH_EXTRA_KEYS
    assert summary["completed"] == 12 and summary["backend"] == "simulate"
    assert len((out / "results.jsonl").read_text().splitlines()) == 12


def test_split_first_decode_token_waits_for_the_handoff():
    profile = toy_profile(h0=0.05)
    model = StepModel.from_profile(profile)
    engine = EngineConfig(model="embedded", max_num_batched_tokens=256)
    spec = [RequestSpec(0, 0.0, tuple(range(3, 103)), 4, "random")]  # 100 tokens
    split = Simulator(SimConfig(engine, "split", relay_s=0.001), model, "float32").run(spec)[0]
    colocated = Simulator(SimConfig(engine, "colocated", 1, 0, relay_s=0.001), model, "float32").run(spec)[0]
    mc = ModelConfig.from_folder(embedded_model_dir())
    nbytes = mc.num_layers * 2 * 100 * mc.num_kv_heads * mc.head_dim * 4  # float32 KV of the prompt
    assert split.kv_transfer_bytes == nbytes and colocated.kv_transfer_bytes == 0
    assert split.ttft_s == pytest.approx(model.prefill_s(100) + 0.001)
    assert colocated.ttft_s == pytest.approx(split.ttft_s)  # first token: the same prefill step
    handoff = model.handoff_s(nbytes)
    assert split.kv_transfer_s == pytest.approx(handoff)
    step = model.decode_s(1, 101)
    assert split.token_times_s[1] - split.token_times_s[0] == pytest.approx(handoff + step)
    assert colocated.token_times_s[1] - colocated.token_times_s[0] == pytest.approx(step)
    assert split.e2e_s - colocated.e2e_s == pytest.approx(handoff)


def test_a_prefill_step_beside_a_kv_send_takes_the_send_longer():
    """The prefill worker's core sends the first prompt's KV while it prefills the second."""
    model = StepModel.from_profile(toy_profile(h0=0.02))
    engine = EngineConfig(model="embedded", max_num_batched_tokens=100)  # one 100-token prompt a step
    specs = [RequestSpec(i, 0.0, tuple(range(3 + i, 103 + i)), 4, "random") for i in range(2)]
    first, second = sorted(
        Simulator(SimConfig(engine, "split", relay_s=0.0), model, "float32").run(specs), key=lambda r: r.ttft_s
    )
    prefill, handoff = model.prefill_s(100), model.handoff_s(first.kv_transfer_bytes)
    assert first.ttft_s == pytest.approx(prefill)
    assert second.ttft_s == pytest.approx(2 * prefill + handoff)


def with_coefficient(section: str, name: str, value: float) -> dict:
    """``toy_profile()`` with one coefficient replaced."""
    p = toy_profile()
    p["fits"][section]["coefficients"][name]["value"] = value
    return p


@pytest.mark.parametrize(
    "content, flags, message",
    [
        ("{not json", [], "cannot read --profile"),
        (json.dumps({"schema": 7}), [], "profile schema 7"),
        (json.dumps({**toy_profile(), "settings": {}}), [], "no 'model_spec'"),
        (json.dumps({**toy_profile(), "settings": None}), [], "profile has no 'settings' section (a JSON object)"),
        (json.dumps({**toy_profile(), "machine": [1]}), [], "profile has no 'machine' section"),
        (json.dumps({**toy_profile(), "points": {"prefill": [1]}}), [], "a section of the wrong shape"),
        (None, [], "cannot read --profile"),
        (b"\xff\xfe{}", [], "cannot read --profile"),
        (json.dumps(with_coefficient("decode", "d0", 1e308)), [], "predict 1e+308 s for a decode step of 256 rows"),
        (json.dumps(toy_profile()), ["--slo-ttft-ms", "100"], "--slo-ttft-ms needs --slo-tpot-ms"),
        (json.dumps(toy_profile()), ["--no-chunked-prefill", "--target-itl-ms", "50"], "needs chunked prefill"),
        (json.dumps(toy_profile()), ["--num-kv-blocks", "1"], "longest request cannot run: request needs"),
    ],
)
def test_bad_profile_or_flags_exit_2_with_one_line(tmp_path, content, flags, message):
    path = tmp_path / "p.json"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    code, _, err = run_cli("simulate", "--profile", str(path), *WORKLOAD, "--prompts", "random", *flags,
                           "--out", str(tmp_path / "o"))  # fmt: skip
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: ") and message in err, err


def test_split_prefill_starts_once_the_busy_decode_worker_has_held_the_prefix():
    model = StepModel.from_profile(toy_profile(h0=0.001))
    engine = EngineConfig(model="embedded", max_num_batched_tokens=256)
    first = RequestSpec(0, 0.0, tuple(range(3, 103)), 40, "random")
    a_steps = Simulator(SimConfig(engine, "split"), model, "float32").run([first])[0].token_times_s
    send = (a_steps[5] + a_steps[6]) / 2  # mid-way through one of the decode worker's steps
    second = RequestSpec(1, send, tuple(range(200, 264)), 4, "random")
    a, b = Simulator(SimConfig(engine, "split"), model, "float32").run([first, second])
    assert a.token_times_s[:7] == pytest.approx(a_steps[:7])
    prefill_start = b.sent_s + b.queue_s
    assert prefill_start == pytest.approx(a_steps[6])  # the pin waited for that step to end
    assert b.ttft_s == pytest.approx(a_steps[6] - send + model.prefill_s(64))


def test_lengths_past_what_the_profile_measured_are_noted(tmp_path):
    """48-token prompts (54 tokens with their output) against a profile whose prompt steps reached
    32 tokens and whose decode contexts reached 40: both are noted; a profile reaching past them,
    and one with its fits alone, note nothing."""

    def run(points: dict) -> str:
        path = tmp_path / "profile.json"
        path.write_text(json.dumps({**toy_profile(), "points": points}))
        code, stdout, _ = run_cli("simulate", "--profile", str(path), "--prompts", "random", *WORKLOAD,
                                  "--out", str(tmp_path / "run"))  # fmt: skip
        assert code == 0, stdout
        return stdout

    def points(prompt: int, context: int) -> dict:
        return {"prefill": [{"tokens": prompt - 16, "cached_tokens": 16}], "decode": [{"context": context}]}

    out = run(points(32, 40))
    assert "note: prompts of up to 48 tokens; the profile measured up to 32: their steps' times extrapolate" in out
    assert "note: contexts of up to 54 tokens; the profile decoded up to 40:" in out
    assert "note:" not in run(points(48, 54)) and "note:" not in run({})

"""The batched sampler (engine/sampling.py) and SamplingParams / step_seed (engine/params.py)."""

from __future__ import annotations

import math
import struct
from collections import Counter

import msgpack
import pytest
import torch

from pdserve.engine.params import SamplingParams, sampling_errors, step_seed
from pdserve.engine.sampling import sample

GREEDY = SamplingParams(temperature=0.0)


def random_logits(rows: int, vocab: int, seed: int, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale


def draws(logits_row: torch.Tensor, params: SamplingParams, n: int, step: int = 0) -> list[int]:
    """One single-row draw for each of n seeds (deterministic)."""
    out = []
    for seed in range(n):
        p = SamplingParams(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k, seed=seed)
        out += sample(logits_row[None], [p], [step])
    return out


# -- greedy and its limits ------------------------------------------------------------------------


def test_greedy_is_argmax_per_row() -> None:
    logits = random_logits(6, 50, seed=1)
    assert sample(logits, [GREEDY] * 6, [0] * 6) == logits.argmax(dim=-1).tolist()


def test_greedy_rows_stay_argmax_next_to_sampled_rows() -> None:
    logits = random_logits(4, 50, seed=2, scale=0.1)
    params = [GREEDY, SamplingParams(seed=1), GREEDY, SamplingParams(seed=2)]
    tokens = sample(logits, params, [3, 3, 3, 3])
    argmax = logits.argmax(dim=-1).tolist()
    assert (tokens[0], tokens[2]) == (argmax[0], argmax[2])


def test_half_precision_logits_are_accepted() -> None:
    logits = random_logits(3, 40, seed=3)
    assert (
        sample(logits.to(torch.bfloat16), [GREEDY] * 3, [0] * 3)
        == logits.to(torch.bfloat16).float().argmax(dim=-1).tolist()
    )


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(top_k=1, temperature=1.5),
        SamplingParams(top_p=1e-6, temperature=1.5),
        SamplingParams(top_k=1, top_p=0.3, temperature=0.7),
    ],
)
def test_top_k_one_and_tiny_top_p_equal_greedy(params: SamplingParams) -> None:
    for logits_seed in range(10):
        logits = random_logits(8, 100, seed=logits_seed, scale=0.5)
        rows = [SamplingParams(**{**params.to_dict(), "seed": s}) for s in range(8)]
        assert sample(logits, rows, list(range(8))) == logits.argmax(dim=-1).tolist()


# -- seeds ----------------------------------------------------------------------------------------


def test_seeded_draw_does_not_depend_on_position_or_neighbours() -> None:
    logits = random_logits(1, 64, seed=4, scale=0.5)[0]
    for seed in range(30):
        p = SamplingParams(temperature=0.9, seed=seed)
        alone = sample(logits[None], [p], [5])[0]
        others = random_logits(4, 64, seed=100 + seed)
        for pos in range(5):
            batch = torch.cat([others[:pos], logits[None], others[pos:]])
            params = [SamplingParams(seed=1000 + i) if i % 2 else GREEDY for i in range(4)]
            params.insert(pos, p)
            steps = [7, 0, 2, 9]
            steps.insert(pos, 5)
            assert sample(batch, params, steps)[pos] == alone, f"seed {seed}, row {pos}"


def test_same_seed_and_step_repeat() -> None:
    logits = random_logits(1, 1000, seed=5, scale=0.0)
    p = SamplingParams(seed=42)
    first = [sample(logits, [p], [s])[0] for s in range(20)]
    assert first == [sample(logits, [p], [s])[0] for s in range(20)]


def test_different_seeds_and_steps_give_different_draws() -> None:
    logits = torch.zeros(1, 1000)  # uniform: two independent draws agree with probability 1/1000
    a = [sample(logits, [SamplingParams(seed=1)], [s])[0] for s in range(50)]
    b = [sample(logits, [SamplingParams(seed=2)], [s])[0] for s in range(50)]
    assert sum(x == y for x, y in zip(a, b)) <= 3
    assert len(set(a)) >= 45, "the step must change the draw"


# -- filters --------------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [2, 5, 17])
def test_top_k_never_samples_outside_the_top_k(k: int) -> None:
    for logits_seed in range(4):
        logits = random_logits(1, 60, seed=logits_seed, scale=0.3)[0]
        top = set(torch.topk(logits, k).indices.tolist())
        seen = set(draws(logits, SamplingParams(top_k=k, temperature=2.0), 400))
        assert seen <= top
        if k <= 5:
            assert seen == top, "every token of the top k can be drawn"


def nucleus(probs: list[float], top_p: float) -> set[int]:
    """The smallest set of most likely tokens whose mass reaches top_p."""
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    kept, mass = set(), 0.0
    for i in order:
        kept.add(i)
        mass += probs[i]
        if mass >= top_p:
            break
    return kept


@pytest.mark.parametrize("cut", [0, 1, 3, 6])
def test_top_p_never_samples_outside_the_nucleus(cut: int) -> None:
    for logits_seed in range(4):
        logits = random_logits(1, 12, seed=logits_seed, scale=0.5)[0]
        probs = torch.softmax(logits.double(), -1).sort(descending=True).values.tolist()
        cum = [sum(probs[: i + 1]) for i in range(len(probs))]
        top_p = (cum[cut] + cum[cut + 1]) / 2  # well away from any boundary: nucleus = top cut+2
        expected = nucleus(torch.softmax(logits.double(), -1).tolist(), top_p)
        assert len(expected) == cut + 2
        seen = set(draws(logits, SamplingParams(top_p=top_p), 600))
        assert seen == expected


def test_top_p_excludes_tokens_after_an_exact_boundary() -> None:
    logits = torch.log(torch.tensor([0.5, 0.25, 0.25]))  # softmax gives exactly 0.5, 0.25, 0.25
    assert torch.softmax(logits, -1).tolist() == [0.5, 0.25, 0.25]
    assert set(draws(logits, SamplingParams(top_p=0.5), 200)) == nucleus([0.5, 0.25, 0.25], 0.5) == {0}


def test_top_k_and_top_p_combine() -> None:
    logits = torch.log(torch.tensor([0.4, 0.3, 0.2, 0.1]))
    # top_k=3 first renormalises to 4/9, 3/9, 2/9; top_p=0.75 then keeps the first two (7/9 >= 0.75).
    # Applied to the unfiltered 0.4, 0.3, 0.2, top_p=0.75 would keep three.
    seen = Counter(draws(logits, SamplingParams(top_k=3, top_p=0.75), 600))
    assert set(seen) == {0, 1}


@pytest.mark.parametrize(("temperature", "spread"), [(0.5, "sharper"), (1.0, "same"), (2.0, "flatter")])
def test_temperature_scales_the_distribution(temperature: float, spread: str) -> None:
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    n = 2000
    counts = Counter(draws(logits, SamplingParams(temperature=temperature), n))
    expected = torch.softmax(logits.double() / temperature, -1).tolist()
    for token, p in enumerate(expected):
        # binomial standard deviation <= 0.0112 at n=2000: 0.05 is a generous bound
        assert abs(counts[token] / n - p) < 0.05, (token, counts[token] / n, p)
    base = torch.softmax(logits.double(), -1)[0].item()
    top = counts[0] / n
    if spread == "sharper":
        assert top > base + 0.1
    elif spread == "flatter":
        assert top < base - 0.1


# -- SamplingParams -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": -0.1}, "temperature must be a finite number >= 0, got -0.1"),
        ({"temperature": math.inf}, "temperature must be a finite number >= 0, got inf"),
        ({"temperature": math.nan}, "temperature must be a finite number >= 0, got nan"),
        ({"top_p": 0.0}, "top_p must be in (0, 1], got 0.0"),
        ({"top_p": 1.5}, "top_p must be in (0, 1], got 1.5"),
        ({"top_p": math.nan}, "top_p must be in (0, 1], got nan"),
        ({"top_k": -1}, "top_k must be >= 0 (0 disables), got -1"),
        ({"max_tokens": 0}, "max_tokens must be >= 1, got 0"),
    ],
)
def test_invalid_sampling_params_are_refused_with_a_readable_message(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)
    assert str(info.value) == message


def test_float32_values_are_shown_as_the_client_wrote_them() -> None:
    """Protobuf floats are float32: a client's -0.7 arrives as -0.699999988079071."""
    as_f32 = lambda x: struct.unpack("f", struct.pack("f", x))[0]  # noqa: E731
    errors = sampling_errors(temperature=as_f32(-0.7), top_p=as_f32(1.1), top_k=0, max_tokens=1)
    assert errors == ["temperature must be a finite number >= 0, got -0.7", "top_p must be in (0, 1], got 1.1"]
    assert sampling_errors(temperature=-0.1, top_p=1.0 + 1e-12, top_k=0, max_tokens=1) == [
        "temperature must be a finite number >= 0, got -0.1",
        f"top_p must be in (0, 1], got {1.0 + 1e-12!r}",
    ]


def test_every_problem_is_reported_at_once() -> None:
    errors = sampling_errors(temperature=-1.0, top_p=2.0, top_k=-3, max_tokens=0)
    assert [e.split()[0] for e in errors] == ["temperature", "top_p", "top_k", "max_tokens"]
    with pytest.raises(ValueError, match="temperature .*; top_p .*; top_k .*; max_tokens"):
        SamplingParams(temperature=-1.0, top_p=2.0, top_k=-3, max_tokens=0)


def test_valid_edge_values_are_accepted() -> None:
    assert sampling_errors(temperature=0.0, top_p=1.0, top_k=0, max_tokens=1) == []
    assert SamplingParams(temperature=0.0).greedy
    assert not SamplingParams(temperature=1e-6).greedy


def test_to_dict_from_dict_round_trip_through_msgpack() -> None:
    p = SamplingParams(temperature=0.75, top_p=0.9, top_k=40, seed=2**63 - 1, max_tokens=123, ignore_eos=True)
    d = msgpack.unpackb(msgpack.packb(p.to_dict()))
    assert SamplingParams.from_dict(d) == p
    assert SamplingParams.from_dict(SamplingParams().to_dict()) == SamplingParams()


def test_from_dict_refuses_missing_keys_and_bad_values() -> None:
    d = SamplingParams().to_dict()
    del d["top_k"]
    with pytest.raises(ValueError, match="bad sampling state"):
        SamplingParams.from_dict(d)
    with pytest.raises(ValueError, match="top_p must be in"):
        SamplingParams.from_dict({**SamplingParams().to_dict(), "top_p": 0.0})


# -- step_seed ------------------------------------------------------------------------------------


def test_step_seed_matches_splitmix64_reference() -> None:
    # SplitMix64 seeded with 0 yields e220a8397b1dcdaf, 6e789e6aa1b965f4, 06c45d188009454f;
    # step_seed keeps the low 63 bits so torch.Generator.manual_seed accepts it.
    assert [step_seed(0, s) for s in range(3)] == [0x6220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F]


def test_step_seed_is_deterministic_and_differs_across_steps_and_seeds() -> None:
    values = {(seed, s): step_seed(seed, s) for seed in (0, 1, 2, 12345, 2**64 - 1) for s in range(200)}
    assert values == {(seed, s): step_seed(seed, s) for seed, s in values}
    assert len(set(values.values())) == len(values)
    assert all(0 <= v < 2**63 for v in values.values())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_greedy_rows_take_the_first_maximum_in_the_logits_own_dtype(dtype):
    """Ties (frequent in bfloat16) go to the lowest token id, exactly as float32 argmax gives them."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randint(0, 4, (16, 5000), generator=gen).to(dtype)
    tokens = sample(logits, [SamplingParams(temperature=0.0)] * 16, [0] * 16)
    assert tokens == logits.float().argmax(dim=-1).tolist()

"""clip_lengths: a request's input and output lengths scaled, capped and fitted to the context window."""

from __future__ import annotations

import pytest

from pdserve.loadgen.workload import clip_lengths, load_trace, window

DATASET = "azure_llm_trace_2023"  # the datasets_dir fixture (conftest.py) skips when it is absent


@pytest.mark.parametrize(
    "args,kwargs,expected",
    [
        ((100, 50, 2048), {}, (100, 50)),
        ((1000, 48, 1048), {}, (1000, 48)),  # exactly max_model_len
        ((1001, 48, 1048), {}, (1000, 48)),  # one over: the input gives way
        ((5000, 100, 2048), {}, (1948, 100)),
        ((10, 3000, 2048), {}, (1, 2047)),  # input at its floor of 1, then the output is trimmed
        ((5, 5, 2), {}, (1, 1)),
        ((0, 0, 64), {}, (1, 1)),
        ((374, 44, 2048), {"length_scale": 0.5}, (187, 22)),
        ((374, 44, 2048), {"length_scale": 0.01}, (4, 1)),
        ((374, 44, 2048), {"length_scale": 3.0}, (1122, 132)),
        ((374, 44, 2048), {"max_input_tokens": 256, "max_output_tokens": 16}, (256, 16)),
        ((4808, 10, 512), {"length_scale": 0.1, "max_output_tokens": 4}, (481, 1)),
        ((4808, 10, 512), {"max_input_tokens": 300}, (300, 10)),
    ],
)
def test_clip_lengths(args, kwargs, expected):
    assert clip_lengths(*args, **kwargs) == expected


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_model_len": 1},
        {"length_scale": 0.0},
        {"length_scale": -1.0},
        {"max_input_tokens": 0},
        {"max_output_tokens": 0},
    ],
)
def test_clip_lengths_rejects(kwargs):
    with pytest.raises(ValueError):
        clip_lengths(10, 10, **{"max_model_len": 100, **kwargs})


def test_clip_lengths_over_a_trace_window(datasets_dir):
    code = window(load_trace("azure-code", datasets_dir), max_requests=200)
    clipped = [clip_lengths(r.input_tokens, r.output_tokens, 2048) for r in code]
    assert clipped[:3] == [(2038, 10), (2048 - 8, 8), (110, 27)]
    for r, (inp, out) in zip(code, clipped):
        assert inp >= 1 and out >= 1 and inp + out <= 2048
        assert out == min(r.output_tokens, 2047)  # outputs only shrink when the input is at 1
        assert inp == (r.input_tokens if r.input_tokens + r.output_tokens <= 2048 else 2048 - out)
    assert sum(inp != r.input_tokens for r, (inp, _) in zip(code, clipped)) > 20  # the code trace is long
    half = [clip_lengths(r.input_tokens, r.output_tokens, 512, length_scale=0.25) for r in code]
    assert half[2] == (28, 7)  # 110/4 = 27.5 rounds to 28, 27/4 = 6.75 to 7
    assert all(i + o <= 512 for i, o in half)

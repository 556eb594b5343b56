"""ModelRunner.read_kv / write_kv copy whole blocks; they must equal the per-slot definition."""

import random

import pytest
import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.params import SamplingParams
from pdserve.engine.scheduling.sequence import Sequence

NUM_BLOCKS = 40


@pytest.fixture(
    scope="module",
    params=[(bs, dt) for bs in (1, 5, 16) for dt in ("float32", "bfloat16")],
    ids=lambda p: f"bs{p[0]}-{p[1]}",
)
def runner(request, embedded_dir) -> ModelRunner:
    block_size, dtype = request.param
    cfg = EngineConfig(model=str(embedded_dir), block_size=block_size, num_kv_blocks=NUM_BLOCKS, dtype=dtype)
    return ModelRunner(cfg, embedded_dir)


def make_seq(runner: ModelRunner, n: int, seed: int) -> Sequence:
    """A sequence of n positions whose blocks lie over the cache in random order: scattered for even
    seeds, in runs of consecutive ids (as a fresh allocator hands them out) for odd ones."""
    seq = Sequence.new("r", list(range(n)), SamplingParams(), [])
    blocks = -(-n // runner.cfg.block_size)
    rng = random.Random(seed)
    if seed % 2 == 0:
        seq.block_table = rng.sample(range(NUM_BLOCKS), blocks)
    else:  # e.g. [17, 18, 19, 4, 5, 30, ...]: runs of up to 4 blocks at shuffled places
        starts = rng.sample(range(0, NUM_BLOCKS, 4), NUM_BLOCKS // 4)
        ids = [b for s in starts for b in range(s, s + rng.randint(1, 4))]
        seq.block_table = ids[:blocks]
    assert len(set(seq.block_table)) == len(seq.block_table) == blocks
    return seq


def slots(runner: ModelRunner, seq: Sequence, n: int) -> torch.Tensor:
    bs = runner.cfg.block_size
    return torch.tensor([seq.block_table[p // bs] * bs + p % bs for p in range(n)])


def lengths(runner: ModelRunner) -> list[int]:
    bs = runner.cfg.block_size
    return sorted({1, bs, bs + 1, 2 * bs - 1, 3 * bs, min(NUM_BLOCKS * bs, 7 * bs + 3)})


def test_read_kv_equals_per_slot_gather(runner):
    dtype = runner.kv_cache.dtype
    runner.kv_cache.copy_(torch.randn(runner.kv_cache.shape))
    for i, n in enumerate(lengths(runner) * 2):
        seq = make_seq(runner, n, seed=i // len(lengths(runner)) + 2 * i)  # each n scattered and in runs
        want = runner.kv_cache.flatten(2, 3)[:, :, slots(runner, seq, n)]
        got = runner.read_kv(seq, n)
        assert got.shape == want.shape and got.dtype == dtype and got.is_contiguous()
        assert torch.equal(got, want)
        # a prefix of the sequence (the prefill worker reads all positions but the last)
        assert torch.equal(runner.read_kv(seq, n - 1), want[:, :, : n - 1]) if n > 1 else True


def test_write_kv_touches_exactly_the_sequence_slots(runner):
    dtype = runner.kv_cache.dtype
    for i, n in enumerate(lengths(runner) * 2):
        runner.kv_cache.zero_()
        seq = make_seq(runner, n, seed=i // len(lengths(runner)) + 2 * i + 100)
        shape = (*runner.kv_cache.shape[:2], n, *runner.kv_cache.shape[4:])
        kv = torch.randn(shape).to(dtype) + 3  # never zero
        runner.write_kv(seq, kv)
        flat = runner.kv_cache.flatten(2, 3)
        idx = slots(runner, seq, n)
        assert torch.equal(flat[:, :, idx], kv)
        untouched = torch.ones(flat.shape[2], dtype=torch.bool)
        untouched[idx] = False
        assert not flat[:, :, untouched].any()
        assert torch.equal(runner.read_kv(seq, n), kv)  # round trip


def test_write_kv_casts_and_refuses_short_block_tables(runner):
    n = runner.cfg.block_size + 1
    seq = make_seq(runner, n, seed=7)
    shape = (*runner.kv_cache.shape[:2], n, *runner.kv_cache.shape[4:])
    kv = torch.randn(shape, dtype=torch.float64)
    runner.write_kv(seq, kv)
    assert torch.equal(runner.read_kv(seq, n), kv.to(runner.kv_cache.dtype))
    seq.block_table = seq.block_table[:1]
    with pytest.raises(ValueError, match=f"{n} positions need 2 blocks"):
        runner.read_kv(seq, n)
    with pytest.raises(ValueError, match=f"{n} positions need 2 blocks"):
        runner.write_kv(seq, kv)


def test_read_kv_copies_into_the_given_memory(runner):
    runner.kv_cache.copy_(torch.randn(runner.kv_cache.shape))
    n = 2 * runner.cfg.block_size + 1
    seq = make_seq(runner, n, seed=3)
    given = []

    def alloc(nbytes):
        given.append(torch.empty(nbytes + 64, dtype=torch.uint8)[:nbytes])
        return given[-1]

    kv = runner.read_kv(seq, n, alloc)
    assert kv.data_ptr() == given[0].data_ptr() and kv.nbytes == given[0].numel()
    assert torch.equal(kv, runner.kv_cache.flatten(2, 3)[:, :, slots(runner, seq, n)])

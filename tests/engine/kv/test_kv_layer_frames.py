"""Layer-wise KV streams (engine/kv/layer_frames.py, stream_decoder.py): the round trip, and every
damaged, reordered, duplicated or missing frame refused with a KvCodecError that says what."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.kv.codec import KvCodecError, KvLimits, frame_parts, pack_kv
from pdserve.engine.kv.layer_frames import KvStreamEnd, KvStreamHead, LayerKv, stream_frames
from pdserve.engine.kv.paged import read_layer, write_layer
from pdserve.engine.kv.stream_decoder import KvStreamDecoder
from tests.engine.kv._kv_payloads import join, make_fp, make_payload, split

FP = make_fp(num_layers=3)


def frame_bytes(frame) -> bytes:
    return b"".join(bytes(p) for p in frame_parts(frame))


def feed(frames: list[bytes], piece: int | None = None, fp=FP, limits=KvLimits()) -> tuple[list, KvStreamDecoder]:
    decoder, events, data = KvStreamDecoder(fp, limits), [], b"".join(frames)
    step = piece or max(len(data), 1)
    for i in range(0, len(data), step):
        events += decoder.add(data[i : i + step])
    return events, decoder


def assemble(events: list, like: torch.Tensor, kv_start: int) -> torch.Tensor:
    kv = torch.full_like(like, float("nan"))
    for ev in events:
        if isinstance(ev, LayerKv):
            kv[ev.layer, :, ev.start - kv_start : ev.start - kv_start + ev.kv.shape[1]] = ev.kv
    return kv


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("rounds", [None, [16, 21], [1, 1, 35]])
@pytest.mark.parametrize("piece", [None, 7, 1000])
def test_a_stream_decodes_to_the_whole_frame_kv_bit_for_bit(dtype, rounds, piece):
    fp = make_fp(num_layers=3, dtype=dtype)
    payload = make_payload(fp, 37)
    events, decoder = feed([frame_bytes(f) for f in stream_frames(payload, rounds)], piece, fp)
    assert decoder.finish() is None
    head, end = events[0], events[-1]
    assert isinstance(head, KvStreamHead) and isinstance(end, KvStreamEnd)
    assert (head.request_id, head.token_ids, head.sampling) == (payload.request_id, payload.token_ids, payload.sampling)
    assert end.first_token == payload.first_token
    assert len(events) == 2 + 3 * len(rounds or [1])
    assert torch.equal(assemble(events, payload.kv, 0).view(torch.uint8), payload.kv.view(torch.uint8))
    whole, whole_decoder = feed([pack_kv(payload)], piece, fp)  # the same decoder takes a whole frame
    assert whole == [] and torch.equal(whole_decoder.finish().kv.view(torch.uint8), payload.kv.view(torch.uint8))


def test_a_stream_after_a_held_prefix_starts_at_kv_start():
    payload = make_payload(FP, 40)
    payload.kv_start, payload.prefix_hashes = 16, [b"h" * 16]
    payload.kv = payload.kv[:, :, 16:].contiguous()
    events, decoder = feed([frame_bytes(f) for f in stream_frames(payload, [10, 14])])
    decoder.finish()
    assert [ev.start for ev in events if isinstance(ev, LayerKv)] == [16] * 3 + [26] * 3
    assert torch.equal(assemble(events, payload.kv, 16), payload.kv)


def frames_of(rounds=(16, 21)) -> list[bytes]:
    return [frame_bytes(f) for f in stream_frames(make_payload(FP, 37), list(rounds))]


def refused(frames: list[bytes], match: str, limits=KvLimits()) -> None:
    with pytest.raises(KvCodecError, match=match):
        _, decoder = feed(frames, limits=limits)
        decoder.finish()


def test_every_cut_is_refused_at_finish():
    frames = frames_of()
    data = b"".join(frames)
    bounds = [sum(len(f) for f in frames[:k]) for k in range(len(frames))]
    cuts = sorted(c for c in {*bounds, *(b + 5 for b in bounds), *(b + 300 for b in bounds[1:])} if c < len(data))
    assert len(cuts) > 2 * len(frames)
    for cut in cuts:
        refused([data[:cut]], "truncated stream")


def test_damaged_reordered_duplicated_and_missing_layer_frames_are_refused():
    f = frames_of()  # head, 3 layers of 16 positions, 3 layers of 21, end
    bad = bytearray(f[2])
    bad[-1] ^= 0x01
    refused([f[0], f[1], bytes(bad)], r"checksum mismatch in layer 1")
    refused([f[0], f[2], f[1]], r"out of order: got layer 1, expected layer 0")
    refused([f[0], f[1], f[1]], r"out of order: got layer 0, expected layer 1")
    refused([f[0], f[1], f[2], f[3], f[1]], r"positions 0\.\.15: expected positions from 16")
    refused([f[0], f[1], f[2], f[3], f[7]], r"ended with missing layers: .* up to 16 of 37")
    refused([f[0], f[1], f[2], f[7]], r"ended with missing layers")
    refused([f[0], f[4]], r"positions 16\.\.36: expected positions from 0")
    refused([f[0], f[0]], r"expected a 'layer' or 'end' frame after the head, got 'head'")
    refused([f[1]], r"starts with a 'head' or 'kv' frame, not 'layer'")
    refused([*f, f[7]], r"trailing bytes after the end frame")


def forge(frame: bytes, **changes) -> bytes:
    header, body = split(frame)
    header.update(changes)
    return join(header, body)


def test_forged_frames_are_refused():
    f = frames_of()
    refused([forge(f[0], version=2)], r"unsupported format version 2 \(expected 3\)")
    refused([f[0], forge(f[1], version=4)], r"unsupported format version 4 \(expected 3\)")
    refused([forge(f[0], fingerprint={**FP.to_dict(), "num_layers": 4})], "fingerprint mismatch: num_layers 4 != 3")
    refused([f[0], forge(f[1], fingerprint="0" * 64)], "fingerprint mismatch: digest")
    refused([f[0], forge(f[1], request_id="other")], "frame of request 'other' in the stream of 'req-0'")
    refused([f[0], forge(f[1], nbytes=8)], r"layer frame nbytes 8 != 3072 implied by its 16 positions")
    refused([f[0], forge(f[1], tokens="16")], "header key 'tokens' must be int")
    refused([forge(f[0], nbytes=4)], "a head frame carries no tensor bytes")
    end = forge(f[7], nbytes=1)
    refused([*f[:7], end], "an end frame carries no tensor bytes")
    refused([b"PDKX" + f[0][4:]], "bad magic")


def test_sizes_are_checked_against_the_limits_before_any_allocation():
    f = frames_of()
    refused(f, "too many tokens: 37 > limit 36", KvLimits(max_tokens=36))
    refused(f, r"tensor too large: \d+ bytes > limit 1000", KvLimits(max_tensor_bytes=1000))
    refused(f, "header too large", KvLimits(max_header_bytes=100))

    sizes = []
    decoder = KvStreamDecoder(FP, alloc=lambda n: sizes.append(n) or torch.empty(n, dtype=torch.uint8))
    with pytest.raises(KvCodecError, match="nbytes"):
        decoder.add(f[0])
        decoder.add(forge(f[1], nbytes=1 << 40))
    assert sizes == []


def test_paged_layer_reads_and_writes_match_the_slot_mapping():
    bs, cache = 4, torch.randn(2, 10, 4, 2, 3)
    table = [3, 4, 7, 8, 9, 0]

    def by_slot(start: int, end: int) -> torch.Tensor:
        return torch.stack([cache[:, table[p // bs], p % bs] for p in range(start, end)], dim=1)

    for start, end in [(0, 24), (1, 5), (5, 19), (3, 4), (8, 12), (13, 23)]:
        assert torch.equal(read_layer(cache, table, start, end), by_slot(start, end))
    other = torch.zeros_like(cache)
    write_layer(other, table, 5, by_slot(5, 19))
    assert torch.equal(read_layer(other, table, 5, 19), by_slot(5, 19))
    assert other.count_nonzero() == by_slot(5, 19).count_nonzero()
    with pytest.raises(ValueError, match="freed outside the sliding window"):
        read_layer(cache, [-1, 2], 0, 8)
    with pytest.raises(ValueError, match="need 3 blocks"):
        read_layer(cache, table[:2], 0, 9)


def test_the_layer_hook_runs_after_each_layer_of_prefill_steps_only(embedded_dir):
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.params import SamplingParams

    engine = LLMEngine(EngineConfig(model=str(embedded_dir), num_kv_blocks=32, max_num_batched_tokens=16))
    calls = []

    def hook(batch, layer, cache):
        seq = batch.seqs[0]
        end = seq.num_computed_tokens + batch.num_query_tokens[0]
        assert cache.data_ptr() == engine.runner.kv_cache[layer].data_ptr()
        calls.append((layer, end))

    engine.runner.layer_hook = hook
    seq = engine.add_request("r", list(range(5, 45)), SamplingParams(max_tokens=3, ignore_eos=True))
    while engine.has_work():
        engine.step()
    num_layers = engine.model_cfg.num_layers
    assert calls == [(i, e) for e in (16, 32, 40) for i in range(num_layers)]  # 40 positions in chunks of 16
    assert len(seq.output_token_ids) == 3  # the decode steps called no hook
    engine.runner.layer_hook = None  # unset: the model's loop gets none either
    engine.add_request("s", [5, 6], SamplingParams(max_tokens=1))
    engine.step()
    assert engine.runner.model.layer_hook is None and len(calls) == 3 * num_layers

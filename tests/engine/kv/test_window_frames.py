"""Layer-wise KV streams of a model with sliding-window layers (engine/kv/layer_frames.py): a
windowed layer's frames hold only the positions the first decode query's window reads, a round
wholly before that window gives it an empty frame, and a frame that holds more is refused."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.kv.codec import KvCodecError
from pdserve.engine.kv.fingerprint import layer_layout, layout_windows
from pdserve.engine.kv.layer_frames import LayerKv, encode_layer, frame_start, stream_frames
from tests.engine.kv._kv_payloads import make_fp, make_payload
from tests.engine.kv.test_kv_layer_frames import assemble, feed, frame_bytes

WINDOWS = [8, None, 8]  # Gemma's pattern: sliding, global, sliding
FP = make_fp(num_layers=3, block_size=4, layers=layer_layout([8] * 3, WINDOWS))


def test_a_layout_reads_back_as_each_layers_window():
    assert layout_windows(FP.layers) == WINDOWS
    assert layout_windows("2x64/full,1x64/w4096") == [None, None, 4096] and layout_windows("-") == []
    with pytest.raises(KvCodecError, match="malformed layer layout"):
        layout_windows("2x64/sliding")


def test_frame_start_clips_to_the_block_of_the_first_decode_querys_window():
    # 37 prompt tokens: the query at 37 reads 30..37, whose block starts at 28
    assert frame_start(None, 4, 37, 0, 16) == 0
    assert frame_start(8, 4, 37, 0, 16) == 16  # nothing of this round: an empty frame at its end
    assert frame_start(8, 4, 37, 16, 37) == 28
    assert frame_start(8, 4, 37, 30, 37) == 30
    assert frame_start(64, 4, 37, 0, 37) == 0  # a window longer than the prompt keeps all


@pytest.mark.parametrize("rounds", [None, [16, 21], [30, 7]])
def test_windowed_layers_send_only_their_window(rounds):
    payload = make_payload(FP, 37)
    frames = [frame_bytes(f) for f in stream_frames(payload, rounds)]
    events, decoder = feed(frames, 7, FP)
    assert decoder.finish() is None
    layers = [ev for ev in events if isinstance(ev, LayerKv)]
    assert all(ev.start >= 28 for ev in layers if ev.layer != 1)
    assert sum(ev.kv.shape[1] for ev in layers if ev.layer == 1) == 37
    assert sum(ev.kv.shape[1] for ev in layers if ev.layer != 1) == 2 * 9
    kv = assemble(events, payload.kv, 0)
    assert torch.equal(kv[1], payload.kv[1])
    assert torch.equal(kv[[0, 2], :, 28:], payload.kv[[0, 2], :, 28:]) and kv[[0, 2], :, :28].isnan().all()
    full = sum(len(f) for f in frames)
    dense = sum(len(frame_bytes(f)) for f in stream_frames(make_payload(make_fp(num_layers=3, block_size=4), 37)))
    assert full < 0.55 * dense  # two of three layers send 9 of 37 positions


def test_a_windowed_frame_holding_positions_before_its_window_is_refused():
    payload = make_payload(FP, 37)
    frames = stream_frames(payload)
    forged = encode_layer(payload.request_id, FP.digest(), 0, 0, payload.kv[0])  # layer 0 sends all 37
    with pytest.raises(KvCodecError, match=r"layer 0 frame of positions 0\.\.36: expected positions from 28 to 36"):
        feed([frame_bytes(f) for f in [frames[0], forged, *frames[2:]]], None, FP)

"""Video as a modality: Qwen2-VL token counts against a brute-force patchify, payload frames against PyAV
decoding every frame directly, metadata from ``key.json`` equal to the probed container, zero-redundancy
reads counted in decoded videos and frames (and the TP broadcast of frames), damaged and hostile videos
skipped or replaced by placeholders with their reason, and ``write_dataset`` over a folder of videos."""

from __future__ import annotations

import io
import json
import math

import av
import msgpack
import numpy as np
import pytest
import torch
import torch.distributed as dist
from PIL import Image

from omni_data import (
    EncoderCost,
    GroupedReorderer,
    ImageTokens,
    PayloadReader,
    UndecodablePayloadError,
    VideoTokens,
    WebDatasetSource,
    ZeroRedundancyFilter,
    split_encoder_microbatches,
)
from omni_data.testing import (
    encode_mp4,
    image_samples,
    packed_loader,
    train_tiny_bpe,
    video_samples,
    write_shards,
)
from omni_data.write import write_dataset
from omni_parallel.flops import forward_flops
from omni_parallel.testing import run_world

# small frames and few of them: tokens stay well under a pack, decoding stays fast
VT = VideoTokens(
    fps=2.0, min_frames=2, max_frames=8, frame=ImageTokens(min_pixels=28 * 28, max_pixels=56 * 84)
)


def _hf_num_frames(total: int, video_fps: float, fps: float, min_f: int, max_f: int, tp: int) -> int:
    """Hugging Face ``Qwen2VLVideoProcessor.sample_frames`` (transformers 4.5x), transcribed line by line."""
    max_frames = math.floor(min(max_f, total) / tp) * tp
    n = total / video_fps * fps
    n = min(max(n, min_f), max_frames, total)
    return math.floor(n / tp) * tp


def _hf_smart_resize(h: int, w: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen2-VL's ``smart_resize`` (transformers ``image_processing_qwen2_vl``), transcribed."""
    h_bar, w_bar = round(h / factor) * factor, round(w / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(h * w / max_pixels)
        h_bar = max(factor, math.floor(h / beta / factor) * factor)
        w_bar = max(factor, math.floor(w / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (h * w))
        h_bar, w_bar = math.ceil(h * beta / factor) * factor, math.ceil(w * beta / factor) * factor
    return h_bar, w_bar


def _patchified_rows(t: int, h: int, w: int, tp: int = 2, patch: int = 14, merge: int = 2) -> int:
    """Rows of Qwen2-VL's ``patchify`` of a ``[t, 3, h, w]`` video: pad to a multiple of ``tp`` frames by
    repeating the last, cut into ``tp x patch x patch`` patches, merged ``merge x merge`` (counted by
    building the tensor, without storage, and reshaping it as the processor does)."""
    v = torch.empty(1, t, 3, h, w, device="meta")
    if pad := -t % tp:
        v = torch.cat([v, v[:, -1:].expand(-1, pad, -1, -1, -1)], dim=1)
    gt, gh, gw = v.shape[1] // tp, h // patch, w // patch
    p = v.view(1, gt, tp, 3, gh // merge, merge, patch, gw // merge, merge, patch)
    rows = p.permute(0, 1, 4, 7, 5, 8, 3, 2, 6, 9).reshape(gt * gh * gw, -1).shape[0]
    return rows // (merge * merge)


def test_token_counts_match_brute_force():
    for total in (1, 2, 3, 5, 9, 20, 61, 300, 2000):
        for video_fps in (1.0, 7.5, 10.0, 23.976, 30.0):
            for vt in (
                VT,
                VideoTokens(),
                VideoTokens(fps=0.5, min_frames=4, max_frames=16, temporal_patch=3),
            ):
                n = _hf_num_frames(total, video_fps, vt.fps, vt.min_frames, vt.max_frames, vt.temporal_patch)
                n = n if n >= 1 else total  # shorter than one temporal patch: every frame (documented)
                assert vt.num_sampled(total, video_fps) == n, (total, video_fps, vt)
                idx = vt.indices(total, video_fps)
                ref = [int(x) for x in torch.arange(0, total, total / n).int().tolist()][:n]
                assert idx == ref and len(idx) == n and idx == sorted(set(idx)) and idx[-1] < total
                for h, w in ((84, 112), (576, 768), (17, 400), (720, 1280)):
                    f = vt.frame
                    rh, rw = _hf_smart_resize(h, w, f.patch * f.merge, f.min_pixels, f.max_pixels)
                    if vt.temporal_patch == 2:
                        assert vt.tokens(total, video_fps, h, w) == _patchified_rows(n, rh, rw), (total, h, w)
                    grid = (-(-n // vt.temporal_patch), rh // 14, rw // 14)
                    assert vt.grid(total, video_fps, h, w) == grid
                    assert vt.patches(total, video_fps, h, w) == grid[0] * grid[1] * grid[2]
    with pytest.raises(ValueError, match="frames and a frame rate"):
        VT.num_sampled(0, 10.0)
    with pytest.raises(ValueError, match="min_frames"):
        VideoTokens(min_frames=5, max_frames=4)


def _pyav_frames(data: bytes, indices: list[int], size: tuple[int, int]) -> np.ndarray:
    """Every frame decoded by PyAV, then the sampled ones resized with PIL bicubic: the reference."""
    with av.open(io.BytesIO(data)) as c:
        every = [f.to_image() for f in c.decode(video=0)]
    h, w = size
    picked = [np.asarray(every[i].resize((w, h), Image.Resampling.BICUBIC)) for i in indices]
    # the image path's scaling (payload.py): uint8 -> float32 times float32(1/255)
    return np.stack(picked).transpose(0, 3, 1, 2).astype(np.float32) * np.float32(1.0 / 255.0)


@pytest.fixture(scope="module")
def tok():
    return train_tiny_bpe()


def test_payload_frames_equal_pyav_and_json_equals_probe(tmp_path, tok):
    clips = list(video_samples(6, seed=3, frames=(1, 14), fps=5))
    write_shards(f"{tmp_path}/v-%03d.tar", clips, per_shard=6)
    bare = [{k: v for k, v in s.items() if k != "json"} for s in clips]
    write_shards(f"{tmp_path}/b-%03d.tar", bare, per_shard=6)
    kw = dict(modality="video", tokenizer=tok, video_tokens=VT)
    metas = list(WebDatasetSource(f"{tmp_path}/v-000.tar", **kw))
    probed = list(WebDatasetSource(f"{tmp_path}/b-000.tar", **kw))
    assert [m.key for m in metas] == [s["__key__"] for s in clips]
    reader = PayloadReader(tok)
    for m, p, s in zip(metas, probed, clips):
        info = json.loads(s["json"])
        # planning from key.json reads no video byte and agrees with the container probed whole
        assert (m.frames, m.fps, m.shape, m.media_tokens) == (p.frames, p.fps, p.shape, p.media_tokens)
        assert m.frames == info["frames"] and m.fps == info["fps"]
        n = VT.num_sampled(info["frames"], info["fps"])
        rh, rw = VT.frame.resize(info["height"], info["width"])
        assert m.shape == (n, 3, rh, rw)
        assert m.media_tokens == VT.tokens(info["frames"], info["fps"], info["height"], info["width"])
        # encoder cost: attention within each of the ceil(n / 2) temporal slices of (rh/14)(rw/14) patches
        slice_len = (rh // VT.frame.patch) * (rw // VT.frame.patch)
        slices = [slice_len] * -(-n // VT.temporal_patch)
        assert m.encoder_flops == forward_flops(EncoderCost().shape, slices, causal=False), m.key
        got = reader.read(m)
        want = _pyav_frames(s["mp4"], VT.indices(info["frames"], info["fps"]), (rh, rw))
        assert got.frames is not None and got.frames.dtype == torch.float32
        assert np.array_equal(got.frames.numpy(), want), m.key
        assert tok.decode(got.text_ids.tolist()) == s["txt"]
    assert reader.stats["videos"] == len(clips)
    assert reader.stats["video_frames"] == sum(m.shape[0] for m in metas)
    reader.close()


def _zr_shards(d):
    vids = list(video_samples(24, seed=1, frames=(2, 10), fps=4))
    # the body of one clip flipped after its first bytes: its json still plans it, its decode fails
    vids[5]["mp4"] = vids[5]["mp4"][:48] + bytes(b ^ 0x5A for b in vids[5]["mp4"][48:])
    write_shards(f"{d}/vid-%03d.tar", vids, per_shard=12)
    write_shards(f"{d}/img-%03d.tar", image_samples(24, sizes=(16, 40)), per_shard=12)


def _filter(d, tok, consumes, reader, tp_group=None):
    kw = dict(tokenizer=tok, epochs=None)
    sources = {
        "vid": WebDatasetSource(
            f"{d}/vid-{{000..001}}.tar", modality="video", name="vid", video_tokens=VT, **kw
        ),
        "img": WebDatasetSource(f"{d}/img-{{000..001}}.tar", modality="image", name="img", **kw),
    }
    loader = packed_loader(
        sources, {"vid": 0.5, "img": 0.5}, max_seq_len=256, buffer_size=16, packs_per_step=4
    )
    return ZeroRedundancyFilter(
        loader,
        consumes=consumes,
        microbatches=2,
        slices=2,
        reader=reader,
        tp_group=tp_group,
        decode_workers=2,
        prefetch=0,  # no step read ahead: the reader's counts are exactly the steps taken
    )


def test_zero_redundancy_decodes_each_video_once_counted(tmp_path, tok):
    _zr_shards(tmp_path)
    readers = {c: PayloadReader(tok) for c in ((1, 3), (2, 4))}
    filters = {c: _filter(tmp_path, tok, list(c), readers[c]) for c in readers}
    decoded = {c: [] for c in readers}
    placeholders = 0
    try:
        for _ in range(4):
            steps = {c: next(f) for c, f in filters.items()}
            packs = steps[(1, 3)].packs
            assert [p.keys for p in packs] == [p.keys for p in steps[(2, 4)].packs]  # same metadata
            mbs = split_encoder_microbatches(packs, 2, 2)
            videos = sorted((p, i) for e in mbs for p, i in mbs[e] if packs[p].samples[i].modality == "video")
            mine = {c: sorted((p, i) for e in c for p, i in mbs[e] if (p, i) in videos) for c in steps}
            # the two pipeline ranks' encoder microbatches hold every video of the step, none twice
            assert sorted(mine[(1, 3)] + mine[(2, 4)]) == videos and videos
            for c, step in steps.items():
                want = [packs[p].samples[i] for e in c for p, i in mbs[e]]
                got = [pl for e in c for pl in step.payloads[e]]
                assert [pl.meta.uid for pl in got] == [m.uid for m in want]
                for pl in got:
                    if pl.meta.modality == "video":
                        assert pl.frames is not None and tuple(pl.frames.shape) == pl.meta.shape
                        placeholders += pl.error is not None
                        decoded[c].append(pl.meta)
        assert decoded[(1, 3)] and decoded[(2, 4)]
        for c, reader in readers.items():
            good = [m for m in decoded[c] if m.key != "vid000005"]
            # each pipeline rank decoded exactly the videos of its own encoder microbatches, no frame more
            assert reader.stats["videos"] == len(good)
            assert reader.stats["video_frames"] == sum(m.shape[0] for m in good)
            # ... and decoded each only up to its last sampled frame (presentation order, no B-frames here)
            assert reader.stats["video_frames_decoded"] == sum(
                VT.indices(m.frames, m.fps)[-1] + 1 for m in good
            )
            assert reader.stats["video_frames_decoded"] < sum(m.frames for m in good)
        assert placeholders >= 1
        # each placeholder counted once, by the rank that read it, under its reason
        assert sum(f.skipped.get("undecodable video payload", 0) for f in filters.values()) == placeholders
        assert all(set(f.skipped) <= {"undecodable video payload"} for f in filters.values())
        # exact resume: a filter built afresh from the state (msgpack, video metadata inside) gives the
        # same next step, frames included, as the one that went on
        state = msgpack.unpackb(msgpack.packb(filters[(1, 3)].state_dict()), strict_map_key=False)
        with _filter(tmp_path, tok, [1, 3], PayloadReader(tok)) as resumed:
            resumed.load_state_dict(state)
            a, b = next(filters[(1, 3)]), next(resumed)
        assert [p.keys for p in a.packs] == [p.keys for p in b.packs]
        for e in a.payloads:
            for x, y in zip(a.payloads[e], b.payloads[e]):
                assert x.meta == y.meta and (x.frames is None or torch.equal(x.frames, y.frames))
    finally:
        for f in filters.values():
            f.close()


def _tp_worker(rank, world, d):
    tok = train_tiny_bpe()
    reader = PayloadReader(tok)
    group = dist.new_group([0, 1])
    with _filter(d, tok, [1, 2, 3, 4], reader, tp_group=group) as f:
        step = next(f)
    pays = [pl for e in sorted(step.payloads) for pl in step.payloads[e] if pl.frames is not None]
    frames = [pl.frames.clone() for pl in pays]
    # grouped reordering over the 2 ranks: each holds half of the videos, the plan balances their
    # costs, dispatch moves the frames ([T, 3, H, W]) in one all-to-all, restore brings rows back
    mine = pays[rank::2]
    plan = GroupedReorderer(group=dist.group.WORLD).plan([pl.meta for pl in mine])
    got = plan.dispatch([pl.frames for pl in mine])
    uids = [plan.metas[r][i].uid for r, i in plan.received]
    return {"frames": frames, "videos": reader.stats["videos"], "got": list(zip(uids, got)), "all": pays}


def test_tp_rank_one_receives_the_frames_rank_zero_decoded(tmp_path):
    _zr_shards(tmp_path)
    out = run_world(_tp_worker, 2, args=(str(tmp_path),), timeout_s=120)
    assert out[0]["videos"] > 0 and out[1]["videos"] == 0  # only TP rank 0 decodes
    assert len(out[0]["frames"]) == len(out[1]["frames"])
    assert all(torch.equal(a, b) for a, b in zip(out[0]["frames"], out[1]["frames"]))
    # after the reorder every video is on exactly one rank, with the frames it was read with
    want = {pl.meta.uid: pl.frames for pl in out[0]["all"]}  # a cycling source may draw a video twice
    got = [u for r in (0, 1) for u, _ in out[r]["got"]]
    assert sorted(got) == sorted(pl.meta.uid for pl in out[0]["all"]) and out[0]["got"] and out[1]["got"]
    assert all(torch.equal(x, want[u]) for r in (0, 1) for u, x in out[r]["got"])


def test_bad_videos_are_skipped_or_refused_with_their_reason(tmp_path, tok):
    good = list(video_samples(3, seed=5, frames=(4, 6)))
    garbage = {"__key__": "garbage", "mp4": b"\x00\x00\x00\x18ftypisom" + bytes(range(256)) * 4, "txt": "x"}
    empty = {"__key__": "empty", "mp4": b"", "txt": "x"}
    bomb_info = {"frames": 4, "fps": 4, "width": 100_000, "height": 100_000}
    bomb = {**good[0], "__key__": "bomb", "json": json.dumps(bomb_info).encode()}
    still = {
        **good[1],
        "__key__": "still",
        "json": json.dumps({**bomb_info, "frames": 0, "width": 32}).encode(),
    }
    lying = {**good[2], "__key__": "lying"}
    lying["json"] = json.dumps({**json.loads(good[2]["json"]), "frames": 400, "fps": 4}).encode()
    # garbage bytes behind a good key.json: planned from the json alone (no video byte read to plan)
    planned = {**garbage, "__key__": "planned", "json": good[0]["json"]}
    samples = [good[0], garbage, empty, bomb, still, lying, planned]
    write_shards(f"{tmp_path}/bad-%03d.tar", samples, per_shard=10)
    src = WebDatasetSource(f"{tmp_path}/bad-000.tar", modality="video", tokenizer=tok, video_tokens=VT)
    metas = {m.key: m for m in src}
    assert sorted(metas) == ["lying", "planned", "vid000000"]
    assert metas["planned"].shape == metas["vid000000"].shape
    assert src.skipped == {
        "undecodable video": 1,
        "empty file": 1,
        "video over the pixel limit": 1,
        "empty video": 1,
    }
    assert dict((k, r) for k, r in src.skipped_keys)["garbage"] == "undecodable video"
    reader = PayloadReader(tok)
    # a video shorter than its json says: the sampled frames past its end cannot be decoded, named
    with pytest.raises(
        UndecodablePayloadError, match=r"lying .*video decodes to \d+ frames, frame \d+ was sampled"
    ):
        reader.read(metas["lying"])
    with pytest.raises(UndecodablePayloadError, match=r"planned .*undecodable video: FFmpeg"):
        reader.read(metas["planned"])

    # write_dataset: a folder of videos (one good, one damaged, one empty) -> shards the loader reads
    src_dir = tmp_path / "clips"
    src_dir.mkdir()
    (src_dir / "walk.mp4").write_bytes(good[0]["mp4"])
    (src_dir / "walk.txt").write_text("a clip of a gradient moving")
    (src_dir / "broken.mp4").write_bytes(garbage["mp4"])
    (src_dir / "nothing.webm").write_bytes(b"")
    report = write_dataset(src_dir, str(tmp_path / "out"), per_shard=4)
    assert report.samples == {"video": 1}
    assert report.skipped == {
        "undecodable video (ValueError)": ["broken.mp4"],
        "empty file": ["nothing.webm"],
    }
    written = list(WebDatasetSource(report.shards["video"], modality="video", tokenizer=tok, video_tokens=VT))
    info = json.loads(good[0]["json"])
    assert [(m.key, m.frames, m.fps) for m in written] == [("walk", info["frames"], float(info["fps"]))]
    got = reader.read(written[0]).frames.numpy()
    assert np.array_equal(
        got, _pyav_frames(good[0]["mp4"], VT.indices(info["frames"], info["fps"]), got.shape[2:])
    )
    reader.close()


def test_encode_mp4_round_trips_frame_count():
    clip = np.zeros((5, 16, 24, 3), dtype=np.uint8)
    with av.open(io.BytesIO(encode_mp4(clip, 3))) as c:
        assert sum(1 for _ in c.decode(video=0)) == 5

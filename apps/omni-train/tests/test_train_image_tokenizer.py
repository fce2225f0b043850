"""The VQ image tokenizer (issue 30, understanding with generation): committed weights, training, files.

Cheap (a few seconds in all): the committed weights are checked on the held-out images only, and
training runs a tiny config for a few dozen steps on a handful of images.
"""

from __future__ import annotations

import hashlib
import json
import math

import pytest
import torch
import torch.nn.functional as F

from omni_train.data import shard_paths
from omni_train.models import image_tokenizer as it
from omni_train.models.image_tokenizer import (
    DEFAULT_IMAGE_TOKENIZER_PATH,
    ImageTokenizer,
    ImageTokenizerConfig,
    ImageTokenizerFileError,
    letterbox,
    psnr,
    sidecar_path,
)
from omni_train.prepare import image_tokenizer as prep
from omni_train.prepare import main as prepare_main
from omni_train.prepare.image_tokenizer import (
    WEIGHTS_NAME,
    TrainSettings,
    build_image_tokenizer,
    evaluate,
    is_held_out,
    load_images,
    train_image_tokenizer,
)

# The committed weights' held-out PSNR is in the README ("Image tokenizer"); for scale, on the same 64
# images: a random-init tokenizer 7.0 dB, the all-white image 8.9 dB, 8 x 8 RGB pixels upsampled 18.2 dB.
HELD_OUT_PSNR_FLOOR_DB = 20.0
TINY = ImageTokenizerConfig(channels=16, res_blocks=1, code_dim=8, codebook_size=64)


@pytest.fixture(autouse=True)
def _one_thread():
    # tiny convolutions: intra-op threads only add synchronisation (seconds on shared cores)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_committed_weights_held_out_psnr_above_floor():
    model = ImageTokenizer.load()  # checks size, sha256 and config against the sidecar
    sidecar = json.loads(sidecar_path(DEFAULT_IMAGE_TOKENIZER_PATH).read_text())
    held = load_images(shard_paths("image"), model.config.image_size, select=is_held_out)
    assert len(held.keys) == sidecar["held_out_images"] and all(is_held_out(k) for k in held.keys)
    got = evaluate(model, held.pixels)
    assert got["psnr_db"] >= HELD_OUT_PSNR_FLOOR_DB, got
    # the number the sidecar (and the README) report is this one, recomputed
    assert got["psnr_db"] == pytest.approx(sidecar["held_out_psnr_db"], abs=0.05)
    # brute-force PSNR of one image: 10 log10(1 / mean squared error)
    one = held.pixels[:1]
    recon = model.decode(model.encode(one))
    mse = (
        sum((float(a) - float(b)) ** 2 for a, b in zip(recon.flatten(), one.flatten(), strict=True))
        / one.numel()
    )
    assert psnr(recon, one) == pytest.approx(10 * math.log10(1 / mse), abs=1e-9)


def test_codes_in_range_and_shapes():
    model = ImageTokenizer(ImageTokenizerConfig(), seed=3).eval()
    h, w = model.grid
    assert (h, w) == (8, 8) and model.codebook_size == 512
    pixels = torch.rand(5, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    codes = model.encode(pixels)
    assert codes.dtype == torch.int64 and codes.shape == (5, h, w)
    assert int(codes.min()) >= 0 and int(codes.max()) < model.codebook_size
    # brute force: each code is the codebook row of largest cosine with the encoder output there
    z = model.embed(pixels).permute(0, 2, 3, 1).reshape(-1, model.config.code_dim).double()
    book = model.codebook.weight.double()
    cos = (z / z.norm(dim=1, keepdim=True)) @ (book / book.norm(dim=1, keepdim=True)).t()
    assert torch.equal(codes.reshape(-1), cos.argmax(dim=1))
    out = model.decode(codes)
    assert out.shape == (5, 3, 32, 32) and out.dtype == torch.float32
    assert float(out.min()) >= 0.0 and float(out.max()) <= 1.0
    recon, vq_loss, fwd_codes = model(pixels)
    assert recon.shape == (5, 3, 32, 32) and vq_loss.dim() == 0 and torch.equal(fwd_codes, codes)
    # a decoded bundled-size image [3, H, W]: letterboxed on white, h*w codes in raster order
    wide = torch.zeros(3, 56, 112)
    boxed = letterbox(wide, 32)
    assert boxed.shape == (3, 32, 32)
    assert (
        torch.all(boxed[:, :8] == 1.0)
        and torch.all(boxed[:, 24:] == 1.0)
        and torch.all(boxed[:, 8:24] == 0.0)
    )
    flat = model.encode_image(wide)
    assert flat.shape == (h * w,) and torch.equal(flat, model.encode(boxed[None]).reshape(-1))
    for bad in (codes + model.codebook_size, codes.to(torch.int32), codes[:, :4]):
        with pytest.raises(ValueError, match=r"ImageTokenizer\.decode"):
            model.decode(bad)
    with pytest.raises(ValueError, match=r"\[n, 3, 32, 32\]"):
        model.encode(torch.rand(2, 3, 16, 16))


def test_straight_through_gradient_reaches_encoder():
    torch.manual_seed(0)
    model = ImageTokenizer(TINY, seed=1)
    x = torch.rand(4, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    recon, _, codes = model(x)
    F.mse_loss(recon, x).backward()
    got = {n: p.grad.clone() for n, p in model.encoder.named_parameters()}
    assert model.codebook.weight.grad is None  # the reconstruction loss does not move the codebook
    assert all(float(g.abs().sum()) > 0 for g in got.values())
    # reference: the decoder's gradient at its (quantised) input, pushed through the encoder as is
    model.zero_grad(set_to_none=True)
    z_q = F.normalize(model.codebook.weight.detach()[codes], dim=-1).permute(0, 3, 1, 2).requires_grad_()
    F.mse_loss((model.decoder(z_q) + 1.0) * 0.5, x).backward()
    model.embed(x).backward(z_q.grad)
    for name, p in model.encoder.named_parameters():
        torch.testing.assert_close(got[name], p.grad, rtol=1e-5, atol=1e-8)
    # the codebook and commitment losses: the codebook moves towards the encoder outputs, and back
    model.zero_grad(set_to_none=True)
    _, vq_loss, _ = model(x)
    vq_loss.backward()
    assert float(model.codebook.weight.grad.abs().sum()) > 0
    assert float(model.encoder[-1].weight.grad.abs().sum()) > 0


def test_short_training_lowers_reconstruction_loss_deterministically():
    pixels = load_images(shard_paths("image"), TINY.image_size, limit=16).pixels
    settings = TrainSettings(steps=40, batch=8, lr=3e-3, warmup=5, restart_every=10, seed=7)
    before = evaluate(ImageTokenizer(TINY, seed=7), pixels)["psnr_db"]
    model, losses = train_image_tokenizer(pixels, TINY, settings)
    after = evaluate(model, pixels)["psnr_db"]
    assert sum(losses[-5:]) / 5 < 0.5 * sum(losses[:5]) / 5, losses
    assert after > before + 3.0, (before, after)
    again, again_losses = train_image_tokenizer(pixels, TINY, settings)
    assert again_losses == losses
    for (name, a), b in zip(model.state_dict().items(), again.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_build_writes_loadable_weights_and_the_held_out_psnr(tmp_path):
    settings = TrainSettings(steps=6, batch=8, warmup=2, restart_every=3, seed=1)
    sidecar = build_image_tokenizer(tmp_path, limit=40, config=TINY, settings=settings, log_every=0)
    model = ImageTokenizer.load(tmp_path / WEIGHTS_NAME)
    assert model.config == TINY and sidecar["settings"]["steps"] == 6
    held = load_images(shard_paths("image"), TINY.image_size, limit=40, select=is_held_out)
    assert sidecar["held_out_images"] == len(held.keys) >= 1 and sidecar["train_images"] == 40 - len(
        held.keys
    )
    assert evaluate(model, held.pixels)["psnr_db"] == pytest.approx(sidecar["held_out_psnr_db"], abs=1e-3)


def test_bad_weight_files_are_refused_naming_the_file(tmp_path, monkeypatch):
    model = ImageTokenizer(TINY, seed=0)
    path = tmp_path / "tok.safetensors"
    sidecar = model.save(path, extra={"held_out_psnr_db": 1.0})
    side = sidecar_path(path)
    good_weights, good_side = path.read_bytes(), side.read_text()
    loaded = ImageTokenizer.load(path)
    assert all(
        torch.equal(a, b)
        for a, b in zip(loaded.state_dict().values(), model.state_dict().values(), strict=True)
    )
    assert not any(p.requires_grad for p in loaded.parameters()) and not loaded.training

    def refused(match: str) -> None:
        with pytest.raises(ImageTokenizerFileError, match=match) as e:
            ImageTokenizer.load(path)
        assert str(path) in str(e.value) or str(side) in str(e.value)
        path.write_bytes(good_weights)
        side.write_text(good_side)

    damaged = bytearray(good_weights)
    damaged[-7] ^= 0x40  # one bit of one weight
    path.write_bytes(bytes(damaged))
    refused("sha256")
    side.write_text(json.dumps(sidecar | {"sha256": "0" * 64}))
    refused("sha256")
    monkeypatch.setattr(it, "MAX_WEIGHTS_BYTES", len(good_weights) - 1)
    refused("allowed")
    monkeypatch.undo()
    side.unlink()
    refused("no such file")
    side.write_text("{not json")
    refused("not JSON")
    # a consistent pair (checksum right) whose tensors do not fit the config
    small = ImageTokenizer(ImageTokenizerConfig(channels=8, code_dim=8, codebook_size=64))
    small.save(tmp_path / "small.safetensors")
    other = json.loads(sidecar_path(tmp_path / "small.safetensors").read_text())
    path.write_bytes((tmp_path / "small.safetensors").read_bytes())
    side.write_text(json.dumps(other | {"config": TINY.to_dict()}))
    refused("differs")
    header = (tmp_path / "small.safetensors").read_bytes()
    path.write_bytes(b"\xff" * 8 + header[8:])
    side.write_text(
        json.dumps(
            other | {"bytes": len(header), "sha256": hashlib.sha256(b"\xff" * 8 + header[8:]).hexdigest()}
        )
    )
    refused("not a safetensors file")
    side.write_text(json.dumps(sidecar | {"config": TINY.to_dict() | {"codebook_size": 0}}))
    refused("codebook_size")


def test_prepare_data_refuses_overwriting_the_committed_weights_with_a_slice(capsys, monkeypatch):
    def must_not_train(*args, **kwargs):
        raise AssertionError("prepare-data trained a slice into the committed weights' folder")

    monkeypatch.setattr(prep, "build_image_tokenizer", must_not_train)
    assert prepare_main(["--source", "image-tokenizer", "--limit", "8"]) == 2
    assert "--out" in capsys.readouterr().err

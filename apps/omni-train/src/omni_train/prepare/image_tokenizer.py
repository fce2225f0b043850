"""Train the VQ image tokenizer on the bundled openclipart shards (`prepare-data --source image-tokenizer`).

Images are read as the trainer's loader reads them (`omni_data.WebDatasetSource` metadata and
`omni_data.PayloadReader` decode, resized to the recipes' ViT bounds), then :func:`letterbox`-ed to
``S x S``. A fixed rule splits them by key: ``sha256(key) mod 10 == 0`` is held out (about 10%), the rest
trains, so the split does not depend on shard order or count. Training is Adam on
``MSE(recon, pixels) + vq_loss`` with random horizontal flips, a cosine learning rate and dead-code
restarts (a code unused for ``restart_every`` steps is moved onto a random encoder output of the current
batch, as in Dhariwal et al. 2020 "Jukebox" §3.2 / Zeghidour et al. 2021 "SoundStream" §3.3), all drawn
from one seeded ``torch.Generator``: the same seed on the same machine and thread count gives the same
weights. The held-out and train PSNR (:func:`omni_train.models.image_tokenizer.psnr`, pooled over each
set) go into the sidecar next to the weights.
"""

from __future__ import annotations

import hashlib
import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from omni_train.models.image_tokenizer import (
    ImageTokenizer,
    ImageTokenizerConfig,
    letterbox,
    psnr,
)

__all__ = [
    "HELD_OUT_RULE",
    "WEIGHTS_NAME",
    "ImageSet",
    "TrainSettings",
    "build_image_tokenizer",
    "evaluate",
    "is_held_out",
    "load_images",
    "train_image_tokenizer",
]

WEIGHTS_NAME = "image-tokenizer.safetensors"
"""The weights file's name inside the output folder (its sidecar: ``image-tokenizer.json``)."""
HELD_OUT_RULE = "int(sha256(key utf-8).hexdigest(), 16) % 10 == 0 -> held out"
"""The split rule, as written into the sidecar."""
# The recipes' ViT resize bounds (configs/*.toml [model.vit]): images decode as the loader gives them.
_PATCH, _MERGE, _MIN_PIXELS, _MAX_PIXELS = 14, 2, 56 * 56, 112 * 112


def is_held_out(key: str) -> bool:
    """Whether the sample ``key`` is in the held-out split (:data:`HELD_OUT_RULE`, about 10% of keys)."""
    return int(hashlib.sha256(key.encode("utf-8")).hexdigest(), 16) % 10 == 0


@dataclass(frozen=True, slots=True)
class ImageSet:
    """Letterboxed images and their keys.

    Attributes:
        keys: sample keys, in shard order.
        pixels: ``[n, 3, S, S]`` float32 RGB in ``[0, 1]``.
    """

    keys: tuple[str, ...]
    pixels: torch.Tensor

    def split(self) -> tuple[ImageSet, ImageSet]:
        """``(train, held_out)`` by :func:`is_held_out`."""
        held = [is_held_out(k) for k in self.keys]
        pick = torch.tensor(held, dtype=torch.bool)
        return (
            ImageSet(tuple(k for k, h in zip(self.keys, held, strict=True) if not h), self.pixels[~pick]),
            ImageSet(tuple(k for k, h in zip(self.keys, held, strict=True) if h), self.pixels[pick]),
        )


def load_images(
    shards: list[Path], size: int, *, limit: int | None = None, select: Callable[[str], bool] | None = None
) -> ImageSet:
    """Read the images of image shards as the loader does and letterbox them to ``size``.

    Args:
        shards: WebDataset image shards (e.g. ``omni_train.data.shard_paths("image")``).
        size: ``S``, the tokenizer's image side.
        limit: look at only the first ``limit`` images in shard order (before ``select``).
        select: read only the images whose key it accepts (e.g. :func:`is_held_out`); the others are
            not decoded.

    Raises:
        ValueError: no image could be read from ``shards``.
    """
    from omni_data import ImageTokens, PayloadReader, WebDatasetSource

    tokens = ImageTokens(patch=_PATCH, merge=_MERGE, min_pixels=_MIN_PIXELS, max_pixels=_MAX_PIXELS)
    source = WebDatasetSource([str(p) for p in shards], modality="image", image_tokens=tokens)
    reader = PayloadReader()
    keys: list[str] = []
    images: list[torch.Tensor] = []
    try:
        for seen, meta in enumerate(source):
            if limit is not None and seen >= limit:
                break
            if select is not None and not select(meta.key):
                continue
            pixels = reader.read(meta).pixels
            assert pixels is not None  # an image sample always decodes to pixels
            keys.append(meta.key)
            images.append(letterbox(pixels, size))
    finally:
        reader.close()
    if not images:
        raise ValueError(f"no images in {[str(p) for p in shards]}")
    return ImageSet(tuple(keys), torch.stack(images))


@dataclass(frozen=True, slots=True)
class TrainSettings:
    """How :func:`train_image_tokenizer` trains.

    Attributes:
        steps: optimizer steps.
        batch: images per step (drawn without replacement within an epoch).
        lr: peak Adam learning rate (cosine to ``lr * 0.05`` after ``warmup`` linear steps).
        warmup: linear warm-up steps.
        restart_every: steps between dead-code restarts (0: never).
        seed: seeds the initial weights, the batch order, the flips and the restarts.
        threads: torch intra-op threads while training (restored after). One thread makes the result
            independent of the machine's core count and is the fastest on shared cores.
    """

    steps: int = 1200
    batch: int = 32
    lr: float = 2e-3
    warmup: int = 50
    restart_every: int = 100
    seed: int = 0
    threads: int = 1


def _lr_factor(step: int, s: TrainSettings) -> float:
    if step < s.warmup:
        return (step + 1) / s.warmup
    t = (step - s.warmup) / max(1, s.steps - s.warmup)
    return 0.05 + 0.95 * 0.5 * (1.0 + math.cos(math.pi * t))


def train_image_tokenizer(
    train: torch.Tensor, config: ImageTokenizerConfig, settings: TrainSettings, *, log_every: int = 0
) -> tuple[ImageTokenizer, list[float]]:
    """Train a tokenizer on ``train`` ``[n, 3, S, S]`` pixels.

    Returns:
        ``(model, losses)``: the trained model (eval mode) and the reconstruction MSE of every step.

    Raises:
        ValueError: ``train`` is not ``[n, 3, S, S]`` with ``n >= 1``, or ``steps``, ``batch`` or
            ``threads`` is < 1.
    """
    s = config.image_size
    if train.dim() != 4 or tuple(train.shape[1:]) != (3, s, s) or train.shape[0] < 1:
        raise ValueError(f"train_image_tokenizer: train must be [n, 3, {s}, {s}], got {list(train.shape)}")
    if settings.steps < 1 or settings.batch < 1 or settings.threads < 1:
        raise ValueError(f"train_image_tokenizer: steps and batch must be >= 1, got {settings}")
    threads = torch.get_num_threads()
    torch.set_num_threads(settings.threads)
    try:
        return _train(train, config, settings, log_every)
    finally:
        torch.set_num_threads(threads)


def _train(
    train: torch.Tensor, config: ImageTokenizerConfig, settings: TrainSettings, log_every: int
) -> tuple[ImageTokenizer, list[float]]:
    gen = torch.Generator().manual_seed(settings.seed)
    model = ImageTokenizer(config, seed=settings.seed).train()
    opt = torch.optim.Adam(model.parameters(), lr=settings.lr, betas=(0.9, 0.99))
    n = train.shape[0]
    order = torch.randperm(n, generator=gen)
    at = 0
    used = torch.zeros(config.codebook_size, dtype=torch.bool)
    losses: list[float] = []
    for step in range(settings.steps):
        if at + settings.batch > n:
            order, at = torch.randperm(n, generator=gen), 0
        idx = order[at : at + min(settings.batch, n)]
        at += settings.batch
        x = train[idx]
        flip = torch.rand(x.shape[0], generator=gen) < 0.5
        x = torch.where(flip[:, None, None, None], x.flip(3), x)
        for group in opt.param_groups:
            group["lr"] = settings.lr * _lr_factor(step, settings)
        recon, vq_loss, codes = model(x)
        mse = F.mse_loss(recon, x)
        opt.zero_grad(set_to_none=True)
        (mse + vq_loss).backward()
        opt.step()
        losses.append(float(mse.detach()))
        used[codes.reshape(-1)] = True
        if settings.restart_every and (step + 1) % settings.restart_every == 0 and step + 1 < settings.steps:
            _restart_dead_codes(model, x, used, gen)
            used.zero_()
        if log_every and (step + 1) % log_every == 0:
            print(
                f"step {step + 1}: mse {sum(losses[-log_every:]) / log_every:.5f} "
                f"(psnr {10 * math.log10(1 / max(1e-10, sum(losses[-log_every:]) / log_every)):.2f} dB)",
                flush=True,
            )
    return model.eval(), losses


@torch.no_grad()
def _restart_dead_codes(
    model: ImageTokenizer, x: torch.Tensor, used: torch.Tensor, gen: torch.Generator
) -> None:
    # Move each code unused since the last restart onto a random encoder output of this batch.
    dead = torch.nonzero(~used).reshape(-1)
    if dead.numel() == 0:
        return
    z = model.embed(x).permute(0, 2, 3, 1).reshape(-1, model.config.code_dim)
    pick = torch.randint(0, z.shape[0], (dead.numel(),), generator=gen)
    noise = torch.randn(dead.numel(), z.shape[1], generator=gen) * 0.01
    model.codebook.weight[dead] = z[pick] + noise


@torch.no_grad()
def evaluate(model: ImageTokenizer, pixels: torch.Tensor, *, batch: int = 128) -> dict[str, float]:
    """``psnr_db`` of ``decode(encode(pixels))`` against ``pixels`` (pooled MSE) and ``codes_used``
    (distinct code ids over the set)."""
    model.eval()
    recon, codes = [], []
    for i in range(0, pixels.shape[0], batch):
        c = model.encode(pixels[i : i + batch])
        codes.append(c)
        recon.append(model.decode(c))
    return {
        "psnr_db": round(psnr(torch.cat(recon), pixels), 3),
        "codes_used": int(torch.cat(codes).unique().numel()),
    }


def build_image_tokenizer(
    out: Path,
    *,
    shards: list[Path] | None = None,
    limit: int | None = None,
    config: ImageTokenizerConfig | None = None,
    settings: TrainSettings | None = None,
    log_every: int = 250,
) -> dict[str, Any]:
    """Train on the train split of ``shards`` (default: the bundled image shards) and write
    ``out/image-tokenizer.safetensors`` and its sidecar (config, sha256, held-out and train PSNR, split
    rule, settings, training wall and CPU seconds). ``limit``: read at most that many images (a slice of
    the data); training still runs ``settings.steps`` steps (default 1,200, about 10 minutes on 2 cores),
    so a small ``limit`` is not a quick run.

    Returns:
        The sidecar's content.

    Raises:
        ValueError: no image in ``shards``, or the split leaves no train or no held-out image.
    """
    from omni_train.data import shard_paths

    config = config if config is not None else ImageTokenizerConfig()
    settings = settings if settings is not None else TrainSettings()
    shards = shards if shards is not None else shard_paths("image")
    images = load_images(shards, config.image_size, limit=limit)
    train, held = images.split()
    if not train.keys or not held.keys:
        raise ValueError(
            f"split of {len(images.keys)} images leaves {len(train.keys)} train, {len(held.keys)} held out"
        )
    print(
        f"image tokenizer: {len(train.keys)} train, {len(held.keys)} held-out images ({HELD_OUT_RULE})",
        flush=True,
    )
    start, cpu_start = time.perf_counter(), time.process_time()
    model, losses = train_image_tokenizer(train.pixels, config, settings, log_every=log_every)
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    held_eval, train_eval = evaluate(model, held.pixels), evaluate(model, train.pixels)
    extra = {
        "held_out_psnr_db": held_eval["psnr_db"],
        "train_psnr_db": train_eval["psnr_db"],
        "held_out_codes_used": held_eval["codes_used"],
        "train_codes_used": train_eval["codes_used"],
        "held_out_images": len(held.keys),
        "train_images": len(train.keys),
        "split": HELD_OUT_RULE,
        "shards": [p.name for p in shards],
        "image_resize": {
            "patch": _PATCH,
            "merge": _MERGE,
            "min_pixels": _MIN_PIXELS,
            "max_pixels": _MAX_PIXELS,
        },
        "settings": asdict(settings),
        "train_seconds": round(seconds, 1),
        "train_cpu_seconds": round(cpu_seconds, 1),
        "cpu_count": os.cpu_count(),
        "final_train_mse": round(sum(losses[-50:]) / len(losses[-50:]), 6),
    }
    sidecar = model.save(out / WEIGHTS_NAME, extra=extra)
    print(
        f"image tokenizer: held-out PSNR {held_eval['psnr_db']} dB, train {train_eval['psnr_db']} dB, "
        f"{train_eval['codes_used']} of {config.codebook_size} codes used, {seconds:.0f} s "
        f"({cpu_seconds:.0f} s CPU) -> {out / WEIGHTS_NAME}",
        flush=True,
    )
    return sidecar

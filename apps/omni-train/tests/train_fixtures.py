"""Tiny real-format datasets for the trainer's tests: WebDataset shards written with
``webdataset.ShardWriter`` (PNG + caption, 16 kHz FLAC + transcript, text passages) and a byte-level BPE
tokenizer trained with ``tokenizers`` on the same text, with the bundle's special tokens."""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import soundfile
import webdataset as wds
from PIL import Image
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL = ["<|pad|>", "<|bos|>", "<|eos|>", "<|image|>", "<|audio|>"]
WORDS = [
    "red",
    "green",
    "blue",
    "circle",
    "square",
    "star",
    "cat",
    "dog",
    "bird",
    "tree",
    "house",
    "sun",
    "moon",
    "river",
    "stone",
    "cloud",
]


def _sentence(rng: np.random.Generator, n: int) -> str:
    return " ".join(rng.choice(WORDS, size=n)) + "."


def make_dataset(
    root: Path,
    *,
    n_image: int = 24,
    n_audio: int = 12,
    n_text: int = 40,
    seed: int = 0,
    damage_images: bool = False,
    text_words_lognormal: tuple[float, float] | None = None,
) -> dict:
    """Write shards and a tokenizer under ``root``; return their paths and patterns.

    ``text_words_lognormal``: ``(mu, sigma)`` of a lognormal word count per text sample (3 to 400 words,
    a long-tailed length mix); default two sentences of 5-29 words.

    ``damage_images``: every PNG's body is bit-flipped after its first 80 bytes (the IHDR header still
    parses, so metadata and packs are the same as without; decoding the pixels fails).
    """
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    texts = []
    with wds.ShardWriter(str(root / "image-%03d.tar"), maxcount=max(1, n_image // 2), verbose=0) as w:
        for i in range(n_image):
            h, wd = int(rng.integers(20, 90)), int(rng.integers(20, 90))
            colour = rng.integers(0, 255, size=3)
            arr = np.clip(colour + rng.normal(0, 20, size=(h, wd, 3)), 0, 255).astype(np.uint8)
            buf = io.BytesIO()
            Image.fromarray(arr).save(buf, format="PNG")
            png = buf.getvalue()
            if damage_images:
                png = png[:80] + bytes(b ^ 0x5A for b in png[80:])
            cap = f"a {WORDS[int(colour[0]) % 3]} picture of " + _sentence(rng, 3)
            texts.append(cap)
            w.write(
                {
                    "__key__": f"img{i:04d}",
                    "png": png,
                    "txt": cap,
                    "json": json.dumps({"width": wd, "height": h}).encode(),
                }
            )
    with wds.ShardWriter(str(root / "audio-%03d.tar"), maxcount=max(1, n_audio // 2), verbose=0) as w:
        for i in range(n_audio):
            n = int(rng.integers(4000, 16000))
            f0 = 200.0 + 50 * (i % 5)
            wave = (0.3 * np.sin(2 * np.pi * f0 * np.arange(n) / 16000)).astype(np.float32)
            buf = io.BytesIO()
            soundfile.write(buf, wave, 16000, format="FLAC")
            tr = _sentence(rng, 4)
            texts.append(tr)
            w.write(
                {
                    "__key__": f"aud{i:04d}",
                    "flac": buf.getvalue(),
                    "txt": tr,
                    "json": json.dumps({"sample_rate": 16000, "num_frames": n, "human": False}).encode(),
                }
            )
    with wds.ShardWriter(str(root / "text-%03d.tar"), maxcount=max(1, n_text // 2), verbose=0) as w:
        for i in range(n_text):
            if text_words_lognormal is None:
                t = " ".join(_sentence(rng, int(rng.integers(5, 30))) for _ in range(2))
            else:
                t = _sentence(rng, int(np.clip(rng.lognormal(*text_words_lognormal), 3, 400)))
            texts.append(t)
            w.write({"__key__": f"txt{i:04d}", "txt": t})
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(texts, trainer)
    tok.save(str(root / "tokenizer.json"))
    return {
        "root": root,
        "tokenizer": str(root / "tokenizer.json"),
        "image": str(root / "image-*.tar"),
        "audio": str(root / "audio-*.tar"),
        "text": str(root / "text-*.tar"),
    }


def write_config(
    path: Path,
    data: dict,
    *,
    steps: int = 6,
    extra: str = "",
    pp: int = 2,
    every: int = 2,
    model: dict[str, str] | None = None,
    parallel: str = "",
) -> Path:
    """A tiny omni config over ``data`` (from :func:`make_dataset`); ``model`` adds TOML lines to the
    ``llm``, ``vit`` or ``audio`` table, ``parallel`` to ``[parallel]``."""
    model = model or {}
    path.write_text(f"""
[model.llm]
dim = 32
n_layers = 2
n_heads = 4
n_kv_heads = 2
ffn_dim = 64
{model.get("llm", "")}

[model.vit]
dim = 16
n_layers = 1
n_heads = 2
min_pixels = 784
max_pixels = 3136
{model.get("vit", "")}

[model.audio]
dim = 16
n_layers = 1
n_heads = 2
n_mels = 16
{model.get("audio", "")}

[data]
max_seq_len = 96
microbatches = 2
buffer_size = 8
tokenizer = "{data["tokenizer"]}"

[[data.sources]]
name = "image"
modality = "image"
urls = "{data["image"]}"

[[data.sources]]
name = "audio"
modality = "audio"
urls = "{data["audio"]}"

[[data.sources]]
name = "text"
modality = "text"
urls = "{data["text"]}"

[[data.mixture]]
until_step = 3
weights = {{ image = 0.5, audio = 0.2, text = 0.3 }}

[[data.mixture]]
weights = {{ image = 0.3, audio = 0.4, text = 0.3 }}

[parallel]
pp = {pp}
{parallel}

[optim]
lr = 3e-3
warmup_steps = 2

[checkpoint]
every = {every}
keep_last = 2

[train]
steps = {steps}
{extra}
""")
    return path


def spawned_workers(launcher_pid: int) -> list[int]:
    """PIDs of the worker processes the launcher spawned (not its resource tracker), in start order: local
    rank 0 first (the agent starts them in rank order)."""
    pids = []
    # /proc rather than pgrep: slim images lack procps. Field 4 of /proc/PID/stat is the parent PID;
    # the command name (field 2) may hold spaces, so split after its closing parenthesis.
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            cmd = (stat.parent / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == launcher_pid and b"spawn_main" in cmd:
            pids.append(int(stat.parent.name))
    return sorted(pids)


def side_by_side(first: Callable[[], Any], *others: Callable[[], Any]) -> list[Any]:
    """``first`` in this thread and each of ``others`` in a thread of its own, at the same time; their
    results in order. For independent ``run_world`` worlds (each with run folders of its own): a
    one-process reference next to a pipeline world runs on the core that the pipeline's bubbles and the
    ranks' waits on each other leave idle on a 2-core machine.

    ``first`` runs here so that a test timeout (pytest-timeout's signal) interrupts it and its
    ``run_world`` kills its ranks; then ``others`` are not waited for (each ends at its own ``run_world``
    timeout). When calls fail, the first failure in argument order is raised, the others' errors added to
    it as notes."""
    pool = ThreadPoolExecutor(max(1, len(others)))
    futures = [pool.submit(call) for call in others]
    try:
        results = [first()]
    except BaseException as exc:
        pool.shutdown(wait=False, cancel_futures=True)
        for f in futures:
            if f.done() and not f.cancelled() and f.exception() is not None:
                exc.add_note(f"and beside it: {f.exception()!r}")
        raise
    pool.shutdown(wait=True)
    errors = [f.exception() for f in futures if f.exception() is not None]
    if errors:
        for other in errors[1:]:
            errors[0].add_note(f"and beside it: {other!r}")
        raise errors[0]
    return results + [f.result() for f in futures]

"""Text -> image sampling from a run's checkpoint: the LLM's own next-token loop over discrete image codes.

Understanding with generation (issue 30, Chameleon / Janus style; README "omni-gen: understanding with
generation"):
the LLM's vocabulary is the text tokenizer's ``V`` words, then ``boi = V``, ``eoi = V + 1`` and one id per
VQ code, ``code c -> V + 2 + c`` (:class:`omni_data.image_generation.GenerationVocab`). A generation sample
is ``caption ids, boi, h*w code ids in raster order, eoi``; to sample, the caption is the prompt, the
sampler appends ``boi`` itself and draws the ``h*w`` codes one at a time (Chameleon, Team 2024 §2.1; Janus,
Wu et al. 2024 §3.2 "inference"), each from the logits of the last position restricted to the code range
(Chameleon's image-mode decoding: a text word or ``eoi`` inside an image grid would not decode), at a
temperature and an optional top-k, from a seeded :class:`torch.Generator`; the image tokenizer's decoder
(:class:`omni_train.models.image_tokenizer.ImageTokenizer`) turns the codes into pixels.

The model is one process: the LLM's tensors of a committed step read back whole by omni-ckpt's box
intersection (any pipeline split, TP, ZeRO or expert layout wrote them; the same read as
``omni-train export-hf``, :func:`omni_train.checkpointing.read_model_tensors`, narrowed to ``llm.*``) into one
:class:`~omni_train.models.llm.LLMStage` holding every layer. No KV cache: at 64 codes per image a full
forward per code is cheap, and several captions are drawn at once as documents of one pack
(``cu_seqlens``: attention stays inside each document, positions restart in each, so each document
computes what it would alone; ``tests/test_train_sample.py`` checks greedy draws against one caption at
a time in float64).

``samples/step-N.png`` (:func:`write_grid`): one row per caption, the caption's text, the real image
(the image tokenizer's ``S x S`` input), its reconstruction through the tokenizer and the generated
image(s). In a run with ``[model.image_tokenizer]`` and ``checkpoint.sample_rows > 0``,
:class:`SampleWriter` has a child process on rank 0 write it after each committed checkpoint;
``omni-train sample --run DIR [--step N]`` draws one for any committed step (default
``samples/step-N-sample.png``). The rows are the first samples of the run's generation source: training
captions, so the grid shows fit, not generalisation.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont

from omni_train.checkpointing import checkpoints_root, committed_step_url, read_model_tensors, run_config
from omni_train.config import ConfigError, RunConfig
from omni_train.models.llm import LLMStage

if TYPE_CHECKING:
    from omni_train.checkpointing import TrainCheckpoint

__all__ = [
    "Example",
    "GridRow",
    "SampleSettings",
    "SampleWriter",
    "Sampler",
    "build_sampler",
    "code_logits",
    "grid_size",
    "load_image_tokenizer",
    "load_run_config",
    "one_process_llm",
    "read_llm_state",
    "read_llm_step",
    "sample_codes",
    "sample_run",
    "source_examples",
    "write_grid",
]


@dataclass(frozen=True)
class SampleSettings:
    """How codes are drawn.

    Attributes:
        temperature: softmax temperature (> 0); 0: greedy (argmax over the code range).
        top_k: draw among the ``top_k`` most likely codes only; 0: all ``K`` codes.
        seed: seed of the :class:`torch.Generator` the draws come from (the same seed, model and prompts
            give the same codes).
        per_caption: images drawn per caption.
    """

    temperature: float = 1.0
    top_k: int = 0
    seed: int = 0
    per_caption: int = 2

    def __post_init__(self) -> None:
        if not self.temperature >= 0 or self.temperature == float("inf"):
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.per_caption < 1:
            raise ValueError(f"per_caption must be >= 1, got {self.per_caption}")


def code_logits(logits: torch.Tensor, first_code: int, num_codes: int) -> torch.Tensor:
    """The logits of the code ids only: ``[..., vocab] -> [..., num_codes]`` (column ``c`` is code ``c``,
    id ``first_code + c``).

    Raises:
        ValueError: the code range ``[first_code, first_code + num_codes)`` is not inside the vocabulary.
    """
    if first_code < 0 or num_codes < 1 or first_code + num_codes > logits.shape[-1]:
        raise ValueError(
            f"code ids [{first_code}, {first_code + num_codes}) are not inside the LLM's vocabulary of "
            f"{logits.shape[-1]}"
        )
    return logits[..., first_code : first_code + num_codes]


def _draw(scores: torch.Tensor, settings: SampleSettings, generator: torch.Generator) -> torch.Tensor:
    """``[n, K]`` code logits -> ``[n]`` int64 codes: argmax at temperature 0, else a draw from
    ``softmax(scores / temperature)`` over the ``top_k`` largest (all with 0)."""
    if settings.temperature == 0:
        return scores.argmax(-1)
    scores = scores.double() / settings.temperature
    if 0 < settings.top_k < scores.shape[-1]:
        kth = scores.topk(settings.top_k, dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, -1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def sample_codes(
    llm: LLMStage,
    prompts: Sequence[torch.Tensor],
    *,
    first_code: int,
    num_codes: int,
    length: int,
    settings: SampleSettings,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Draw ``length`` codes after each prompt, autoregressively, all prompts in one pack per position.

    Args:
        llm: a one-process LLM (one stage holding the embedding, every layer and the LM head).
        prompts: ``n`` int64 ``[P_i]`` token ids, each ending in ``boi`` (caption ids, ``boi``).
        first_code: the id of code 0 (``V + 2``).
        num_codes: the codebook size ``K``.
        length: codes per image (``h * w``, raster order).
        settings: temperature and top-k (``settings.seed`` seeds ``generator`` when none is given).
        generator: where the draws come from (CPU).

    Returns:
        int64 ``[n, length]`` codes in ``[0, num_codes)``.

    Raises:
        ValueError: the LLM is not one whole stage, a prompt is empty or not 1-D, or the code range does
            not fit the vocabulary.
    """
    if not (llm.is_first and llm.is_last):
        raise ValueError("sample_codes needs a one-process LLM (one stage: embedding, every layer, LM head)")
    if not prompts or any(p.dim() != 1 or p.numel() == 0 for p in prompts):
        raise ValueError("sample_codes: every prompt must be a non-empty 1-D tensor of token ids")
    if generator is None:
        generator = torch.Generator().manual_seed(settings.seed)
    device = llm.output.weight.device
    docs = [p.to(device=device, dtype=torch.int64) for p in prompts]
    codes = torch.empty(len(docs), length, dtype=torch.int64)
    for i in range(length):
        lengths = [d.numel() for d in docs]
        tokens = torch.cat(docs)
        positions = torch.cat([torch.arange(n, device=device) for n in lengths])
        if llm.cfg.mrope_section is not None:  # text-like positions: temporal = height = width
            positions = positions.expand(3, -1)
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)
        logits = llm(tokens, positions, cu)  # [T, vocab]
        last = code_logits(logits[cu[1:] - 1], first_code, num_codes)  # [n, K]
        drawn = _draw(last, settings, generator).cpu()
        codes[:, i] = drawn
        docs = [torch.cat([d, (first_code + c).view(1).to(device)]) for d, c in zip(docs, drawn)]
    return codes


def read_llm_state(checkpoints: str | Path, step: int | None = None) -> tuple[int, dict[str, torch.Tensor]]:
    """The LLM's whole tensors (``llm.`` stripped) of committed ``step`` (default: the latest) under
    ``checkpoints`` (a run's ``checkpoints/`` or ``checkpoint.url``), whatever layout saved them: the
    consolidation ``omni-train export-hf`` does (omni-ckpt's manifest, then a one-process box read).
    Outside a process group (the CLI); a trainer's rank reads a step it knows with :func:`read_llm_step`.

    Raises:
        ConfigError: no committed step, or ``step`` is not one (the committed ones named).
        omni_ckpt.CheckpointError: the step fails omni-ckpt's checks (raised by ``read_manifest`` before
            any tensor is allocated from the manifest).
    """
    step, url = committed_step_url(checkpoints, step, "sample")
    return step, read_llm_step(url)


def read_llm_step(url: str) -> dict[str, torch.Tensor]:
    """The LLM's whole tensors (``llm.`` stripped) of the committed step at ``url`` (its directory):
    only ``model.llm.*`` is read, in this process alone (no collective, so one rank of a run may call it).

    Raises:
        omni_ckpt.CheckpointError: the step is not committed or fails omni-ckpt's checks.
    """
    return read_model_tensors(url, "llm.")


def one_process_llm(cfg: RunConfig, state: dict[str, torch.Tensor]) -> LLMStage:
    """A float32 :class:`LLMStage` holding every layer, loaded from ``state`` (:func:`read_llm_state`);
    its vocabulary is the checkpoint's (``tok_embeddings.weight`` rows). The stage is built on the
    ``meta`` device and takes ``state``'s tensors (``load_state_dict(assign=True)``): no random init, no
    second copy of the weights.

    Raises:
        ConfigError: ``state`` holds no 2-D ``tok_embeddings.weight`` (no LLM in the checkpoint), or does
            not fit the config's LLM: missing or unexpected tensors, or the first tensor whose shape
            differs (named, with both shapes).
    """
    emb = state.get("tok_embeddings.weight")
    if emb is None or emb.dim() != 2:
        raise ConfigError(
            "sample: the checkpoint holds no 2-D model.llm.tok_embeddings.weight (no LLM tensors to sample "
            "from)"
        )
    with torch.device("meta"):  # shapes only: the values all come from the checkpoint
        llm = LLMStage(cfg.model.llm_config(int(emb.shape[0])), 0, 1, seed=cfg.model.seed)
    want = llm.state_dict()
    missing, unexpected = sorted(set(want) - set(state)), sorted(set(state) - set(want))
    if missing or unexpected:
        raise ConfigError(
            f"sample: the checkpoint's LLM does not fit the run config (missing {missing[:3]}, "
            f"unexpected {unexpected[:3]})"
        )
    for name, t in want.items():
        if tuple(state[name].shape) != tuple(t.shape):
            raise ConfigError(
                f"sample: the checkpoint's llm.{name} is {list(state[name].shape)}, the run config's LLM "
                f"(config.json) needs {list(t.shape)}"
            )
    llm.load_state_dict(state, assign=True)
    left = [n for n, t in [*llm.named_parameters(), *llm.named_buffers()] if t.is_meta]
    if left:  # a tensor outside the state dict (none today): it would have no values
        raise ConfigError(f"sample: the LLM's {left[:3]} are not in the checkpoint")
    return llm.float().eval()


# -- the grid -------------------------------------------------------------------------------------------

CELL = 96  # pixels per image cell (the S x S images are scaled up by nearest neighbour)
PAD = 4  # pixels between cells
CAPTION_WIDTH = 224  # pixels of the caption column
HEADER = 18  # pixels of the column titles


@dataclass
class GridRow:
    """One row of a grid: the caption, the real image and its image-tokenizer reconstruction (each
    ``[3, S, S]`` float in ``[0, 1]``, or ``None`` for a caption with no image) and the generated images
    (each ``[3, S, S]``)."""

    caption: str
    real: torch.Tensor | None
    reconstructed: torch.Tensor | None
    generated: list[torch.Tensor]


COLUMNS = ("real", "tokenized")  # the image columns before the generated ones


def grid_size(rows: int, generated: int, *, cell: int = CELL) -> tuple[int, int]:
    """``(width, height)`` in pixels of a grid of ``rows`` rows of ``generated`` generated images each:
    the caption column (``CAPTION_WIDTH``), the real image, its reconstruction and the generated ones
    (``cell`` pixels square), ``PAD`` pixels around every cell, a ``HEADER``-pixel title row."""
    width = PAD + CAPTION_WIDTH + PAD + (len(COLUMNS) + generated) * (cell + PAD)
    height = HEADER + rows * (cell + PAD) + PAD
    return width, height


def _to_image(pixels: torch.Tensor, cell: int) -> Image.Image:
    arr = (pixels.detach().float().clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()
    return Image.fromarray(arr, "RGB").resize((cell, cell), Image.Resampling.NEAREST)


def write_grid(path: str | Path, rows: Sequence[GridRow], *, title: str = "", cell: int = CELL) -> Path:
    """Write ``rows`` as one PNG at ``path`` (folders made; written to a temporary name, then renamed) of
    :func:`grid_size` pixels: per row the caption (wrapped, cut at the cell's height), the real image, its
    reconstruction by the image tokenizer (what the codes can express at best) and the generated ones,
    each scaled to ``cell x cell`` by nearest neighbour; an empty frame where a row has no real image.

    Raises:
        ValueError: no rows, or rows with different numbers of generated images.
    """
    if not rows:
        raise ValueError("write_grid: no rows")
    n = len(rows[0].generated)
    if any(len(r.generated) != n for r in rows):
        raise ValueError("write_grid: every row needs the same number of generated images")
    width, height = grid_size(len(rows), n, cell=cell)
    im = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(im)
    font = ImageFont.load_default()
    x0 = PAD + CAPTION_WIDTH + PAD
    names = [*COLUMNS, *(f"generated {j + 1}" for j in range(n))]
    draw.text((PAD, 3), title or "caption", fill="black", font=font)
    for j, name in enumerate(names):
        draw.text((x0 + j * (cell + PAD), 3), name, fill="black", font=font)
    line_h = 11
    for i, row in enumerate(rows):
        y = HEADER + i * (cell + PAD)
        lines = textwrap.wrap(row.caption, width=CAPTION_WIDTH // 6)[: max(1, cell // line_h)]
        for k, line in enumerate(lines):
            draw.text((PAD, y + k * line_h), line, fill="black", font=font)
        for j, pixels in enumerate([row.real, row.reconstructed, *row.generated]):
            x = x0 + j * (cell + PAD)
            if pixels is None:
                draw.rectangle([x, y, x + cell - 1, y + cell - 1], outline="gray")
            else:
                im.paste(_to_image(pixels, cell), (x, y))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    im.save(tmp, format="PNG")
    tmp.replace(path)
    return path


def load_run_config(run_dir: str | Path) -> RunConfig:
    """The run config saved in ``run_dir/config.json`` (:func:`omni_train.checkpointing.run_config`).

    Raises:
        ConfigError: no ``config.json`` there, or it is not a run config (the file named).
    """
    return run_config(run_dir, "sample")


# -- captions, real images and the sampler ---------------------------------------------------------------


@dataclass
class Example:
    """A caption to draw images for, with its real image as the image tokenizer sees it (``[3, S, S]``
    float in ``[0, 1]``, letterboxed on white), or ``None`` for a caption given by hand."""

    caption: str
    pixels: torch.Tensor | None = None


def source_examples(cfg: RunConfig, count: int, size: int) -> list[Example]:
    """The first ``count`` samples (shard order, no shuffle) of the run's first generation source: caption
    text and image, decoded as the loader decodes a generation sample's image (RGB over white, its own
    size; :func:`omni_train.models.image_tokenizer.letterbox` to ``size``). Fewer when the source holds
    fewer; none without a generation source. A sample whose image is refused or does not decode is left
    out (the loader trains it masked and counts it).

    Raises:
        omni_data.PayloadError: a member cannot be read (the sample named).
    """
    from omni_data import Modality, PayloadReader, WebDatasetSource
    from omni_data.media_checks import MediaRefusedError, open_image
    from omni_data.payload import to_rgb
    from omni_train.data_files import data_root, expand_urls, load_tokenizer
    from omni_train.models.image_tokenizer import letterbox

    source = next((s for s in cfg.data.sources if s.modality == Modality.GENERATION.value), None)
    if source is None or count < 1:
        return []
    tokenizer = load_tokenizer(cfg.data)
    # the same shards described as plain images: metadata with the members, no code grid needed
    meta = WebDatasetSource(
        expand_urls(source.urls, data_root(cfg)),
        modality=Modality.IMAGE,
        name=source.name,
        tokenizer=tokenizer,
        max_image_pixels=cfg.data.max_image_pixels,
    )
    meta.reset()
    reader = PayloadReader(tokenizer, max_image_pixels=cfg.data.max_image_pixels)
    out: list[Example] = []
    try:
        for m in meta:
            if "txt" not in m.members:
                continue
            caption = reader.read_bytes(m.members["txt"]).decode("utf-8", "replace")  # as the loader reads it
            image_ref = next(r for r in reader.refs(m, text=False))
            try:  # a refused or undecodable image (the loader masks such samples) is left out here
                with open_image(reader.read_bytes(image_ref), cfg.data.max_image_pixels) as im:
                    rgb = torch.from_numpy(np.asarray(to_rgb(im), dtype=np.float32) / np.float32(255.0))
            except (MediaRefusedError, OSError, ValueError, SyntaxError):  # PIL's errors for a bad body
                continue
            out.append(Example(caption, letterbox(rgb.permute(2, 0, 1).contiguous(), size)))
            if len(out) == count:
                break
    finally:
        reader.close()
    return out


class Sampler:
    """Draws images for captions with a one-process LLM and decodes them with the image tokenizer.

    Args:
        llm: the one-process LLM (:func:`one_process_llm`), vocabulary ``V + 2 + K``.
        tokenizer: the run's text tokenizer (``V`` words).
        image_tokenizer: the run's frozen image tokenizer (``K`` codes, an ``h x w`` grid, ``S x S``).
        settings: temperature, top-k, seed, images per caption.

    Raises:
        ConfigError: the LLM's vocabulary is not ``V + 2 + K`` (not a run trained with this image
            tokenizer).
    """

    def __init__(self, llm: LLMStage, tokenizer, image_tokenizer, settings: SampleSettings) -> None:
        from omni_data import GenerationVocab

        self.llm, self.tokenizer, self.settings = llm, tokenizer, settings
        self.image_tokenizer = image_tokenizer
        self.vocab = GenerationVocab(
            tokenizer.get_vocab_size(), image_tokenizer.codebook_size, tuple(image_tokenizer.grid)
        )
        if llm.cfg.vocab_size != self.vocab.size:
            raise ConfigError(
                f"sample: the LLM's vocabulary is {llm.cfg.vocab_size}, text {self.vocab.text_vocab} + boi, eoi "
                f"+ {self.vocab.codebook} image codes is {self.vocab.size} (was the run trained with "
                "[model.image_tokenizer]?)"
            )

    def prompt(self, caption: str) -> torch.Tensor:
        """int64 ``[c + 1]``: the caption's ids (as the loader tokenizes a generation sample's caption),
        then ``boi``."""
        ids = self.tokenizer.encode(caption).ids
        return torch.tensor([*ids, self.vocab.boi], dtype=torch.int64)

    def generate(self, captions: Sequence[str]) -> torch.Tensor:
        """``settings.per_caption`` images per caption: float ``[len(captions), per_caption, 3, S, S]`` in
        ``[0, 1]`` (all drawn in one pack per code position, caption-major)."""
        n = self.settings.per_caption
        prompts = [self.prompt(c) for c in captions for _ in range(n)]
        h, w = self.vocab.grid
        codes = sample_codes(
            self.llm,
            prompts,
            first_code=self.vocab.first_code,
            num_codes=self.vocab.codebook,
            length=h * w,
            settings=self.settings,
        )
        images = self.image_tokenizer.decode(codes.view(-1, h, w))
        return images.view(len(captions), n, *images.shape[1:])

    def rows(self, examples: Sequence[Example]) -> list[GridRow]:
        """The grid rows of ``examples``: caption, real image, its reconstruction (encode then decode),
        generated images."""
        generated = self.generate([e.caption for e in examples])
        rows = []
        for e, images in zip(examples, generated):
            recon = None
            if e.pixels is not None:
                recon = self.image_tokenizer.decode(self.image_tokenizer.encode(e.pixels[None]))[0]
            rows.append(GridRow(e.caption, e.pixels, recon, list(images)))
        return rows


def load_image_tokenizer(cfg: RunConfig):
    """The run's frozen image tokenizer (``[model.image_tokenizer] path``, found and checked as the
    trainer finds and checks it: :func:`omni_train.data_pipeline.load_image_tokenizer`).

    Raises:
        ConfigError: the run has no ``[model.image_tokenizer]``.
        omni_train.models.image_tokenizer.ImageTokenizerFileError: the weights are refused (file named).
    """
    from omni_train.data_pipeline import load_image_tokenizer as load

    if cfg.model.image_tokenizer is None:
        raise ConfigError("sample: the run has no [model.image_tokenizer]; it does not generate images")
    return load(cfg)


def build_sampler(
    cfg: RunConfig, state: dict[str, torch.Tensor], settings: SampleSettings, image_tokenizer=None
) -> Sampler:
    """A :class:`Sampler` over the one-process LLM of ``state`` (:func:`read_llm_state`); the image
    tokenizer is the run's unless given.

    Raises:
        ConfigError, ImageTokenizerFileError: as :func:`one_process_llm`, :func:`load_image_tokenizer`
            and :class:`Sampler`.
    """
    from omni_train.data_files import load_tokenizer

    llm = one_process_llm(cfg, state)
    tok = image_tokenizer if image_tokenizer is not None else load_image_tokenizer(cfg)
    return Sampler(llm, load_tokenizer(cfg.data), tok, settings)


DEFAULT_ROWS = 4  # captions in a grid


def sample_run(
    run_dir: str | Path,
    *,
    step: int | None = None,
    out: str | Path | None = None,
    captions: Sequence[str] = (),
    rows: int = DEFAULT_ROWS,
    settings: SampleSettings = SampleSettings(),
) -> Path:
    """``omni-train sample``: write the grid of committed ``step`` (default: the latest) of ``run_dir``.

    Args:
        run_dir: a run directory (``config.json``, checkpoints under ``checkpoints/`` or ``checkpoint.url``:
            :func:`omni_train.checkpointing.checkpoints_root`).
        step: the committed step.
        out: the PNG (default ``run_dir/samples/step-N-sample.png``; the run's own ``step-N.png`` is its
            :class:`SampleWriter`'s and is not overwritten unless named here).
        captions: captions to draw for (no real image); default: the first ``rows`` samples of the run's
            generation source, with their real images.
        rows: captions taken from the source when none are given.
        settings: how codes are drawn.

    Raises:
        ConfigError: not a run directory, no committed step (or ``step`` is not one), a run without
            ``[model.image_tokenizer]``, or no captions (none given and no generation source).
        omni_ckpt.CheckpointError, ImageTokenizerFileError: a damaged checkpoint or tokenizer file (named).
    """
    run_dir = Path(run_dir)
    cfg = load_run_config(run_dir)
    image_tokenizer = load_image_tokenizer(cfg)  # first: a run that does not generate reads no checkpoint
    step, state = read_llm_state(checkpoints_root(cfg, run_dir), step)
    sampler = build_sampler(cfg, state, settings, image_tokenizer)
    examples = (
        [Example(c) for c in captions]
        if captions
        else source_examples(cfg, rows, sampler.image_tokenizer.config.image_size)
    )
    if not examples:
        raise ConfigError("sample: no captions: give --caption TEXT (the run has no generation source)")
    path = Path(out) if out is not None else run_dir / "samples" / f"step-{step}-sample.png"
    return write_grid(path, sampler.rows(examples), title=f"step {step}")


class SampleWriter:
    """Rank 0's hook: after each checkpoint save of a run with ``[model.image_tokenizer]`` and
    ``checkpoint.sample_rows > 0``, once the step is committed, a child process
    ``python -m omni_train.cli sample --run OUT --step N --rows ROWS --out OUT/samples/step-N.png`` draws
    the grid (:func:`sample_run`: the first ``sample_rows`` samples of the generation source, which the
    run trains on) and logs to ``OUT/samples/step-N.log``.

    Off the training thread: the trainer never waits for the async save's commit nor for the sampler
    (which reads the whole LLM into host memory and runs ``h*w`` full forwards on the CPU); it only polls
    (a checkpoint listing per step while a saved step awaits its grid). One child at a time: when several
    saved steps await, the newest committed one is drawn and the older ones are reported as
    ``superseded``. :meth:`finish` (rank 0, after the run's last barrier) draws the last step, waits for
    the child and adds ``samples`` (``written``, ``failed`` with exit status and log, ``superseded``) to
    ``summary.json``; a failure is printed to stderr, never dropped. The child touches no training
    state, so the run's losses are the same with or without it (``tests/test_train_sample.py``).

    Args:
        cfg: the run config.
        out: the run directory.
    """

    def __init__(self, cfg: RunConfig, out: Path) -> None:
        self.cfg, self.out, self.rows = cfg, Path(out), cfg.checkpoint.sample_rows
        self.pending: list[int] = []  # saved steps that await their grid
        self.child: subprocess.Popen[bytes] | None = None
        self.child_step = 0
        self.written: list[Path] = []
        self.failed: list[dict[str, object]] = []
        self.superseded: list[int] = []

    @classmethod
    def for_rank(cls, cfg: RunConfig, out: Path, rank: int) -> SampleWriter | None:
        """The writer of global rank 0 of a run with ``[model.image_tokenizer]`` and
        ``checkpoint.sample_rows > 0``; ``None`` elsewhere."""
        if rank != 0 or cfg.model.image_tokenizer is None or cfg.checkpoint.sample_rows == 0:
            return None
        return cls(cfg, out)

    def command(self, step: int) -> list[str]:
        """The child's command line for ``step``."""
        png = self.out / "samples" / f"step-{step}.png"
        return [
            sys.executable, "-m", "omni_train.cli", "sample", "--run", str(self.out), "--step", str(step),
            "--rows", str(self.rows), "--out", str(png),
        ]  # fmt: skip

    def _reap(self, block: bool) -> bool:
        """Whether no child runs (after waiting for it with ``block``); a finished child's result kept."""
        if self.child is None:
            return True
        rc = self.child.wait() if block else self.child.poll()
        if rc is None:
            return False
        step, self.child = self.child_step, None
        png, log = self.out / "samples" / f"step-{step}.png", self.out / "samples" / f"step-{step}.log"
        if rc == 0 and png.is_file():
            self.written.append(png)
        else:
            self.failed.append({"step": step, "exit_status": rc, "log": str(log)})
            tail = log.read_text(errors="replace").strip().splitlines()[-1:] if log.is_file() else []
            print(
                f"omni-train: samples/step-{step}.png failed (exit status {rc}, {log}): {' '.join(tail)}",
                file=sys.stderr,
            )
        return True

    def _launch(self, committed: list[int]) -> None:
        ready = [s for s in self.pending if s in committed]
        if not ready:
            return
        step = ready[-1]
        self.superseded += ready[:-1]
        self.pending = [s for s in self.pending if s > step]
        (self.out / "samples").mkdir(parents=True, exist_ok=True)
        with open(self.out / "samples" / f"step-{step}.log", "wb") as log:
            self.child = subprocess.Popen(self.command(step), stdout=log, stderr=subprocess.STDOUT)
        self.child_step = step

    def after_save(self, step: int, checkpoint: TrainCheckpoint) -> None:
        """After the trainer's step ``step`` (its save, if due, started): note a saved step; if no child
        runs and a noted step is committed, start the child for the newest such. Never blocks."""
        if checkpoint.due(step):
            self.pending.append(step)
        if self.pending and self._reap(block=False):
            self._launch(checkpoint.manager.steps())

    def finish(self, checkpoint: TrainCheckpoint, summary: dict) -> dict:
        """Rank 0 at the end of the run (every step committed): draw the newest noted step, wait for the
        child and add ``samples`` to ``summary`` and ``OUT/summary.json`` (when it exists); returns it."""
        self._reap(block=True)
        if self.pending:
            self._launch(checkpoint.manager.steps())
            self._reap(block=True)
        self.superseded += self.pending  # not committed: none after a clean close
        report = {
            "written": [str(p) for p in self.written],
            "failed": self.failed,
            "superseded": self.superseded,
        }
        summary = {**summary, "samples": report}
        path = self.out / "summary.json"
        if path.is_file():
            path.write_text(json.dumps(summary, indent=2))
        return summary

    def close(self) -> None:
        """On an error: stop a child still drawing (its grid is not reported)."""
        if self.child is not None and self.child.poll() is None:
            self.child.terminate()
            self.child.wait()
        self.child = None

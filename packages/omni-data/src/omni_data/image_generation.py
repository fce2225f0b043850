"""Text-to-image ("generation") samples: discrete image tokens predicted by the LLM, one vocabulary.

Chameleon (Chameleon Team 2024, §2.1 "image tokenization") and Janus (Wu et al. 2024, §3.1) turn an
image into a grid of codebook indices with a VQ tokenizer (van den Oord et al. 2017, "Neural Discrete
Representation Learning"; Esser et al. 2021 "VQGAN") and let the LLM predict them as tokens: one
vocabulary, one next-token objective, one output head. A generation sample is therefore a *text-like*
sequence for everything between the shards and the loss (metadata, mixture, packing, reordering, every
placement, schedule and sequence-parallel layout): it has no encoder work on any rank.

Token layout (:class:`GenerationVocab`), with ``V`` the text tokenizer's vocabulary and ``K`` the image
tokenizer's codebook::

    text ids 0 .. V-1 | boi = V | eoi = V + 1 | image code c -> V + 2 + c  (c = 0 .. K-1)

and the LLM's vocabulary is ``V + 2 + K``. A generation sample is::

    caption ids (c tokens) | boi | h*w code ids in raster order | eoi

Its targets are the ``h*w`` codes and ``eoi``, each predicted from the position before it (the ``boi``
position predicts the first code); the caption is the prompt and is not trained (Janus §3.2 trains
text-to-image on the image tokens only). The token count ``c + 2 + h*w`` is known from the caption's
token count and the tokenizer's grid before any payload is read (:class:`~omni_data.SampleMeta` of
modality ``generation``, ``shape = (h, w)``), so packing and balancing plan on metadata as for text.

The codes are made where the sample's token ids are read (the loader's decode workers of the ranks that
build LLM inputs or labels, as the text tokenizer runs there): :class:`ImageCodes` decodes nothing itself
and holds no model code: it takes any object with an ``encode`` method (:class:`ImageCodeEncoder`, e.g.
omni-train's VQ ``ImageTokenizer``) and a function that turns a decoded image ``[3, H, W]`` into the
encoder's ``[3, S, S]`` input.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from omni_data.sample import Modality, SampleMeta

__all__ = ["GenerationVocab", "ImageCodeEncoder", "ImageCodes", "generation_targets"]


@dataclass(frozen=True, slots=True)
class GenerationVocab:
    """The one vocabulary of text and image tokens (module docstring).

    Args:
        text_vocab: ``V``, the text tokenizer's vocabulary size (ids ``0 .. V-1``).
        codebook: ``K``, the image tokenizer's codebook size.
        grid: ``(h, w)``, the code grid of one image (``h * w`` code tokens per image).

    Raises:
        ValueError: a size < 1.
    """

    text_vocab: int
    codebook: int
    grid: tuple[int, int]

    def __post_init__(self) -> None:
        h, w = self.grid
        if self.text_vocab < 1 or self.codebook < 1 or h < 1 or w < 1:
            raise ValueError(
                f"GenerationVocab: text_vocab ({self.text_vocab}), codebook ({self.codebook}) and grid "
                f"{self.grid} must be >= 1"
            )

    @property
    def boi(self) -> int:
        """Begin-of-image token id, ``V``."""
        return self.text_vocab

    @property
    def eoi(self) -> int:
        """End-of-image token id, ``V + 1``."""
        return self.text_vocab + 1

    @property
    def first_code(self) -> int:
        """Token id of code 0, ``V + 2``."""
        return self.text_vocab + 2

    @property
    def size(self) -> int:
        """The LLM's vocabulary, ``V + 2 + K``."""
        return self.text_vocab + 2 + self.codebook

    @property
    def codes(self) -> int:
        """Code tokens per image, ``h * w``."""
        return self.grid[0] * self.grid[1]

    def tokens(self, caption_tokens: int) -> int:
        """Tokens of a generation sample whose caption has ``caption_tokens``: ``caption + 2 + h*w``."""
        return caption_tokens + 2 + self.codes

    def code_ids(self, codes: torch.Tensor) -> torch.Tensor:
        """Token ids of codes: int64 ``[...]`` codes in ``0 .. K-1`` -> ``V + 2 + code`` (same shape).

        Raises:
            ValueError: a code outside ``0 .. K-1``.
        """
        codes = codes.to(torch.int64)
        if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) >= self.codebook):
            raise ValueError(
                f"GenerationVocab: codes must be in 0..{self.codebook - 1}, got "
                f"{int(codes.min())}..{int(codes.max())}"
            )
        return codes + self.first_code

    def codes_of(self, ids: torch.Tensor) -> torch.Tensor:
        """The inverse of :meth:`code_ids`: int64 token ids of codes -> codes (same shape).

        Raises:
            ValueError: an id outside the code range ``V + 2 .. V + 1 + K``.
        """
        ids = ids.to(torch.int64)
        if ids.numel() and (int(ids.min()) < self.first_code or int(ids.max()) >= self.size):
            raise ValueError(
                f"GenerationVocab: code ids must be in {self.first_code}..{self.size - 1}, got "
                f"{int(ids.min())}..{int(ids.max())}"
            )
        return ids - self.first_code

    def sample_ids(self, caption_ids: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        """A generation sample's token ids: caption, ``boi``, the codes in raster order, ``eoi``.

        Args:
            caption_ids: int64 ``[c]`` text ids (each ``< V``).
            codes: int64 ``[h, w]`` codes in ``0 .. K-1``.

        Returns:
            int64 ``[c + 2 + h*w]``.

        Raises:
            ValueError: ``codes`` is not ``[h, w]`` of this grid, a code is out of range, or a caption id
                is not a text id.
        """
        if tuple(codes.shape) != tuple(self.grid):
            raise ValueError(f"GenerationVocab: codes of shape {tuple(codes.shape)}, the grid is {self.grid}")
        caption_ids = caption_ids.to(torch.int64).reshape(-1)
        if caption_ids.numel() and (int(caption_ids.min()) < 0 or int(caption_ids.max()) >= self.text_vocab):
            raise ValueError(f"GenerationVocab: caption ids must be text ids in 0..{self.text_vocab - 1}")
        return torch.cat(
            [
                caption_ids,
                torch.tensor([self.boi], dtype=torch.int64),
                self.code_ids(codes).reshape(-1),
                torch.tensor([self.eoi], dtype=torch.int64),
            ]
        )


def generation_targets(meta: SampleMeta) -> tuple[int, int]:
    """Where a generation sample's targets are, from its metadata alone: ``(first, count)``, the positions
    ``first .. first + count - 1`` of the sample (0-based) predict the next token: ``first`` is the
    ``boi`` position (``text_tokens - h*w - 2``, the caption's length) and ``count = h*w + 1`` (the codes
    and ``eoi``).

    Raises:
        ValueError: ``meta`` is not a generation sample, or its ``shape`` is not a ``(h, w)`` grid that
            fits in its tokens (the sample is named).
    """
    if meta.modality is not Modality.GENERATION or len(meta.shape) != 2:
        raise ValueError(f"sample {meta.uid}: not a generation sample with an (h, w) code grid")
    codes = meta.shape[0] * meta.shape[1]
    first = meta.text_tokens - codes - 2
    if first < 0 or meta.media_tokens:
        raise ValueError(
            f"sample {meta.uid}: {meta.text_tokens} tokens cannot hold boi, {codes} codes and eoi"
        )
    return first, codes + 1


class ImageCodeEncoder(Protocol):
    """A frozen image tokenizer: ``encode(pixels)`` with pixels float32 ``[n, 3, S, S]`` in ``[0, 1]``
    -> codes int64 ``[n, h, w]`` (omni-train's ``ImageTokenizer`` is one)."""

    def encode(self, pixels: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True)
class ImageCodes:
    """Turns a decoded image into its code token ids, in the loader's decode workers.

    Args:
        vocab: the token layout.
        encoder: the frozen image tokenizer (:class:`ImageCodeEncoder`); called under
            ``torch.no_grad`` one image at a time, so a sample's codes do not depend on what else is
            decoded with it (the same codes on every rank and in every layout).
        to_input: a decoded image float32 ``[3, H, W]`` in ``[0, 1]`` -> the encoder's input
            ``[3, S, S]`` (omni-train: white letterbox to ``S x S``).
    """

    vocab: GenerationVocab
    encoder: ImageCodeEncoder
    to_input: Callable[[torch.Tensor], torch.Tensor]

    def codes(self, pixels: torch.Tensor) -> torch.Tensor:
        """Codes int64 ``[h, w]`` of one decoded image (float32 ``[3, H, W]`` in ``[0, 1]``).

        Raises:
            ValueError: the encoder gives another grid than ``vocab.grid`` or codes outside the codebook.
        """
        with torch.no_grad():
            x = self.to_input(pixels)
            codes = self.encoder.encode(x.unsqueeze(0).to(torch.float32))
        if tuple(codes.shape) != (1, *self.vocab.grid):
            raise ValueError(
                f"ImageCodes: the image tokenizer gave codes of shape {tuple(codes.shape)}, expected "
                f"(1, {self.vocab.grid[0]}, {self.vocab.grid[1]})"
            )
        codes = codes[0].to(torch.int64)
        self.vocab.code_ids(codes)  # range check
        return codes

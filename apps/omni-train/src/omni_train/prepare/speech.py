"""Speech samples: real human utterances from `pocketsphinx-testdata`, synthetic ones from `flite`.

Human speech: CMU Sphinx's test recordings with their reference transcripts: five LibriVox utterances
(Sense and Sensibility, chapter 1), five spoken card names, and `goforward.raw` ("go forward ten
meters", the transcript pocketsphinx's own tests decode it to; the utterance is inside the package's
`goforward.fsg` grammar). `numbers.raw` and `something.raw` ship without a transcript and the TIDIGITS
recording is 8 kHz, so they are left out.

Synthetic speech: the flite voices slt, awb, rms and kal16 (all 16 kHz) read clip-art captions and
Shakespeare lines. flite is deterministic: the same text and voice give the same samples.
"""

from __future__ import annotations

import io
import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import soundfile as sf

from omni_train.prepare.sources import SourceName, require_path, require_program

__all__ = ["FLITE_VOICES", "SAMPLE_RATE", "Utterance", "encode_flac", "human_utterances", "synthesize"]

SAMPLE_RATE = 16_000
FLITE_VOICES = ("slt", "awb", "rms", "kal16")
DEFAULT_POCKETSPHINX_DATA = Path("/usr/share/pocketsphinx/test/data")
_TRANSCRIPT_LINE = re.compile(r"^<s>\s*(.*?)\s*</s>\s*\((\S+)\)\s*$")


@dataclass(frozen=True)
class Utterance:
    """A decoded utterance with its transcript.

    Attributes:
        key: WebDataset key.
        samples: int16 PCM, shape (num_frames,), 16 kHz mono.
        transcript: the words spoken.
        speaker: who or what spoke, e.g. "librivox-reader", "flite-slt".
        human: True for a recording of a person, False for synthesis.
    """

    key: str
    samples: np.ndarray
    transcript: str
    speaker: str
    human: bool


def _read_transcripts(path: Path) -> dict[str, str]:
    out = {}
    for n, line in enumerate(path.read_text("utf-8").splitlines(), 1):
        if not line.strip():
            continue
        match = _TRANSCRIPT_LINE.match(line)
        if match is None:
            raise ValueError(f"{path}:{n}: not a `<s> words </s> (id)` transcript line: {line!r}")
        out[match.group(2)] = match.group(1)
    return out


def _read_wav(path: Path) -> np.ndarray:
    data, rate = sf.read(path, dtype="int16", always_2d=True)
    if rate != SAMPLE_RATE or data.shape[1] != 1:
        raise ValueError(f"{path}: expected {SAMPLE_RATE} Hz mono, got {rate} Hz x {data.shape[1]} channels")
    return data[:, 0]


def human_utterances(root: Path = DEFAULT_POCKETSPHINX_DATA) -> list[Utterance]:
    """The 11 transcribed human recordings of `pocketsphinx-testdata`, in a fixed order.

    Raises:
        MissingSourceError: when the package is not installed.
        ValueError: when a recording is not 16 kHz mono or a transcript line is malformed.
    """
    root = require_path(SourceName.POCKETSPHINX, root)
    out = []
    librivox = _read_transcripts(require_path(SourceName.POCKETSPHINX, root / "librivox" / "transcription"))
    for uid, text in sorted(librivox.items()):
        samples = _read_wav(require_path(SourceName.POCKETSPHINX, root / "librivox" / f"{uid}.wav"))
        out.append(Utterance(f"pocketsphinx-librivox-{uid}", samples, text, "librivox-reader", True))
    cards = _read_transcripts(require_path(SourceName.POCKETSPHINX, root / "cards" / "cards.transcription"))
    for uid, text in sorted(cards.items()):
        samples = _read_wav(require_path(SourceName.POCKETSPHINX, root / "cards" / f"{uid}.wav"))
        out.append(Utterance(f"pocketsphinx-cards-{uid}", samples, text, "cmusphinx-cards", True))
    raw = require_path(SourceName.POCKETSPHINX, root / "goforward.raw").read_bytes()
    samples = np.frombuffer(raw, dtype="<i2").astype(np.int16)
    out.append(
        Utterance("pocketsphinx-goforward", samples, "go forward ten meters", "cmusphinx-goforward", True)
    )
    return out


def synthesize(text: str, voice: str) -> np.ndarray:
    """Speak `text` with a flite voice.

    Args:
        text: what to say (one sentence or a few).
        voice: one of `FLITE_VOICES`.

    Returns:
        int16 PCM, shape (num_frames,), 16 kHz mono.

    Raises:
        MissingSourceError: when flite is not installed.
        RuntimeError: when flite fails (its stderr is included).
        ValueError: when the voice is unknown or its output is not 16 kHz mono.
    """
    if voice not in FLITE_VOICES:
        raise ValueError(f"unknown flite voice {voice!r}; expected one of {FLITE_VOICES}")
    flite = require_program(SourceName.FLITE, "flite")
    with tempfile.TemporaryDirectory() as tmp:
        wav = Path(tmp) / "out.wav"
        proc = subprocess.run(
            [flite, "-voice", voice, "-t", text, "-o", str(wav)], capture_output=True, text=True
        )
        if proc.returncode != 0 or not wav.is_file():
            raise RuntimeError(f"flite -voice {voice} failed on {text!r}: {proc.stderr.strip()}")
        return _read_wav(wav)


def encode_flac(samples: np.ndarray) -> bytes:
    """Encode int16 PCM, shape (num_frames,), as 16-bit FLAC at 16 kHz."""
    buf = io.BytesIO()
    sf.write(buf, samples, SAMPLE_RATE, format="FLAC", subtype="PCM_16")
    return buf.getvalue()

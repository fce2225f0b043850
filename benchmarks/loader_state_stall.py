"""The loader-state part of a checkpoint save on ``omni-heavy``: the synchronous snapshot (before) against
the snapshot prepared ahead on the loader's thread (after). Paper §7.4: saving loader states took 6-20
minutes on the slowest rank under 512K-length workloads; an asynchronous snapshot with ahead-of-time
preparation cut it to about 800 ms.

The stream is the trainer's own for pipeline rank 0 of ``omni-heavy`` (``build_step_stream`` on the
bundled shards and tokenizer, ``background=True, prepare_on_request=True``, rank 0's encoder slices of the
uniform on-demand placement, text read), driven as ``Trainer._train_step`` drives it: ``next`` ->
``prepare`` (the next step's metadata on the loader's thread) -> ``wait_prepared`` -> the save when due.
Timed per save: what ``TrainCheckpoint.save`` does for the loader before it hands the state to omni-ckpt,
on the training thread: the snapshot's bytes, then the row tensor (length prefix and bytes, width rounded
to a power of two). One process, so the width's all-reduce over the ranks (the same in both) is not in it.

Systems:
- ``sync`` (the code before): ``omni_data.snapshot_async(stream).result()``: ``state_dict()`` (waits for a
  preparation in flight), deep copy, msgpack, on the training thread; the stream prepares nothing ahead.
- ``prepared`` (now): ``ZeroRedundancyFilter(snapshots=due)``: the loader's thread serialises the state
  of each due step as it prepares it; ``stream.snapshot().blob`` hands those bytes over. Both systems'
  bytes are checked equal at every save.

Cases: ``omni-heavy`` as configured (``data.buffer_size = 8``); ``omni-heavy, buffer 1024`` (the packing
look-ahead the mixture-fidelity tests use: a state of ~1,000 buffered samples' metadata, where the walk
the synchronous path does grows); ``in flight``: ``omni-heavy`` saved while the next step's preparation is
still running (a caller that does not wait for it first): the synchronous path waits for the preparation,
the prepared one does not (it hands over the state right after the last ``next``).

Each repeat runs every system once per case, in an order rotated by one per repeat; each run takes
``--saves`` saves, one every ``--every`` steps, on a fresh stream. Reported per case and system: median and
min milliseconds over all saves, the state's size, and the ratio sync / prepared of the medians (both
systems measured in the same run).

Run: ``uv run python benchmarks/loader_state_stall.py [--repeat 3] [--saves 8] [--every 3] [--json PATH]``;
``--quick``: a smoke run (1 repeat, 2 saves, the omni-heavy case only). Writes
``benchmarks/results/loader_state_stall.json`` by default.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from omni_data import ZeroRedundancyFilter, encoder_microbatch_id, snapshot_async
from omni_train.binder import load_config
from omni_train.config import RunConfig
from omni_train.data_files import load_tokenizer
from omni_train.data_pipeline import build_step_stream

_MIN_ROW = 4096  # as omni_train.checkpointing


def stream(cfg: RunConfig, due: Callable[[int], bool] | bool) -> ZeroRedundancyFilter:
    """Pipeline rank 0's stream of the trainer for ``cfg`` (pp = 2, dp = 1)."""
    pp = cfg.parallel.pp
    consumes = {encoder_microbatch_id(k, 0, pp) for k in range(1, cfg.data.microbatches + 1)}
    zr = build_step_stream(
        cfg,
        load_tokenizer(cfg.data),
        dp_rank=0,
        dp_size=1,
        dp_group=None,
        consumes=consumes,
        read_text=True,
        background=True,
        prepare_on_request=True,
    )
    zr.snapshots = due
    zr.reset()
    return zr


def loader_row(blob: bytes) -> torch.Tensor:
    """The row ``TrainCheckpoint.save`` builds from one rank's state bytes."""
    width = max(_MIN_ROW, 1 << (8 + len(blob) - 1).bit_length())
    row = torch.zeros(1, 1, width, dtype=torch.uint8)
    row[0, 0, :8] = torch.frombuffer(bytearray(len(blob).to_bytes(8, "little")), dtype=torch.uint8)
    row[0, 0, 8 : 8 + len(blob)] = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    return row


def run(cfg: RunConfig, system: str, saves: int, every: int, in_flight: bool) -> list[tuple[float, bytes]]:
    """One run of ``system`` on a fresh stream: ``(milliseconds, state bytes)`` per save."""

    def due(next_step: int) -> bool:
        return next_step % every == 0

    zr = stream(cfg, due if system == "prepared" else False)
    out = []
    try:
        step = 0
        while len(out) < saves:
            fs = next(zr)
            assert fs.step == step
            zr.prepare()
            if not in_flight:
                zr.wait_prepared()
            if due(step + 1):
                t = time.perf_counter()
                if system == "sync":
                    blob = snapshot_async(zr).result()
                else:
                    blob = zr.snapshot().blob
                loader_row(blob)
                out.append(((time.perf_counter() - t) * 1e3, blob))
            zr.wait_prepared()
            step += 1
    finally:
        zr.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--saves", type=int, default=8)
    ap.add_argument("--every", type=int, default=3)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", default=str(Path(__file__).parent / "results" / "loader_state_stall.json"))
    args = ap.parse_args()
    repeat, saves = (1, 2) if args.quick else (args.repeat, args.saves)
    torch.set_num_threads(1)
    cases: list[tuple[str, RunConfig, bool]] = [("omni-heavy", load_config("omni-heavy"), False)]
    if not args.quick:
        big = load_config("omni-heavy", [("data.buffer_size", "1024")])
        cases += [("omni-heavy, buffer 1024", big, False), ("in flight", load_config("omni-heavy"), True)]
    systems = ["sync", "prepared"]
    rows: list[dict[str, Any]] = []
    for name, cfg, in_flight in cases:
        ms: dict[str, list[float]] = {s: [] for s in systems}
        sizes: list[int] = []
        for r in range(repeat):
            order = systems[r % len(systems) :] + systems[: r % len(systems)]
            got = {s: run(cfg, s, saves, args.every, in_flight) for s in order}
            for s in systems:
                ms[s] += [m for m, _ in got[s]]
            if not in_flight:  # the same states, byte for byte (in flight: prepared is one step earlier)
                assert [b for _, b in got["sync"]] == [b for _, b in got["prepared"]], name
            sizes += [len(b) for _, b in got["sync"]]
        row = {
            "case": name,
            "buffer_size": cfg.data.buffer_size,
            "in_flight": in_flight,
            "state_bytes_median": int(statistics.median(sizes)),
            "saves_per_system": len(ms["sync"]),
            **{
                f"{s}_ms": {"median": statistics.median(v), "min": min(v), "max": max(v)}
                for s, v in ms.items()
            },
        }
        row["ratio_sync_over_prepared"] = row["sync_ms"]["median"] / row["prepared_ms"]["median"]
        rows.append(row)
        print(
            f"{name:26s} state {row['state_bytes_median']:>9,d} B   sync {row['sync_ms']['median']:8.3f} ms"
            f"   prepared {row['prepared_ms']['median']:7.3f} ms   x{row['ratio_sync_over_prepared']:.1f}",
            flush=True,
        )
    result = {
        "rows": rows,
        "repeat": repeat,
        "saves": saves,
        "every": args.every,
        "quick": args.quick,
        "cores": os.cpu_count(),
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()

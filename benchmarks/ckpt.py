"""Checkpoint save/load time and bytes on disk: omni-ckpt vs torch.distributed.checkpoint (DCP) vs torch.save,
plus the blocking time of an async save vs a plain host copy of the same bytes.

Cases (one process, local disk, same run): ``large`` = 1 GiB in 16 MiB float32 tensors (64 x [2048, 2048]);
``tiny`` = 20,000 tensors of [4, 4] float32 (64 B each, 1.28 MB of data). Time is the best of ``--repeat``
runs, the systems taking turns within each repeat (each save into a fresh directory; omni-ckpt and DCP
fsync their files, torch.save does not), load fills preallocated tensors in place. Async:
``async_save`` until ``handle.staged`` resolves vs ``t.clone()`` of every tensor (the least any snapshot
can cost); the write finishes in the background. Ratios are against DCP.

Run: ``uv run python benchmarks/ckpt.py [--gib 1.0] [--tiny 20000] [--repeat 3]``; writes
``benchmarks/results/ckpt.json``. Temporary directories are removed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

import omni_ckpt

warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")


def disk_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def make_state(kind: str, gib: float, tiny: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    if kind == "large":
        n = max(1, round(gib * 64))
        return {f"layers.{i}.weight": torch.randn(2048, 2048, generator=g) for i in range(n)}
    return {f"layers.{i}.norm": torch.randn(4, 4, generator=g) for i in range(tiny)}


def run_case(kind: str, state: dict[str, torch.Tensor], work: Path, repeat: int) -> list[dict]:
    """Save and load times (best of ``repeat``) of each system. The systems take turns within each
    repeat, so none is always the first to hit a cold page cache or a busy disk."""
    target = {k: torch.empty_like(v) for k, v in state.items()}
    systems: dict[str, tuple[Path, Callable[[Path], None], Callable[[Path], None]]] = {
        "omni-ckpt": (
            work / "omni",
            lambda p: omni_ckpt.save(state, str(p)),
            lambda p: omni_ckpt.load(target, str(p)),
        ),
        "DCP": (
            work / "dcp",
            lambda p: dcp.save(state, checkpoint_id=str(p), no_dist=True),
            lambda p: dcp.load(target, checkpoint_id=str(p), no_dist=True),
        ),
        "torch.save": (
            work / "state.pt",
            lambda p: torch.save(state, p),
            lambda p: target.update(torch.load(p, weights_only=True)),
        ),
    }
    times = {name: ([], [], 0) for name in systems}
    for _ in range(repeat):
        for name, (path, save, load) in systems.items():
            t0 = time.perf_counter()
            save(path)
            t1 = time.perf_counter()
            load(path)
            t2 = time.perf_counter()
            assert all(torch.equal(target[k], v) for k, v in state.items()), name
            saves, loads, _ = times[name]
            times[name] = ([*saves, t1 - t0], [*loads, t2 - t1], disk_bytes(path))
            shutil.rmtree(path) if path.is_dir() else path.unlink()
            for t in target.values():
                t.zero_()
    return [
        {"case": kind, "system": name, "save_s": min(sv), "load_s": min(ld), "bytes": nbytes}
        for name, (sv, ld, nbytes) in times.items()
    ]


def run_async(state: dict[str, torch.Tensor], work: Path, repeat: int) -> dict:
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    copies = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        [t.clone() for t in state.values()]
        copies.append(time.perf_counter() - t0)
    copy_s = min(copies)
    blocking, total = [], []
    for i in range(repeat):
        url = str(work / f"async{i}")
        t0 = time.perf_counter()
        handle = omni_ckpt.async_save(state, url, host_budget_bytes=2 * nbytes)
        handle.staged.result()
        blocking.append(time.perf_counter() - t0)
        handle.wait()
        total.append(time.perf_counter() - t0)
        shutil.rmtree(url)
    return {
        "bytes": nbytes,
        "host_copy_s": copy_s,
        "async_blocking_s": min(blocking),
        "async_total_s": min(total),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=1.0, help="size of the large case (GiB)")
    ap.add_argument("--tiny", type=int, default=20000, help="tensors in the tiny case")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "ckpt.json"))
    args = ap.parse_args()
    torch.set_num_threads(min(4, os.cpu_count() or 1))
    rows: list[dict] = []
    work = Path(tempfile.mkdtemp(prefix="omni-ckpt-bench-"))
    try:
        tiny = make_state("tiny", args.gib, args.tiny)
        rows += run_case("tiny", tiny, work, args.repeat)
        del tiny
        large = make_state("large", args.gib, args.tiny)
        rows += run_case("large", large, work, args.repeat)
        asy = run_async(large, work, args.repeat)
        del large
    finally:
        shutil.rmtree(work, ignore_errors=True)

    base = {(r["case"]): r for r in rows if r["system"] == "DCP"}
    print(
        f"{'case':6} {'system':11} {'save s':>8} {'load s':>8} {'MB on disk':>11} {'save/DCP':>9} {'load/DCP':>9}"
    )
    for r in rows:
        b = base[r["case"]]
        r["save_vs_dcp"] = r["save_s"] / b["save_s"]
        r["load_vs_dcp"] = r["load_s"] / b["load_s"]
        print(
            f"{r['case']:6} {r['system']:11} {r['save_s']:8.3f} {r['load_s']:8.3f} {r['bytes'] / 1e6:11.2f} "
            f"{r['save_vs_dcp']:9.2f} {r['load_vs_dcp']:9.2f}"
        )
    print(
        f"async save of {asy['bytes'] / 2**30:.2f} GiB: blocking {asy['async_blocking_s']:.3f} s vs host copy "
        f"{asy['host_copy_s']:.3f} s (x{asy['async_blocking_s'] / asy['host_copy_s']:.2f}); "
        f"durable after {asy['async_total_s']:.3f} s"
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "rows": rows, "async": asy}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

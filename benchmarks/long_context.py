"""Long context on the bundled data: CP all-gather vs ring, recompute, offload, 1F1B vs GPipe, and the
modelled balance of hybrid DP/CP, in one run.

1. **Trainer** (``omni-long``, 2 processes, gloo on CPU), a few steps per variant in one 2-rank world,
   tokens/s and peak activation bytes per rank, each as a ratio to its named baseline in the same run:

   * ``cp=1 (pp=2)``: no CP, the two processes are two pipeline stages holding whole 10-16K-token packs;
   * ``cp=2 all-gather`` and ``cp=2 ring`` (``parallel.cp_attention``) against it;
   * ``cp=2 ring`` with recompute (``train.recompute``) and with activation offload (``train.offload``)
     against ``cp=2 ring``;
   * ``1f1b`` vs ``gpipe`` (``parallel.schedule``) at pp=2 on a microbatch mix with heavy tails (the
     paper's §7 case): most packs hold ~1K-token passages, about one in four a whole ~10K-token play,
     whose attention costs ~6x more.

   ``peak_activation_bytes_per_rank`` comes from the trainer's metrics.
2. **Attention alone**, one 16K-token pack at cp=2: bytes saved for backward per rank (counted with
   ``torch.autograd.graph.saved_tensors_hooks``) and forward + backward seconds, all-gather vs ring.
3. **Hybrid DP/CP vs plain CP, modelled** (``omni_parallel.hybrid_cp_load``): max/mean load over
   (microbatch, rank) for lognormal sample lengths of 1K-128K tokens; plain CP = one static CP size (the
   smallest that fits the longest sample) with the samples balanced heaviest first over the DP replicas'
   microbatches; hybrid = ``plan_hybrid_cp``; ``bound``: no plan can do better (the longest
   sample over every rank of one microbatch). Target: hybrid <= 1.05. The lengths are those of
   ``benchmarks/balance.py``'s hybrid rows (same draw).

Writes ``benchmarks/results/long_context.json``. The lead runs it alone on an idle machine.

    uv run python benchmarks/long_context.py [--steps 6] [--warmup 2] [--max-seq-len 16384]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import tempfile
import time
from enum import StrEnum
from pathlib import Path
from typing import Any

from balance import HYBRID_SETTINGS, lognormal_lengths  # benchmarks/ is on sys.path when run as a script

from omni_parallel import hybrid_cp_load, plan_hybrid_cp
from omni_parallel.testing import run_world
from omni_train.binder import load_config
from omni_train.config import MixturePhase, SourceConfig
from omni_train.metrics import tokens_per_s

FAMILIES = ["llm", "image", "audio"]


def _variants(cfg) -> list[dict[str, Any]]:
    """``{name, base, changes: {section: {field: value}}}``: the runs, each with its baseline's name."""
    text = next(s for s in cfg.data.sources if s.modality == "text")
    heavy = {
        "sources": [*cfg.data.sources, SourceConfig("passages", "text", text.urls)],
        "mixture": [MixturePhase({"image": 0.3, "audio": 0.1, text.name: 0.012, "passages": 0.588})],
        "microbatches": 4,
        "buffer_size": 16,
    }
    ring = {"pp": 1, "cp": 2, "cp_attention": "ring"}
    return [
        {"name": "cp=1 (pp=2)", "base": None, "changes": {"parallel": {"pp": 2, "cp": 1}}},
        {
            "name": "cp=2 all-gather",
            "base": "cp=1 (pp=2)",
            "changes": {"parallel": {"pp": 1, "cp": 2, "cp_attention": "allgather"}},
        },
        {"name": "cp=2 ring", "base": "cp=1 (pp=2)", "changes": {"parallel": ring}},
        {
            "name": "cp=2 ring, recompute",
            "base": "cp=2 ring",
            "changes": {"parallel": ring, "train": {"recompute": FAMILIES}},
        },
        {
            "name": "cp=2 ring, offload",
            "base": "cp=2 ring",
            "changes": {"parallel": ring, "train": {"offload": FAMILIES}},
        },
        {
            "name": "heavy tails, 1f1b",
            "base": None,
            "changes": {"parallel": {"pp": 2, "cp": 1, "schedule": "1f1b"}, "data": heavy},
        },
        {
            "name": "heavy tails, gpipe",
            "base": "heavy tails, 1f1b",
            "changes": {"parallel": {"pp": 2, "cp": 1, "schedule": "gpipe"}, "data": heavy},
        },
    ]


def apply_changes(cfg, changes: dict[str, dict[str, Any]]):
    """``cfg`` with the changes (KeyError naming a field that does not exist). A value
    is cast to the field's type where the field is an enum, or a switch (a list of families -> on)."""
    for section, fields in changes.items():
        sub = getattr(cfg, section)
        known = {f.name: f for f in dataclasses.fields(sub)}
        values = {}
        for key, value in fields.items():
            if key not in known:
                raise KeyError(f"{section}.{key}: no such config field")
            f = known[key]
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            if isinstance(default, bool) and isinstance(value, list):
                value = bool(value)
            elif isinstance(default, StrEnum):
                value = type(default)(value)
            values[key] = value
        cfg = dataclasses.replace(cfg, **{section: dataclasses.replace(sub, **values)})
    return cfg


def _world(rank: int, world_size: int, cfg, variants, root: str) -> dict[str, Any] | None:
    from omni_train.preflight import validate
    from omni_train.trainer import Trainer

    runs: dict[str, Any] = {}
    for v in variants:
        c = apply_changes(cfg, v["changes"])
        validate(c, world_size)
        out = Path(root) / v["name"].replace(" ", "_").replace(",", "").replace("=", "")
        Trainer(c, out, resume=False).run()
        if rank == 0:
            runs[v["name"]] = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    attention = _attention(rank)
    return {"runs": runs, "attention": attention} if rank == 0 else {"attention": attention}


def _attention(rank: int) -> dict[str, Any]:
    """One 16K-token pack (a play, passages, media) through CP attention at cp=2, omni-long's head shape."""
    import torch
    import torch.distributed as dist

    from omni_parallel import context_parallel_attention, ring_attention, shard_for_cp

    lengths = [10721, 1377, 1461, 1290, 900, 300, 200, 120, 15]
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(cu[-1], h, 16, generator=g) for h in (4, 2, 2))
    out = {}
    for name, attend in (("allgather", context_parallel_attention), ("ring", ring_attention)):
        lq, lk, lv = (shard_for_cp(x, cu, dist.group.WORLD).requires_grad_() for x in (q, k, v))
        seen: dict[int, int] = {}

        def pack(t, seen=seen):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        dist.barrier()
        t0 = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            o = attend(lq, lk, lv, dist.group.WORLD, cu_seqlens=cu)
        o.sum().backward()
        dt = time.perf_counter() - t0
        inputs = {x.untyped_storage().data_ptr() for x in (lq, lk, lv)}
        saved = sum(n for ptr, n in seen.items() if ptr not in inputs)
        out[name] = {"saved_bytes": saved, "seconds": dt}
    return {"rank": rank, "tokens": cu[-1], **out}


def _plain_cp_load(lengths: list[int], dp_cp: int, mbs: int, cap: int) -> tuple[float, int]:
    """max/mean load under one static CP size (the smallest that fits the longest sample, as a run with
    a fixed ``parallel.cp`` must use), samples balanced heaviest first onto the least-loaded (microbatch,
    DP replica) with room: the best a static-CP loader that balances its packs can do."""
    cp = next(c for c in range(1, dp_cp + 1) if dp_cp % c == 0 and -(-max(lengths) // (2 * c)) * 2 <= cap)
    slots = [(m, r) for m in range(mbs) for r in range(dp_cp // cp)]
    tokens = dict.fromkeys(slots, 0)
    load = dict.fromkeys(slots, 0.0)
    for n in sorted(lengths, key=lambda x: -hybrid_cp_load(x, cp)):
        share = -(-n // (2 * cp)) * 2 if cp > 1 else n
        fits = [s for s in slots if tokens[s] + share <= cap] or slots  # over-full step: least loaded
        s = min(fits, key=load.__getitem__)
        tokens[s] += share
        load[s] += hybrid_cp_load(n, cp)
    flat = list(load.values())  # every rank of a replica carries the replica's load
    return max(flat) / (sum(flat) / len(flat)), cp


def _hybrid_rows(seed: int = 1) -> list[dict[str, Any]]:
    """The lengths of ``benchmarks/balance.py``'s hybrid rows (same seed), plain CP against hybrid."""
    rows = []
    rng = random.Random(seed)
    for dp_cp, mbs, cap in HYBRID_SETTINGS:
        lengths = lognormal_lengths(rng, 0.6 * dp_cp * mbs * cap)
        plan = plan_hybrid_cp(lengths, dp_cp, cap, num_microbatches=mbs)
        plain, cp = _plain_cp_load(lengths, dp_cp, mbs, cap)
        # No plan beats the longest sample spread over every rank of one microbatch.
        mean = sum(hybrid_cp_load(n) for n in lengths) / (dp_cp * mbs)
        bound = max(mean, max(hybrid_cp_load(n, dp_cp) for n in lengths)) / mean
        rows.append(
            {
                "dp_cp": dp_cp,
                "microbatches": mbs,
                "max_tokens_per_rank": cap,
                "samples": len(lengths),
                "hybrid_max_over_mean": plan.imbalance,
                "lower_bound_max_over_mean": bound,
                "hybrid_cp_sizes": sorted({s.cp for s in plan.slots}),
                "plain_cp_size": cp,
                "plain_cp_max_over_mean": plain,
                "target_ok": plan.imbalance <= 1.05,
            }
        )
    return rows


def _summarise(variants, runs, warmup: int) -> list[dict[str, Any]]:
    rows = []
    for v in variants:
        got = runs[v["name"]]
        counted = got[warmup:] or got
        peaks = [m.get("peak_activation_bytes_per_rank") for m in counted]
        peak = None
        if all(p is not None for p in peaks):
            per_rank = [p if isinstance(p, list) else [p] for p in peaks]
            peak = [max(step[r] for step in per_rank) for r in range(len(per_rank[0]))]
        rows.append(
            {
                "variant": v["name"],
                "base": v["base"],
                "tokens_per_s": tokens_per_s(counted),
                "step_time_s": statistics.mean(m["step_time_s"] for m in counted),
                "peak_activation_bytes_per_rank": peak,
                "losses": [m["loss"] for m in got],
            }
        )
    by_name = {r["variant"]: r for r in rows}
    for r in rows:
        base = by_name.get(r["base"]) if r["base"] else None
        if base is None or "tokens_per_s" not in r or "tokens_per_s" not in base:
            continue
        r["tokens_per_s_vs_base"] = r["tokens_per_s"] / base["tokens_per_s"]
        if r["peak_activation_bytes_per_rank"] and base["peak_activation_bytes_per_rank"]:
            r["peak_activation_vs_base"] = max(r["peak_activation_bytes_per_rank"]) / max(
                base["peak_activation_bytes_per_rank"]
            )
        r["largest_relative_loss_difference_vs_base"] = max(
            abs(a - b) / abs(b) for a, b in zip(r["losses"], base["losses"])
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="omni-long")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2, help="steps per variant not counted")
    ap.add_argument("--max-seq-len", type=int, default=None, help="pack tokens (smoke runs: smaller)")
    args = ap.parse_args()
    cfg = load_config(args.config)
    data = (
        cfg.data if args.max_seq_len is None else dataclasses.replace(cfg.data, max_seq_len=args.max_seq_len)
    )
    cfg = dataclasses.replace(
        cfg,
        data=data,
        train=dataclasses.replace(cfg.train, steps=args.steps),
        checkpoint=dataclasses.replace(cfg.checkpoint, every=0),
    )
    variants = _variants(cfg)
    with tempfile.TemporaryDirectory() as root:
        results = run_world(_world, 2, args=(cfg, variants, root), timeout_s=7200)
    rows = _summarise(variants, results[0]["runs"], args.warmup)
    attention = [r["attention"] for r in results]
    hybrid = _hybrid_rows()

    print(
        f"long context: {cfg.name}, 2 processes, {args.steps} steps per variant ({args.warmup} not counted)"
    )
    print(f"{'variant':<24}{'tokens/s':>10}{'vs base':>9}{'peak act MiB/rank':>19}{'vs base':>9}  base")
    for r in rows:
        peak = r["peak_activation_bytes_per_rank"]
        peak_s = "/".join(f"{p / 2**20:.0f}" for p in peak) if peak else "n/a"
        ratio = f"{r['tokens_per_s_vs_base']:.2f}x" if "tokens_per_s_vs_base" in r else "-"
        pratio = f"{r['peak_activation_vs_base']:.2f}x" if "peak_activation_vs_base" in r else "-"
        print(
            f"{r['variant']:<24}{r['tokens_per_s']:>10.0f}{ratio:>9}{peak_s:>19}{pratio:>9}  {r['base'] or ''}"
        )
    print("\nCP attention alone, one pack of", attention[0]["tokens"], "tokens at cp=2 (per rank)")
    for a in attention:
        ag, ring = a["allgather"], a["ring"]
        print(
            f"  rank {a['rank']}: saved for backward all-gather {ag['saved_bytes'] / 2**20:.1f} MiB, ring "
            f"{ring['saved_bytes'] / 2**20:.1f} MiB ({ring['saved_bytes'] / ag['saved_bytes']:.2f}x); "
            f"fwd+bwd {ag['seconds']:.2f} s vs {ring['seconds']:.2f} s ({ag['seconds'] / ring['seconds']:.2f}x faster)"
        )
    print("\nHybrid DP/CP vs plain CP, modelled max/mean load, lognormal lengths 1K-128K tokens")
    print(
        f"{'dp_cp':>5} {'mbs':>4} {'cap':>6} {'samples':>7} {'plain cp':>8} {'plain':>7} {'hybrid':>7} {'bound':>6}"
    )
    for h in hybrid:
        print(
            f"{h['dp_cp']:>5} {h['microbatches']:>4} {h['max_tokens_per_rank']:>6} {h['samples']:>7} "
            f"{h['plain_cp_size']:>8} {h['plain_cp_max_over_mean']:>7.3f} {h['hybrid_max_over_mean']:>7.3f} "
            f"{h['lower_bound_max_over_mean']:>6.3f}  "
            f"{'ok' if h['target_ok'] else 'MISSED'} (target <= 1.05)"
        )
    out = Path(__file__).resolve().parent / "results" / "long_context.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(
        json.dumps(
            {"config": cfg.name, "steps": args.steps, "warmup": args.warmup, "max_seq_len": cfg.data.max_seq_len,
             "trainer": rows, "attention": attention, "hybrid_cp": hybrid},
            indent=2,
        )
    )  # fmt: skip
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()

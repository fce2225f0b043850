"""Expert parallelism on CPU: one MoE layer (``omni_parallel.moe.MoE``) at ep = 1 and ep = 2 in one
2-process gloo world, each rank with its own tokens (data parallel), forward + backward per iteration.

ep = 1: every rank holds all ``E`` experts and computes its own tokens' rows. ep = 2: each rank holds
``E/2`` experts; rows travel to their expert's rank and back by ``all_to_all_single``
(``omni_parallel.expert_parallel``; forward dispatch and combine, and their reverses in backward). Both
variants run ``--repeats`` times in alternating order; the first ``--warmup`` iterations of each run are
not counted. Reported: seconds per iteration (max over ranks), the ratio ep=2 / ep=1, and for ep = 2 the
seconds inside the token all-to-alls (``omni_parallel.ep_all_to_all`` in a ``torch.profiler`` trace, forward
and backward) and the count exchanges. On CPU over loopback there is no target: the numbers say what the
exchange adds per step, not what EP saves on a GPU (expert memory / ep, all-to-all over NVLink).

Writes ``benchmarks/results/moe_ep.json``. Run it alone on an idle machine:

    uv run python benchmarks/moe_ep.py [--tokens 4096] [--iters 10] [--warmup 2] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist

from omni_parallel.expert_parallel import ALL_TO_ALL
from omni_parallel.moe import MoE, MoEConfig
from omni_parallel.testing import run_world

CFG = dict(dim=256, hidden=512, experts=8, top_k=2, shared_experts=1, aux_loss_coef=0.01)


def _run(ep: int, tokens: int, iters: int, warmup: int) -> dict[str, float]:
    torch.manual_seed(0)
    layer = MoE(MoEConfig(**CFG), dist.group.WORLD if ep > 1 else None)
    layer.init_weights(torch.Generator().manual_seed(1), 0.02)
    x = torch.randn(tokens, CFG["dim"], generator=torch.Generator().manual_seed(2 + dist.get_rank()))
    times = []
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for i in range(warmup + iters):
            dist.barrier()
            t = time.perf_counter()
            layer(x).out.square().mean().backward()
            dist.barrier()
            if i >= warmup:
                times.append(time.perf_counter() - t)
    comm = {ALL_TO_ALL: 0.0, ALL_TO_ALL + "_counts": 0.0}
    for e in prof.events():
        if e.name in comm:
            comm[e.name] += e.cpu_time_total / 1e6
    n = warmup + iters  # the profile holds every iteration: scale the comm seconds to one
    return {
        "s_per_iter": sum(times) / len(times),
        "all_to_all_s_per_iter": comm[ALL_TO_ALL] / n,
        "count_exchange_s_per_iter": comm[ALL_TO_ALL + "_counts"] / n,
    }


def _world(rank: int, world_size: int, tokens: int, iters: int, warmup: int, repeats: int) -> list:
    out = []
    for r in range(repeats):
        for ep in (1, 2) if r % 2 == 0 else (2, 1):
            res = _run(ep, tokens, iters, warmup)
            t = torch.tensor(
                [res["s_per_iter"], res["all_to_all_s_per_iter"], res["count_exchange_s_per_iter"]]
            )
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            out.append({"ep": ep, "repeat": r, "s_per_iter": float(t[0]), "all_to_all_s": float(t[1]),
                        "count_exchange_s": float(t[2])})  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=4096, help="tokens per rank per iteration")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    rows = run_world(_world, 2, args=(args.tokens, args.iters, args.warmup, args.repeats), timeout_s=900)[0]
    best = {ep: min(r["s_per_iter"] for r in rows if r["ep"] == ep) for ep in (1, 2)}
    ep2 = min((r for r in rows if r["ep"] == 2), key=lambda r: r["s_per_iter"])
    result = {
        "config": {**CFG, "tokens_per_rank": args.tokens, "iters": args.iters, "warmup": args.warmup},
        "runs": rows,
        "s_per_iter_best": {f"ep{ep}": s for ep, s in best.items()},
        "ratio_ep2_over_ep1": best[2] / best[1],
        "ep2_all_to_all_s_per_iter": ep2["all_to_all_s"],
        "ep2_count_exchange_s_per_iter": ep2["count_exchange_s"],
    }
    out = Path(__file__).resolve().parent / "results" / "moe_ep.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=1))


if __name__ == "__main__":
    main()

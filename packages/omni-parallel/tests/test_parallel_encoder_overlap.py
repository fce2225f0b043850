"""The encoders' gradient collectives issued per tower during the step (``EncoderGradientSync.ready``,
:class:`omni_parallel.encoder_zero.TowerSync`), on 2 gloo ranks whose towers finish in different orders
and at different points: rank 0 runs audio, then image, then audio again (image is done before audio);
rank 1 runs image only (audio is done when the step starts). ZeRO 0 (flat buffers, async all-reduce in
place) and ZeRO 3 (FSDP2 units, async reduce-scatter) alike:

* a spy on ``torch.distributed`` (it records, then calls the real collective) shows both ranks issue the
  same async collectives in the same order (towers in name order: audio, then image, then ZeRO 0's
  shared buffer), each as early as the rule allows: rank 1's audio before any backward, rank 0's image
  held back behind audio until audio is done, nothing left to the sync on rank 0;
* every gradient equals one float64 process's brute-force sum of both ranks' backwards (<= 1e-12);
* a backward that reaches a tower after its collective was issued raises, naming the tower.
"""

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from omni_parallel import GroupSpec, ParallelConfig, ParallelState
from omni_parallel.encoder_zero import gather_parameters
from omni_parallel.parallelize import apply_encoder_zero
from omni_parallel.testing import run_world, spy_collectives

D = torch.float64
SIZES = {"audio": 6, "image": 10, "": 3}  # numel of each flat buffer (ZeRO 0): audio, image, shared proj
# each rank's backwards in order: (tower, seed); rank 0 finishes image before audio
WORK = {0: [("audio", 1), ("image", 2), ("audio", 3)], 1: [("image", 4), ("image", 5)]}


def _encoders(shared: bool) -> nn.ModuleDict:
    torch.manual_seed(0)
    mods = {"audio": nn.Linear(2, 2), "image": nn.Linear(4, 2)}  # 6 and 10 parameters
    if shared:
        mods["proj"] = nn.Linear(2, 1)  # in no tower: ZeRO 0's shared buffer (3 parameters)
    return nn.ModuleDict(mods).to(D)


def _backward(encoders: nn.ModuleDict, tower: str, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, encoders[tower].in_features, dtype=D, generator=g)
    y = encoders[tower](x)
    if "proj" in encoders:
        y = encoders["proj"](y)
    (y**2).sum().backward()


def _left(rank: int, k: int) -> list[str]:
    """The towers none of rank's backwards after the k-th runs (``k = 0``: the step's start)."""
    later = {t for t, _ in WORK[rank][k:]}
    return [t for t in ("audio", "image") if t not in later]


def _world(rank, world_size):
    ps = ParallelState.build(ParallelConfig(dp=world_size), groups=GroupSpec(encoder_sync=True))
    out = {}
    for zero in (0, 3):
        shared = zero == 0
        ref = _encoders(shared)
        for r in range(world_size):
            for tower, seed in WORK[r]:
                _backward(ref, tower, seed)
        want = {n: p.grad.clone() for n, p in ref.named_parameters()}
        encoders = _encoders(shared)
        towers = {"audio": encoders["audio"], "image": encoders["image"]}
        sync = apply_encoder_zero(encoders, towers, ps, zero)
        sync.attach()
        if zero:
            gather_parameters(towers.values())  # the executor's anchor does it when the step starts
        at = [0]  # backwards run so far, then "sync"

        def record(name, args, kwargs, at=at):  # (collective, elements, backwards run when issued)
            return name, args[0].numel() if name == "all_reduce" else args[1].numel(), at[0]

        with spy_collectives(record) as calls:
            sync.ready(_left(rank, 0))
            for k, (tower, seed) in enumerate(WORK[rank], start=1):
                _backward(encoders, tower, seed)
                at[0] = k
                sync.ready(_left(rank, k))
            at[0] = "sync"
            sync()
        grads = {
            n: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad.clone()
            for n, p in encoders.named_parameters()
        }
        diff = max((grads[n] - want[n]).abs().max().item() for n in want)
        out[zero] = (calls, diff)
    # a backward through a tower after its collective was issued raises, naming it; the sync still runs
    encoders = _encoders(True)
    sync = apply_encoder_zero(encoders, {"audio": encoders["audio"], "image": encoders["image"]}, ps, 0)
    sync.attach()
    sync.ready(["audio"])
    with pytest.raises(RuntimeError, match="encoder tower 'audio': a backward accumulated"):
        _backward(encoders, "audio", 9)
    sync()
    return out


def test_each_tower_is_issued_in_one_order_once_done_and_sums_exactly():
    results = run_world(_world, 2, timeout_s=120)
    # (collective, numel, backwards run on the rank when it was issued)
    a0, i0, s0 = ("all_reduce", SIZES["audio"]), ("all_reduce", SIZES["image"]), ("all_reduce", SIZES[""])
    want = {
        0: {  # rank 0: image done after backward 2 but held behind audio, both issued after backward 3
            0: [(*a0, 3), (*i0, 3), (*s0, 3)],
            1: [(*a0, 0), (*i0, 2), (*s0, 2)],  # rank 1: audio when the step starts, image after its last
        },
        3: {
            0: [("reduce_scatter_tensor", 6, 3), ("reduce_scatter_tensor", 10, 3)],
            1: [("reduce_scatter_tensor", 6, 0), ("reduce_scatter_tensor", 10, 2)],
        },
    }
    for rank, out in enumerate(results):
        for zero, (calls, diff) in out.items():
            assert calls == want[zero][rank], (rank, zero, calls)
            assert diff <= 1e-12, (rank, zero, diff)

"""The numerics guard (:mod:`omni_parallel.numerics`).

On 2 gloo processes, only rank 1's encoder output holds a NaN, and nothing of it reaches rank 0 (no
gradient is shared): the flags ride the guard's one all-reduce (the step's wait-for-ranks), so both ranks
skip the step with the same verdict naming the encoder and one rank, and both ranks' parameters and AdamW
state stay bit for bit what they were (the reference: their copies before the step). The loss the guard
reduces is the sum of both ranks' losses (brute force: all-gathered after). In one process: the spike
detector's z-score against ``statistics`` over the window (population deviation), bad steps in a row
stopping the run, and the spec's range checks.
"""

from __future__ import annotations

import math
import statistics

import pytest
import torch
import torch.distributed as dist
from torch import nn

from omni_parallel import ParallelConfig, ParallelState
from omni_parallel.grad_clip import clip_grad_norm_
from omni_parallel.numerics import NonFiniteError, NumericsGuard, NumericsSpec, OnNonFinite, apply_verdict
from omni_parallel.testing import run_world

CPU = torch.device("cpu")


def _state(params: list[nn.Parameter], opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = [p.detach().clone() for p in params]
    for p in params:
        for v in opt.state.get(p, {}).values():
            out.append(v.detach().clone() if isinstance(v, torch.Tensor) else torch.tensor(v))
    return out


def _one_step(rank, enc, head, opt, guard, step, poison):
    params = [*enc.parameters(), *head.parameters()]
    opt.zero_grad(set_to_none=True)
    x = torch.full((3, 4), 0.5 + rank + step, dtype=torch.float64)
    if poison:
        x[1, 2] = math.nan
    # the encoder's output feeds the head detached: a NaN there never reaches this rank's gradients
    out = enc(x).detach()
    loss = head(out[:1]).pow(2).sum()
    guard.observe_loss(loss)
    loss.backward()
    calls = []
    real = dist.all_reduce

    def counted(*args, **kwargs):
        calls.append(args[0].numel())
        return real(*args, **kwargs)

    dist.all_reduce = counted
    try:
        guard.reduce()
    finally:
        dist.all_reduce = real
    norm = clip_grad_norm_(params, [], 1.0, None)  # this rank's own: nothing of rank 1 in rank 0's
    verdict = guard.verdict(step, norm)
    if verdict.ok:
        opt.step()
    losses = [None, None]
    dist.all_gather_object(losses, loss.item())
    return verdict, calls, norm, losses


def _world(rank: int, world_size: int) -> dict:
    torch.manual_seed(0)  # the same initial weights on both ranks
    enc, head = nn.Linear(4, 4).double(), nn.Linear(4, 1).double()
    params = [*enc.parameters(), *head.parameters()]
    opt = torch.optim.AdamW(params, lr=0.1)
    guard = NumericsGuard(NumericsSpec(), ["image_encoder"], device=CPU, counts_loss=True)
    guard.watch({"image_encoder": enc})
    good, calls0, _, losses0 = _one_step(rank, enc, head, opt, guard, 0, poison=False)
    before = _state(params, opt)
    bad, calls1, norm1, _ = _one_step(rank, enc, head, opt, guard, 1, poison=rank == 1)
    unchanged = all(torch.equal(a, b) for a, b in zip(before, _state(params, opt)))
    again, _, _, _ = _one_step(rank, enc, head, opt, guard, 2, poison=False)
    # in a pp=2 layout only the last stage's loss counts (for_layout); a NaN output of the watched tower
    # on the first stage is flagged all the same, and the loss reaches the guard through wrap_loss
    ps = ParallelState.build(ParallelConfig(pp=2))
    staged = NumericsGuard.for_layout(NumericsSpec(), ps, {"image_encoder": enc}, device=CPU)
    loss = staged.wrap_loss(lambda k, y: (y.sum() * k, {"k": k}))
    got = loss(2, torch.tensor([rank + 1.0], dtype=torch.float64))
    enc(torch.full((1, 4), math.nan if rank == 0 else 1.0, dtype=torch.float64))
    staged.reduce()
    layout = staged.verdict(0, 1.0)
    return {
        "layout": (layout.action, dict(layout.nonfinite), layout.loss, float(got[0]), got[1]),
        "good": (good.action, good.loss, dict(good.nonfinite)),
        "losses0": losses0,
        "bad": (bad.action, dict(bad.nonfinite), bad.in_a_row, bad.what()),
        "local_norm1": norm1,
        "unchanged": unchanged,
        "again": (again.action, again.in_a_row),
        "calls": (calls0, calls1),
        "summary": guard.summary(),
    }


def test_one_ranks_nan_encoder_output_makes_every_rank_skip_the_step():
    results = run_world(_world, 2, timeout_s=120)
    for rank, r in enumerate(results):
        action, loss, nonfinite = r["good"]
        assert action == "ok" and nonfinite == {}
        assert loss == pytest.approx(sum(r["losses0"]), rel=1e-12)  # the loss summed over both ranks
        assert r["bad"] == (
            "skip_step",
            {"image_encoder": 1},
            1,
            "non-finite output of image_encoder (1 rank)",
        ), rank
        assert r["unchanged"], f"rank {rank}: the skipped step changed parameters or AdamW state"
        assert r["again"] == ("ok", 0)
        # one all-reduce per step, of loss, loss flag and one flag per watched module
        assert r["calls"] == ([3], [3])
        assert r["summary"]["counts"] == {"image_encoder": 1, "skip_step": 1}
        assert r["summary"]["events"] == [
            {"step": 1, "action": "skip_step", "nonfinite": {"image_encoder": 1}}
        ]
        # the loss counted on the last stage only: rank 1's 2 x 2.0 (every rank's would sum to 6)
        assert r["layout"] == ("skip_step", {"image_encoder": 1}, 4.0, 2.0 * (rank + 1), {"k": 2}), rank
    # rank 0 saw nothing wrong by itself: only the guard's reduction told it
    assert math.isfinite(results[0]["local_norm1"])


def _guard(**spec) -> NumericsGuard:
    return NumericsGuard(NumericsSpec(**spec), ["audio_encoder"], device=CPU, counts_loss=True)


def _step(guard: NumericsGuard, step: int, loss: float, grad_norm: float = 1.0, audio: float = 0.0):
    guard.observe_loss(torch.tensor(loss, dtype=torch.float32))
    guard.observe("audio_encoder", torch.tensor([audio, 1.0]))
    guard.reduce()  # no process group: nothing to reduce over
    return guard.verdict(step, grad_norm)


def test_a_loss_spike_is_its_z_score_over_the_window_of_good_steps():
    guard = _guard(spike_zscore=3.0, spike_window=4)
    losses = [2.0, 2.2, 1.9, 2.1]
    for i, loss in enumerate(losses):
        assert _step(guard, i, loss).ok  # the window fills first: nothing is a spike before
    window = [float(torch.tensor(x, dtype=torch.float32)) for x in losses]
    z = (3.0 - statistics.fmean(window)) / statistics.pstdev(window)
    spike = _step(guard, 4, 3.0)
    assert spike.action == "skip_step" and spike.nonfinite == {}
    assert spike.spike_z == pytest.approx(z, rel=1e-12) and z > 3.0
    assert "loss spike (loss 3, z = " in spike.what()
    # the spike did not enter the window: the same loss again is the same spike
    assert _step(guard, 5, 3.0).spike_z == pytest.approx(z, rel=1e-12)
    below = statistics.fmean(window) + 2.9 * statistics.pstdev(window)
    assert _step(guard, 6, below).ok
    assert guard.summary()["counts"] == {"loss_spike": 2, "skip_step": 2}
    # off: the same losses never spike
    off = _guard(spike_zscore=None, spike_window=4)
    assert all(_step(off, i, x).ok for i, x in enumerate([*losses, 3.0, 1e6]))


def test_bad_steps_in_a_row_stop_the_run_naming_the_step_and_what():
    guard = _guard(max_nonfinite_steps=3)
    assert _step(guard, 0, 1.0).ok
    first = _step(guard, 1, 1.0, grad_norm=math.inf)
    assert (first.action, dict(first.nonfinite), first.in_a_row) == ("skip_step", {"grad_norm": 0}, 1)
    second = _step(guard, 2, math.nan, audio=math.nan)
    assert second.action == "skip_step" and dict(second.nonfinite) == {"loss": 1, "audio_encoder": 1}
    assert math.isnan(second.loss)
    third = _step(guard, 3, 1.0, audio=math.inf)
    assert third.action == "stop"
    assert guard.stop_message(third) == (
        "step 3: non-finite output of audio_encoder (1 rank); stopping (3 bad steps in a row, "
        "max_nonfinite_steps = 3)"
    )
    # a good step in between starts the count again
    guard = _guard(max_nonfinite_steps=2)
    assert _step(guard, 0, 1.0, grad_norm=math.nan).action == "skip_step"
    assert _step(guard, 1, 1.0).ok
    assert _step(guard, 2, 1.0, grad_norm=math.nan).action == "skip_step"
    assert _step(guard, 3, 1.0, grad_norm=math.nan).action == "stop"


def test_stop_and_rollback_are_the_verdicts_action():
    guard = _guard(on_nonfinite="stop")
    bad = _step(guard, 7, math.inf)
    assert bad.action == "stop"
    assert guard.stop_message(bad) == "step 7: non-finite loss; stopping (on_nonfinite = stop)"
    assert _step(_guard(on_nonfinite=OnNonFinite.ROLLBACK), 0, math.nan).action == "rollback"


def test_verdict_needs_the_steps_reduction():
    guard = _guard()
    with pytest.raises(RuntimeError, match="reduce"):
        guard.verdict(0, 1.0)


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        ({"max_nonfinite_steps": 0}, "max_nonfinite_steps"),
        ({"spike_zscore": -1.0}, "spike_zscore"),
        ({"spike_zscore": math.nan}, "spike_zscore"),
        ({"spike_window": 1}, "spike_window"),
        ({"on_nonfinite": "ignore"}, "ignore"),
    ],
)
def test_the_spec_names_a_field_out_of_range(spec, field):
    with pytest.raises(ValueError, match=field):
        NumericsSpec(**spec)


def _bad_step(action: str, step: int = 5) -> tuple[NumericsGuard, object]:
    guard = _guard(on_nonfinite=action)
    return guard, _step(guard, step, math.nan)


def test_apply_verdict_steps_skips_rolls_back_or_stops():
    model = nn.Linear(2, 1).double()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(1, 2, dtype=torch.float64)).sum().backward()
    before = _state(list(model.parameters()), opt)
    said: list[str] = []
    # skip: nothing changes, one line said, the step's entry returned
    guard, bad = _bad_step("skip_step")
    out = apply_verdict(bad, guard, opt, say=said.append)
    assert all(torch.equal(a, b) for a, b in zip(before, _state(list(model.parameters()), opt)))
    assert out == {"bad_steps": 1, "numerics": {"step": 5, "action": "skip_step", "nonfinite": {"loss": 1}}}
    assert said == ["step 5: non-finite loss; step skipped (1 in a row)"]
    assert guard.stop_error(bad) is None
    # rollback: the caller's roll_back(step) runs, its answer noted and said
    calls: list[int] = []
    guard, bad = _bad_step("rollback")
    out = apply_verdict(
        bad, guard, opt, roll_back=lambda s: (calls.append(s), (3, ["step-4.x"]))[1], say=said.append
    )
    assert calls == [5] and out["numerics"]["rolled_back_to"] == 3
    assert said[-1] == (
        "step 5: non-finite loss; rolled back to step 3's parameters and optimizer state (set aside: step-4.x) "
        "(1 in a row)"
    )
    guard, bad = _bad_step("rollback")
    out = apply_verdict(bad, guard, opt, roll_back=lambda s: (None, []))
    assert out["numerics"]["rolled_back_to"] is None
    assert all(torch.equal(a, b) for a, b in zip(before, _state(list(model.parameters()), opt)))
    # stop: nothing changes here, the error names the step
    guard, bad = _bad_step("stop")
    apply_verdict(bad, guard, opt, say=said.append)
    assert said[-1] == "step 5: non-finite loss; stopping (1 in a row)"
    err = guard.stop_error(bad)
    assert isinstance(err, NonFiniteError) and str(err) == guard.stop_message(bad)
    # a good step steps the optimizer
    guard = _guard()
    good = _step(guard, 6, 1.0)
    assert apply_verdict(good, guard, opt) == {"bad_steps": 0}
    assert not torch.equal(before[0], model.weight.detach())

"""Numerics guard: non-finite losses, gradient norms and module outputs, and loss spikes, found in the
step they happen and agreed on by every rank before the optimizer step.

MegaScale-Omni §7-8 (the production run): experts checked tensors for anomalies, first every
communication tensor (a visible throughput cost), later only the encoders' outputs; transient loss
spikes early in training were bypassed by restarting from a checkpoint and skipping the data. Megatron-LM
checks the loss and the gradients for NaN every step (``rerun_state_machine.py``); PaLM (Chowdhery et al.
2022, §5.1) restarted ~100 steps before a spike and skipped 200-500 batches.

What is checked, and what it costs:

* every output of each watched module (:meth:`NumericsGuard.watch`; the app watches each encoder tower)
  and every microbatch loss (:meth:`NumericsGuard.observe_loss`): the tensor's sum (one vectorised
  reduction, no allocation: a NaN or Inf anywhere makes it NaN or Inf) and a flag kept on its device, no
  host synchronisation. An output so large that its sum overflows (``|sum| > 3.4e38`` in float32) is
  flagged too: a blow-up as well, which the next matmul would turn into Inf;
* the flags, and the loss's sum, travel in :meth:`NumericsGuard.reduce`: the one-element all-reduce over
  the world that the step already does before its gradient sync
  (:func:`omni_parallel.data_parallel.wait_for_ranks`), widened to ``2 + len(sources)`` float64s. No
  collective is added: every rank learns which module output was non-finite on which number of ranks,
  even where the NaN never reached its own gradients;
* the gradient norm: :func:`omni_parallel.grad_clip.clip_grad_norm_`'s all-reduce already makes any
  non-finite gradient of any rank visible in every rank's global norm (DP and encoder replicas hold
  reduced, hence equally poisoned, gradients; pipeline stages sum their squares).

:meth:`NumericsGuard.verdict` then gives the same :class:`StepVerdict` on every rank: ``ok``, or
``skip_step`` / ``rollback`` / ``stop`` (:class:`OnNonFinite`), ``stop`` too after
``max_nonfinite_steps`` bad steps in a row. A loss spike (``spike_zscore``) is a step whose world loss
lies more than ``spike_zscore`` standard deviations above the mean of the last ``spike_window`` accepted
steps' losses (one-sided z-score; accepted: finite and not a spike); it is handled as a non-finite step.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle

from omni_parallel.state import ParallelState

__all__ = [
    "GRAD_NORM",
    "LOSS",
    "NonFiniteError",
    "NumericsGuard",
    "NumericsSpec",
    "OnNonFinite",
    "StepVerdict",
    "apply_verdict",
]

LOSS = "loss"
"""The name of the loss in :attr:`StepVerdict.nonfinite` (``"grad_norm"`` names the gradient norm, any
other name a watched module's output)."""
GRAD_NORM = "grad_norm"
"""The name of the global gradient norm in :attr:`StepVerdict.nonfinite`."""
SPIKE = "loss_spike"


class OnNonFinite(StrEnum):
    """What a bad step (non-finite loss, gradient norm or watched output; a loss spike) does.

    ``skip_step``: no optimizer update (parameters and optimizer state untouched); the data moves on.
    ``rollback``: no update, and the caller restores the last good checkpoint's parameters and optimizer
    state (the data moves on: the steps since that checkpoint are skipped). ``stop``: the run ends.
    """

    SKIP_STEP = "skip_step"
    ROLLBACK = "rollback"
    STOP = "stop"


class NonFiniteError(RuntimeError):
    """The run stops on bad numerics; the message is one line naming the step and what was bad."""


@dataclass(frozen=True)
class NumericsSpec:
    """The guard's settings.

    Attributes:
        on_nonfinite: what a bad step does (:class:`OnNonFinite`).
        max_nonfinite_steps: bad steps in a row after which the run stops whatever ``on_nonfinite`` says
            (>= 1; 1: the first bad step stops it).
        spike_zscore: a step whose loss is this many standard deviations above the window's mean is a
            spike (> 0); ``None`` or 0: no spike detection.
        spike_window: accepted steps' losses the mean and deviation are taken over (>= 2); detection
            starts once the window is full.

    Raises:
        ValueError: a field out of range (named).
    """

    on_nonfinite: OnNonFinite = OnNonFinite.SKIP_STEP
    max_nonfinite_steps: int = 3
    spike_zscore: float | None = None
    spike_window: int = 50

    def __post_init__(self) -> None:
        object.__setattr__(self, "on_nonfinite", OnNonFinite(self.on_nonfinite))
        if isinstance(self.max_nonfinite_steps, bool) or self.max_nonfinite_steps < 1:
            raise ValueError(f"max_nonfinite_steps: must be an int >= 1, got {self.max_nonfinite_steps!r}")
        z = self.spike_zscore
        if z is not None and (not math.isfinite(z) or z < 0):
            raise ValueError(f"spike_zscore: must be a finite number >= 0 (0 or None: off), got {z!r}")
        if isinstance(self.spike_window, bool) or self.spike_window < 2:
            raise ValueError(f"spike_window: must be an int >= 2, got {self.spike_window!r}")

    @property
    def detects_spikes(self) -> bool:
        return bool(self.spike_zscore)


@dataclass(frozen=True)
class StepVerdict:
    """The guard's decision for one step, identical on every rank.

    Attributes:
        step: the step.
        loss: the step's loss summed over the ranks that count it (``nan`` when it is not finite).
        grad_norm: the global gradient norm before clipping.
        nonfinite: ``{name: ranks}``: ``"loss"``, ``"grad_norm"`` (ranks: 0, every rank sees it) and each
            watched module whose output held a NaN or Inf, with the number of ranks where it did.
        spike_z: the loss's z-score when it is a spike, else ``None``.
        action: ``"ok"``, or the :class:`OnNonFinite` value taken (``"stop"`` also after too many bad
            steps in a row).
        in_a_row: bad steps in a row, this one included (0 when ok).
    """

    step: int
    loss: float
    grad_norm: float
    nonfinite: Mapping[str, int] = field(default_factory=dict)
    spike_z: float | None = None
    action: str = "ok"
    in_a_row: int = 0

    @property
    def ok(self) -> bool:
        return self.action == "ok"

    def what(self) -> str:
        """What was bad, in words: ``"non-finite grad norm"``, ``"non-finite output of image (1 rank)"``,
        ``"loss spike (z = 9.1)"``."""
        parts = []
        for name, ranks in self.nonfinite.items():
            if name == LOSS:
                parts.append("non-finite loss")
            elif name == GRAD_NORM:
                parts.append("non-finite grad norm")
            else:
                parts.append(f"non-finite output of {name} ({ranks} rank{'s' if ranks != 1 else ''})")
        if self.spike_z is not None:
            parts.append(f"loss spike (loss {self.loss:.4g}, z = {self.spike_z:.1f})")
        return ", ".join(parts) or "nothing"

    def record(self) -> dict[str, Any]:
        """The step's entry for ``metrics.jsonl`` and the run summary (plain JSON values)."""
        out: dict[str, Any] = {"step": self.step, "action": self.action, "nonfinite": dict(self.nonfinite)}
        if self.spike_z is not None:
            out["spike_z"] = self.spike_z
        return out


class NumericsGuard:
    """One rank's numerics guard (collective: every rank calls :meth:`reduce` once per step, in the same
    place, and :meth:`verdict` after it).

    Args:
        spec: the settings.
        sources: the watched modules' names, the same on every rank in the same order (each encoder
            tower's modality on every rank, whether or not it runs it this step).
        device: where the flags live (the training device: the all-reduce's tensor).
        counts_loss: this rank's losses count in the step's loss (one rank per replica's last stage:
            TP ranks hold copies, SP/CP ranks partial sums); every rank's non-finite flag counts anyway.
        group: the ranks that reduce together (``None``: the default group, when initialised).

    Raises:
        ValueError: ``sources`` repeats a name or uses a reserved one (``loss``, ``grad_norm``).
    """

    def __init__(
        self,
        spec: NumericsSpec,
        sources: Sequence[str],
        *,
        device: torch.device,
        counts_loss: bool,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        names = list(sources)
        if len(set(names)) != len(names) or {LOSS, GRAD_NORM, SPIKE} & set(names):
            raise ValueError(f"NumericsGuard: sources must be distinct and not reserved names, got {names}")
        self.spec, self.sources, self.device = spec, names, device
        self.counts_loss, self.group = counts_loss, group
        self._index = {name: 2 + i for i, name in enumerate(names)}
        self._flags = self._zeros()  # [loss sum, loss non-finite, one flag per source]
        self._reduced: list[float] | None = None
        self.carried: list[float] = []  # what the last reduce() carried for its caller, summed
        self._window: deque[float] = deque(maxlen=spec.spike_window)
        self.in_a_row = 0
        self.counts: dict[str, int] = {}  # bad steps by reason, and by action taken
        self.events: list[dict[str, Any]] = []

    @classmethod
    def for_layout(
        cls, spec: NumericsSpec, ps: ParallelState, modules: Mapping[str, nn.Module], *, device: torch.device
    ) -> NumericsGuard:
        """This rank's guard in a parallel layout, watching each of ``modules`` (``{source: module}``, the
        same names on every rank in one order: each encoder tower, whether or not this rank runs it).

        The step's loss counts once per replica: on the last pipeline stage (where the loss runs), TP rank 0
        (TP ranks hold copies; SP and CP ranks hold partial sums, which the reduction adds).
        """
        last = ps.local_rank("pp") == ps.size("pp") - 1
        guard = cls(spec, list(modules), device=device, counts_loss=last and ps.local_rank("tp") == 0)
        guard.watch(modules)
        return guard

    def wrap_loss(self, loss: Callable[..., Any]) -> Callable[..., Any]:
        """``loss`` that also hands each result to :meth:`observe_loss` (the first item when it returns a
        tuple, e.g. ``(loss, metrics)``): the executor's loss function, watched."""

        def watched(*args: Any, **kwargs: Any) -> Any:
            got = loss(*args, **kwargs)
            self.observe_loss(got[0] if isinstance(got, tuple) else got)
            return got

        return watched

    def _zeros(self) -> torch.Tensor:
        return torch.zeros(2 + len(self.sources), dtype=torch.float64, device=self.device)

    # -- per step, before the reduction ----------------------------------------------------------------
    def observe(self, source: str, output: Any) -> None:
        """Flag ``source`` if any floating tensor in ``output`` (a tensor, or a tuple/list/dict of them)
        holds a NaN or Inf (or sums beyond its dtype's range). Raises KeyError: ``source`` is not one of
        :attr:`sources`."""
        i = self._index[source]
        for t in _tensors(output):
            bad = (~torch.isfinite(t.detach().sum())).to(torch.float64)
            self._flags[i] = torch.maximum(self._flags[i], bad)

    def observe_loss(self, loss: torch.Tensor) -> None:
        """Add one microbatch's loss (a scalar tensor) to the step's: its value where this rank counts the
        loss, its non-finite flag everywhere."""
        value = loss.detach().to(torch.float64)
        if self.counts_loss:
            self._flags[0] += value
        self._flags[1] = torch.maximum(self._flags[1], (~torch.isfinite(value)).to(torch.float64))

    def watch(self, modules: Mapping[str, nn.Module]) -> list[RemovableHandle]:
        """Observe every forward output of each of ``modules`` (``{source: module}``) from now on (forward
        hooks; remove them with the returned handles)."""
        return [
            module.register_forward_hook(lambda _m, _args, out, _name=name: self.observe(_name, out))
            for name, module in modules.items()
        ]

    # -- the step's one collective ---------------------------------------------------------------------
    def reduce(self, carry: Sequence[float] = ()) -> float:
        """Sum the step's flags and loss over ``group`` (one all-reduce of ``2 + len(sources)`` float64s,
        plus ``carry``; none with one rank) and start the next step's; returns the seconds spent waiting
        in it (the time :func:`omni_parallel.data_parallel.wait_for_ranks` measures: the slowest rank's
        arrival).

        ``carry``: other per-rank numbers the caller needs summed over the same ranks at this point (e.g.
        :meth:`omni_parallel.preemption.StopSignal.counts`), so that they cost no collective of their
        own; their sums are :attr:`carried` afterwards."""
        flags, self._flags = self._flags, self._zeros()
        n = flags.numel()
        if carry:
            flags = torch.cat([flags, torch.tensor(list(carry), dtype=flags.dtype, device=flags.device)])
        waited = 0.0
        if dist.is_initialized() and dist.get_world_size(self.group) > 1:
            start = time.perf_counter()
            dist.all_reduce(flags, group=self.group)
            if flags.device.type == "cuda":
                torch.cuda.synchronize(flags.device)
            waited = time.perf_counter() - start
        values = flags.tolist()
        self._reduced, self.carried = values[:n], values[n:]
        return waited

    # -- the decision ----------------------------------------------------------------------------------
    def verdict(self, step: int, grad_norm: float) -> StepVerdict:
        """The step's verdict from the reduced flags and the global gradient norm (identical on every
        rank); counts it. Call after :meth:`reduce`.

        Raises:
            RuntimeError: :meth:`reduce` was not called since the last verdict.
        """
        if self._reduced is None:
            raise RuntimeError(f"NumericsGuard.verdict(step {step}): reduce() was not called this step")
        v, self._reduced = self._reduced, None
        nonfinite: dict[str, int] = {}
        if v[1] > 0:
            nonfinite[LOSS] = int(v[1])
        if not math.isfinite(grad_norm):
            nonfinite[GRAD_NORM] = 0
        for name, i in self._index.items():
            if v[i] > 0:
                nonfinite[name] = int(v[i])
        loss = v[0] if LOSS not in nonfinite and math.isfinite(v[0]) else math.nan
        spike = None if nonfinite else self._zscore(loss)
        if not nonfinite and spike is None:
            self.in_a_row = 0
            self._window.append(loss)
            return StepVerdict(step, loss, grad_norm)
        self.in_a_row += 1
        action = str(self.spec.on_nonfinite)
        if self.in_a_row >= self.spec.max_nonfinite_steps:
            action = str(OnNonFinite.STOP)
        verdict = StepVerdict(step, loss, grad_norm, nonfinite, spike, action, self.in_a_row)
        for name in (*nonfinite, *([SPIKE] if spike is not None else [])):
            self.counts[name] = self.counts.get(name, 0) + 1
        self.counts[action] = self.counts.get(action, 0) + 1
        self.events.append(verdict.record())
        return verdict

    def _zscore(self, loss: float) -> float | None:
        """The loss's z-score against the window when it is a spike, else None."""
        if not self.spec.detects_spikes or len(self._window) < self.spec.spike_window:
            return None
        mean, std = statistics.fmean(self._window), statistics.pstdev(self._window)
        if std == 0.0:
            return math.inf if loss > mean else None
        z = (loss - mean) / std
        return z if z > float(self.spec.spike_zscore or 0.0) else None

    def note(self, step: int, **facts: Any) -> None:
        """Add what the caller did about step ``step``'s verdict (e.g. ``rolled_back_to=4``) to its
        event."""
        for event in reversed(self.events):
            if event["step"] == step:
                event.update(facts)
                return

    def stop_message(self, verdict: StepVerdict) -> str:
        """The one line a stopping run ends with."""
        why = (
            f"on_nonfinite = {self.spec.on_nonfinite}"
            if self.spec.on_nonfinite is OnNonFinite.STOP
            else f"{verdict.in_a_row} bad steps in a row, max_nonfinite_steps = {self.spec.max_nonfinite_steps}"
        )
        return f"step {verdict.step}: {verdict.what()}; stopping ({why})"

    def stop_error(self, verdict: StepVerdict) -> NonFiniteError | None:
        """The error that ends the run after ``verdict`` (:meth:`stop_message`), or None when it goes on."""
        return NonFiniteError(self.stop_message(verdict)) if verdict.action == OnNonFinite.STOP else None

    def summary(self, max_events: int = 20) -> dict[str, Any]:
        """The run's bad steps: ``bad_steps``, ``counts`` (by reason and by action) and the first
        ``max_events`` ``events`` (each :meth:`StepVerdict.record` plus what the caller noted)."""
        return {
            "bad_steps": len(self.events),
            "counts": dict(self.counts),
            "events": self.events[:max_events],
        }


def apply_verdict(
    verdict: StepVerdict,
    guard: NumericsGuard,
    optimizer: torch.optim.Optimizer,
    *,
    roll_back: Callable[[int], tuple[int | None, list[str]]] | None = None,
    say: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Act on the step's ``verdict`` (collective on a roll-back: every rank holds the same verdict).

    A good step steps ``optimizer``. A bad one does not: ``skip_step`` leaves parameters and optimizer
    state bit for bit as they were; ``rollback`` calls ``roll_back(step)``, which restores the newest good
    checkpoint before ``step`` and returns ``(its step, the names it set aside)``, or ``(None, [])`` when
    there is none (then, and without ``roll_back``, the step is only skipped), noted in the guard's event;
    ``stop`` changes nothing here: the caller records the step, then raises :meth:`NumericsGuard.stop_error`.
    A bad step is said in one line through ``say`` (e.g. stderr on rank 0; ``None``: not said):
    ``"step 5: non-finite loss; step skipped (1 in a row)"``.

    Returns:
        The step's metrics entries: ``{"bad_steps": the run's count}``, plus ``"numerics"`` (the verdict's
        :meth:`StepVerdict.record` with what was noted) on a bad step.
    """
    if verdict.ok:
        optimizer.step()
        return {"bad_steps": len(guard.events)}
    said = "step skipped"
    if verdict.action == OnNonFinite.ROLLBACK:
        to, aside = roll_back(verdict.step) if roll_back is not None else (None, [])
        guard.note(verdict.step, rolled_back_to=to)
        if to is None:
            said = "no committed checkpoint before it to roll back to; step skipped"
        else:
            said = f"rolled back to step {to}'s parameters and optimizer state (set aside: {', '.join(aside) or 'none'})"
    elif verdict.action == OnNonFinite.STOP:
        said = "stopping"
    if say is not None:
        say(f"step {verdict.step}: {verdict.what()}; {said} ({verdict.in_a_row} in a row)")
    entry = dict(verdict.record())
    entry.update(guard.events[-1] if guard.events and guard.events[-1]["step"] == verdict.step else {})
    return {"bad_steps": len(guard.events), "numerics": entry}


def _tensors(output: Any) -> Iterable[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        if output.is_floating_point() or output.is_complex():
            yield output
    elif isinstance(output, list | tuple):
        for o in output:
            yield from _tensors(o)
    elif isinstance(output, Mapping):
        for o in output.values():
            yield from _tensors(o)

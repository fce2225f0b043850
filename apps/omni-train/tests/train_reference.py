"""The one-process float64 oracle for the trainer's parallel layouts: losses and every gradient, step by step.

A parallel run (any pp, dp, Ulysses, encoder ZeRO, reordering) captures, after each step's gradient
reduction and before clipping, every parameter's whole gradient by name (DTensor shards made whole, the
pipeline stages merged). The reference is one process (pp=1, dp=1, encoders whole) that trains on the very
same packs: with dp > 1 its loader is :class:`MergedStream`, the DP replicas' streams side by side (replica
``d``'s packs are microbatches ``d * M + 1 .. (d + 1) * M``), so one step of the reference is the whole
global batch and its objective (mean cross-entropy over every target of the step) is the parallel run's.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from omni_data import LoaderSnapshot, snapshot_async
from omni_data.node import StatefulNode
from omni_data.testing import merge_replica_steps
from omni_data.zero_redundancy import FilteredStep

__all__ = [
    "MergedStream",
    "ResplitStream",
    "assert_runs_match",
    "capture_run",
    "reference_resplit_run",
    "reference_run",
    "relayout_run",
    "with_llm_layers",
    "with_parallel",
]


def with_llm_layers(cfg, n_layers: int):
    """``cfg`` with ``n_layers`` LLM layers (e.g. 4: one per stage of 2 ranks x 2 virtual stages under
    interleaved 1F1B)."""
    llm = dataclasses.replace(cfg.model.llm, n_layers=n_layers)
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, llm=llm))


def with_parallel(cfg, **par):
    """``cfg`` with ``[parallel]`` fields replaced (``data_<field>`` keys replace ``[data]`` fields)."""
    data = {k.removeprefix("data_"): v for k, v in par.items() if k.startswith("data_")}
    par = {k: v for k, v in par.items() if not k.startswith("data_")}
    return dataclasses.replace(
        cfg,
        parallel=dataclasses.replace(cfg.parallel, **par),
        data=dataclasses.replace(cfg.data, **data),
    )


def _whole_grads(trainer) -> dict[str, np.ndarray]:
    """This rank's gradients by name, DTensors made whole (collective over their meshes, same order on
    every rank: LLM stage first, then the encoders)."""
    out = {}
    for name, p in trainer.model.named_parameters():
        g = p.grad
        if isinstance(g, DTensor):
            g = g.full_tensor()
        out[name] = (g if g is not None else torch.zeros(p.shape, dtype=p.dtype)).detach().numpy().copy()
    return out


def _gathered_grads(trainer) -> dict[str, np.ndarray] | None:
    """Every rank's gradients merged by name (LLM stages are disjoint; replicas and encoders agree), on
    rank 0 (collective)."""
    mine = _whole_grads(trainer)
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if dist.get_rank() != 0:
        return None
    merged: dict[str, np.ndarray] = {}
    for grads in everyone:
        for name, g in grads.items():
            merged.setdefault(name, g)
    return merged


def _losses(run: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def capture_run(
    cfg, run: Path, *, stream=None, on_inputs=None, resume_step: int | None = None
) -> tuple[list[float], list[dict]] | None:
    """Train ``cfg`` in this world (every rank calls it); rank 0 gets ``(losses, grads per step)``.

    ``stream``: a loader replacing the trainer's (the reference's :class:`MergedStream`). ``on_inputs``:
    called as ``on_inputs(trainer, step, inputs)`` after each step (tests check what a step held).
    ``resume_step``: resume from that committed step of ``run/checkpoints`` (``--resume --resume-step``).
    """
    from omni_train.trainer import Trainer

    trainer = Trainer(cfg, run, resume=resume_step is not None, resume_step=resume_step)
    if stream is not None:
        trainer.stream.close()
        trainer.stream = trainer.checkpoint.stream = stream
    grads: list[dict] = []

    def after_backward(step, inputs, result):
        g = _gathered_grads(trainer)
        if g is not None:
            grads.append(g)
        if on_inputs is not None:
            on_inputs(trainer, step, inputs)

    trainer.run(after_backward=after_backward)
    return (_losses(run), grads) if dist.get_rank() == 0 else None


def relayout_run(cfg, saved: str, run: Path, resume_at: int) -> tuple[list[float], list[dict]] | None:
    """Resume ``cfg`` (another layout) from committed step ``resume_at`` of the checkpoints under
    ``saved``, through the trainer's own ``--resume`` path (``resume_step``): rank 0 copies them into
    ``run/checkpoints`` first (every rank calls it; rank 0 gets ``(losses, grads per step)`` of the steps
    trained after the resume)."""
    import shutil

    if dist.get_rank() == 0:
        shutil.copytree(saved, Path(run) / "checkpoints")
    dist.barrier()
    out = capture_run(cfg, Path(run), resume_step=resume_at)
    if out is None:
        return None
    losses, grads = out  # metrics.jsonl holds the resumed steps only (a fresh run directory)
    return losses[-(cfg.train.steps - resume_at) :], grads


class MergedStream(StatefulNode[FilteredStep]):
    """The DP replicas' loaders of ``cfg`` (each as its replica builds it, ``pp = 1``) merged into one step
    of ``dp * M`` microbatches for a one-process reference."""

    def __init__(self, cfg, tokenizer, dp: int) -> None:
        super().__init__()
        from omni_train.data_pipeline import build_step_stream

        self.m = cfg.data.microbatches
        one = with_parallel(cfg, pp=1, dp=1)
        self.streams = [
            build_step_stream(
                one,
                tokenizer,
                dp_rank=d,
                dp_size=dp,
                dp_group=None,
                consumes=set(range(1, self.m + 1)),
                read_text=True,
            )
            for d in range(dp)
        ]

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        for d, s in enumerate(self.streams):
            s.reset(None if initial_state is None else initial_state[str(d)])

    def get_state(self) -> dict[str, Any]:
        return {str(d): s.state_dict() for d, s in enumerate(self.streams)}

    def close(self) -> None:
        for s in self.streams:
            s.close()

    def wait_prepared(self) -> None:
        for s in self.streams:
            s.wait_prepared()

    def snapshot(self) -> LoaderSnapshot:
        """The replicas' states together, taken now (what ``TrainCheckpoint.save`` stores; it also sets
        ``snapshots``, which this reference, preparing nothing ahead, ignores)."""
        return LoaderSnapshot(self.streams[0].snapshot(prepared=False).step, snapshot_async(self).result())

    def prepare(self) -> None:
        for s in self.streams:
            s.prepare()

    def next(self) -> FilteredStep:
        return merge_replica_steps([next(s) for s in self.streams], self.m)

    @property
    def image_code_encodes(self) -> int:
        """The replicas' image-code encodes (``ZeroRedundancyFilter.image_code_encodes``), summed."""
        return sum(s.image_code_encodes for s in self.streams)


class ResplitStream(StatefulNode[FilteredStep]):
    """The one-process loader of ``cfg`` (``pp = 1``, ``dp = 1``, ``data.microbatches`` packs per step)
    that resumes from a :class:`MergedStream` state by re-splitting its replicas' states over one DP rank
    (omni-data's ``load_resplit``): the loader of a one-process reference for a resume under another DP
    size, built from the replicas' states in memory, not from a parallel run's checkpoint rows."""

    def __init__(self, cfg, tokenizer) -> None:
        super().__init__()
        from omni_train.data_pipeline import build_step_stream

        m = cfg.data.microbatches
        self.inner = build_step_stream(
            with_parallel(cfg, pp=1, dp=1),
            tokenizer,
            dp_rank=0,
            dp_size=1,
            dp_group=None,
            consumes=set(range(1, m + 1)),
            read_text=True,
        )

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        if initial_state is None:
            self.inner.reset()
        elif "inner" in initial_state:  # its own state (a save of this stream)
            self.inner.reset(initial_state["inner"])
        else:  # a MergedStream's: replica d's state under key str(d)
            self.inner.load_resplit([initial_state[str(d)] for d in range(len(initial_state))], 0, 1)

    def get_state(self) -> dict[str, Any]:
        return {"inner": self.inner.state_dict()}

    def close(self) -> None:
        self.inner.close()

    def wait_prepared(self) -> None:
        self.inner.wait_prepared()

    def snapshot(self) -> LoaderSnapshot:
        """Its state taken now (as :meth:`MergedStream.snapshot`)."""
        return LoaderSnapshot(self.inner.snapshot(prepared=False).step, snapshot_async(self).result())

    def prepare(self) -> None:
        self.inner.prepare()

    @property
    def image_code_encodes(self) -> int:
        return self.inner.image_code_encodes

    def next(self) -> FilteredStep:
        return next(self.inner)


def reference_resplit_run(cfg, saved: str, run: Path, resume_at: int) -> tuple[list[float], list[dict]]:
    """The one-process reference of a resume under another DP size (call inside a 1-process world): the
    reference of ``cfg``'s run over several replicas (:func:`reference_run`) wrote its committed steps under
    ``saved`` (model, AdamW and the :class:`MergedStream` state, one process, no shards); this process
    resumes its step ``resume_at`` at ``pp = 1``, ``dp = 1`` (``data.microbatches`` packs per step) with the
    replicas' loader states re-split over one DP rank (:class:`ResplitStream`), and trains the rest of
    ``cfg.train.steps``. Returns ``(losses, grads per step)`` of those steps."""
    import shutil

    from tokenizers import Tokenizer

    from omni_train.data_files import tokenizer_path

    ref = with_parallel(cfg, pp=1, dp=1, ulysses=1, encoder_zero=0, encoder_sp=1, data_reorder_group_size=1)
    shutil.copytree(saved, Path(run) / "checkpoints")
    stream = ResplitStream(cfg, Tokenizer.from_file(str(tokenizer_path(cfg.data))))
    out = capture_run(ref, Path(run), stream=stream, resume_step=resume_at)
    assert out is not None
    losses, grads = out
    return losses[-(cfg.train.steps - resume_at) :], grads


def reference_run(cfg, run: Path, dp: int, *, on_inputs=None) -> tuple[list[float], list[dict]]:
    """The one-process reference of ``cfg``'s run over ``dp`` replicas (call inside a 1-process world);
    ``on_inputs`` as for :func:`capture_run`."""
    from tokenizers import Tokenizer

    from omni_train.data_files import tokenizer_path

    ref = with_parallel(
        cfg,
        pp=1,
        dp=1,
        ulysses=1,
        encoder_zero=0,
        encoder_sp=1,
        data_microbatches=cfg.data.microbatches * dp,
        data_reorder_group_size=1,
    )
    stream = MergedStream(cfg, Tokenizer.from_file(str(tokenizer_path(cfg.data))), dp) if dp > 1 else None
    out = capture_run(ref, run, stream=stream, on_inputs=on_inputs)
    assert out is not None
    return out


def assert_runs_match(got, want, name: str, tol: float = 1e-10) -> None:
    """Losses and every gradient of every step within ``tol`` (absolute; values are O(1) or smaller)."""
    losses, grads = got
    ref_losses, ref_grads = want
    assert len(losses) == len(ref_losses), (name, losses, ref_losses)
    for step, (a, b) in enumerate(zip(losses, ref_losses)):
        assert abs(a - b) <= tol, f"{name}: step {step} loss {a} != reference {b}"
    assert len(grads) == len(ref_grads), name
    for step, (g, r) in enumerate(zip(grads, ref_grads)):
        assert set(g) == set(r), f"{name}: step {step} parameters {set(g) ^ set(r)} on one side only"
        for n in r:
            diff = float(np.abs(g[n] - r[n]).max()) if r[n].size else 0.0
            assert diff <= tol, f"{name}: step {step} gradient of {n} differs by {diff}"

"""The encoders' gradient collectives overlap the step's backward (``EncoderGradientSync.ready``, the
executor's ``encoder_backwards_left`` hook): each tower's all-reduce (encoder ZeRO 0) or reduce-scatter
(ZeRO 3) is issued async once the tower's last backward of the step on this rank has run.

Two gloo ranks at pp=2 (1F1B, 4 microbatches, images and audio) train 2 steps at ``encoder_zero`` 0 and 3:

* values: losses and every gradient of every step equal the one-process float64 reference
  (``train_reference``) within 1e-10;
* overlap: a spy on ``torch.distributed`` (it records, then runs the real collective) logs each async
  encoder collective next to the executor's hooks; on some rank of each step an encoder collective is
  issued before the rank's last LLM backward starts (``before_last_backward`` of its last stage), and on
  every rank every encoder collective is issued async, in the same order (towers in name order), never
  blocking (the sync issues only what is left).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from train_fixtures import make_dataset, side_by_side, write_config
from train_reference import assert_runs_match, capture_run, reference_run, with_parallel

from omni_parallel.testing import run_world
from omni_train.binder import load_config

pytestmark = pytest.mark.slow


class _Spy:
    """Logs ``("issue", name)`` for every async all-reduce / reduce-scatter (then runs the real one), and
    the executor's hooks: ``("last_backward", stage)`` before a stage's last backward, ``("sync",)`` when
    the step's gradient reduction starts."""

    def __init__(self, log):
        import torch.distributed as dist

        self.dist, self.log, self.saved = dist, log, {}
        for name in ("reduce_scatter_tensor", "all_reduce"):
            real = self.saved[name] = getattr(dist, name)
            setattr(dist, name, self._wrap(name, real))

    def _wrap(self, name, real):
        def call(*args, **kwargs):
            if kwargs.get("async_op", False):
                self.log[-1].append(("issue", name))
            return real(*args, **kwargs)

        return call

    def close(self):
        for name, real in self.saved.items():
            setattr(self.dist, name, real)

    def watch(self, trainer):
        ex = trainer.executor
        arm, reduce = ex.before_last_backward, ex.reduce_gradients

        def before_last_backward(chunk):
            stage = next(s for s, m in ex.stages.items() if m is chunk)
            self.log[-1].append(("last_backward", stage))
            arm(chunk)

        def reduce_gradients():
            self.log[-1].append(("sync",))
            return reduce()

        ex.before_last_backward, ex.reduce_gradients = before_last_backward, reduce_gradients


def _runs(rank, world_size, cfg, root):
    out = {}
    for zero in (0, 3):
        logs: list[list] = []  # per observed step: the spy's events
        spies: list[_Spy] = []

        def on_inputs(trainer, step, inputs, logs=logs, spies=spies):
            if step == 0:  # from step 1 on: the spy watches the collectives and the executor
                spies.append(_Spy(logs))
                spies[0].watch(trainer)
            logs.append([])  # a new step's log (the hooks append to the last)

        try:
            got = capture_run(
                with_parallel(cfg, encoder_zero=zero), Path(root) / f"z{zero}", on_inputs=on_inputs
            )
        finally:
            for spy in spies:
                spy.close()
        last = max(_stages(cfg, rank))
        out[zero] = got, logs[:-1], last
    return out


def _stages(cfg, rank):
    """The LLM stages pipeline rank ``rank`` holds."""
    from omni_pipeline import build_schedule

    par = cfg.parallel
    return build_schedule(par.schedule, par.pp, cfg.data.microbatches, par.virtual_stages).rank_stages(rank)


def _reference(rank, world_size, cfg, root):
    return reference_run(cfg, Path(root) / "ref", 1)


def test_encoder_collectives_overlap_the_backward_and_match_one_process(tmp_path):
    data = make_dataset(tmp_path / "data", n_image=12, n_audio=8, n_text=12)
    cfg = load_config(
        str(write_config(tmp_path / "c.toml", data, steps=2, every=0, pp=2, extra='dtype = "float64"'))
    )
    cfg = with_parallel(cfg, data_microbatches=4)
    results, reference = side_by_side(  # other run folders: the reference runs on the pipeline's idle core
        lambda: run_world(_runs, 2, args=(cfg, str(tmp_path)), timeout_s=300),
        lambda: run_world(_reference, 1, args=(cfg, str(tmp_path)), timeout_s=300),
    )
    want = reference[0]
    for zero in (0, 3):
        assert_runs_match(results[0][zero][0], want, f"encoder_zero {zero}")
        kind = "all_reduce" if zero == 0 else "reduce_scatter_tensor"
        logs = [results[rank][zero][1] for rank in range(2)]
        assert len(logs[0]) == len(logs[1]) == 1, logs  # step 1 observed on both ranks
        early = 0
        for rank, (log,) in enumerate(logs):
            last = ("last_backward", results[rank][zero][2])
            issues = [e for e in log if e[0] == "issue"]
            # one collective per tower (image, audio: one buffer / bucket each), all of them async
            assert issues == [("issue", kind)] * 2, (zero, rank, log)
            assert log.count(("sync",)) == 1 and last in log, (zero, rank, log)
            early += sum(e[0] == "issue" for e in log[: log.index(last)])
        # issued before the rank's last LLM backward started: it overlaps that backward
        assert early > 0, (zero, logs)

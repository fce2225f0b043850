"""Schedule choice, activation memory controls and bf16 in the trainer, against one float64 process.

All trainer runs share one 2-process world and one 1-process world (a module fixture; process start-up
dominates these tiny runs), each test checks its part:

* ``parallel.schedule = "gpipe"`` and ``"interleaved"`` (2 virtual stages per rank) with every placement
  policy: losses, gradient norms and the last step's gradients of every parameter equal one process
  running the whole model (pp=1, float64) to 1e-10; so does interleaved on one process (both virtual
  stages on one rank, handed over locally).
* A checkpoint saved under 1F1B (pp=2, 2 layers per rank) resumes under interleaved (1 layer per virtual
  stage): model and optimizer state load bit for bit by parameter name, the continued losses equal the
  single process's.
* Recompute (whole blocks), selective recompute (attention branches) and offload of saved activations
  leave losses and gradients bit-identical to neither; the per-rank peak of saved activations in
  ``metrics.jsonl`` drops with recompute, moves to the offloaded count with offload, is higher under
  GPipe than under 1F1B on the last stage (two microbatches in flight instead of one), and
  ``summary.json`` holds its per-rank maximum.
* ``train.dtype = "bfloat16"`` against the same run in float32: it trains, stays within 2% of the float32
  losses without equalling them; parameters, gradients and AdamW moments are float32; every tensor sent
  between pipeline ranks (activations, encoder outputs, their gradients) is bfloat16 (each ``isend`` is
  recorded). The 100-step comparison on ``omni-tiny`` is ``benchmarks/bf16_loss.py``.
* Config validation names the fields a schedule does not fit.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from train_fixtures import make_dataset, side_by_side, write_config

from omni_parallel.testing import run_world
from omni_pipeline import PlacementPolicy
from omni_train.binder import config_from_dict, load_config
from omni_train.config import ConfigError
from omni_train.preflight import validate

pytestmark = pytest.mark.slow

STEPS = 3
INTER = {"schedule": "interleaved", "virtual_stages": 2}
GRID = [
    (f"{sched}-{pol}", "f64", {**par, "placement": str(pol)}, {})
    for sched, par in (("gpipe", {"schedule": "gpipe"}), ("interleaved", INTER))
    for pol in PlacementPolicy
]
MEMORY = [
    ("recompute", "f64", INTER, {"recompute": ["llm", "image", "audio"]}),
    (
        "selective-offload",
        "f64",
        INTER,
        {
            "recompute": ["llm", "audio"],
            "recompute_modules": ["attention"],
            "offload": ["llm", "image", "audio"],
        },
    ),
]
RESUME = [("1f1b", "f64", {}, {"steps": 1}), ("resumed", "f64", INTER, {"resume": True, "dir": "1f1b"})]
BF16 = [("float32", "f32", {}, {}), ("bfloat16", "f32", {}, {"dtype": "bfloat16"})]
SINGLE = [("pp1", "f64", {"pp": 1}, {}), ("pp1-interleaved", "f64", {"pp": 1, **INTER}, {})]
# layer splits other than the default [2, 2]: explicit (with the planned placement) and cost-balanced
SPLITS = [
    ("1f1b-planned-3-1", "f64", {"placement": "planned", "stage_layers": [3, 1]}, {}),
    ("interleaved-planned-explicit", "f64", {**INTER, "placement": "planned", "stage_layers": [1] * 4}, {}),
    ("1f1b-auto", "f64", {"stage_layers": "auto"}, {}),
]


def _variant(cfg, par: dict, train: dict):
    return dataclasses.replace(
        cfg,
        parallel=dataclasses.replace(cfg.parallel, **par),
        train=dataclasses.replace(cfg.train, **train),
    )


def _state(trainer) -> dict[str, torch.Tensor]:
    """Model and optimizer state of this rank by name."""
    from omni_ckpt import optimizer_state_dict

    out = {f"model.{n}": t.detach().clone() for n, t in trainer.model.state_dict().items()}
    for n, s in optimizer_state_dict(trainer.model, trainer.optimizer)["state"].items():
        out.update({f"optim.{n}.{k}": v.detach().clone() for k, v in s.items()})
    return out


def _run(rank, world_size, cfgs, variants, root):
    """Per variant: metrics rows (rank 0), this rank's last gradients, state (restored from the checkpoint
    before a resumed run; at the end otherwise), dtypes of what it sent with isend, AdamW moments' dtypes,
    the wire dtype."""
    from omni_train.trainer import Trainer

    out = {}
    isend = dist.isend
    for name, which, par, train in variants:
        train = dict(train)
        resume, run = train.pop("resume", False), Path(root) / train.pop("dir", name)
        c = _variant(cfgs[which], par, train)
        validate(c, world_size)
        sent: set[torch.dtype] = set()

        def recording(tensor, dst, group=None, tag=0, sent=sent):
            sent.add(tensor.dtype)
            return isend(tensor, dst, group=group, tag=tag)

        dist.isend = recording
        try:
            trainer = Trainer(c, run, resume=resume)
            restored = None
            if resume:
                trainer.checkpoint.restore()
                restored = _state(trainer)
            trainer.run()
        finally:
            dist.isend = isend
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        out[name] = {
            "rows": rows if rank == 0 else None,
            "grads": {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters()},
            "state": restored if resume else _state(trainer),
            "sent": {d for d in sent if d.is_floating_point},
            "moments": {
                t.dtype for s in trainer.optimizer.state.values() for t in (s["exp_avg"], s["exp_avg_sq"])
            },
            "wire": trainer.builder.dtype,
            "schedule": type(trainer.schedule).__name__,
            "stages": sorted(trainer.executor.stages),
            "layers": sorted(int(i) for i in trainer.stage.layers),
        }
    return out


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("sched")
    return root, make_dataset(root / "data", n_image=16, n_audio=8, n_text=16)


@pytest.fixture(scope="module")
def cfg(data):
    root, d = data
    c = load_config(str(write_config(root / "c.toml", d, steps=STEPS, every=0)))
    llm = dataclasses.replace(c.model.llm, n_layers=4)  # 2 ranks x 2 virtual stages of one layer
    return dataclasses.replace(c, model=dataclasses.replace(c.model, llm=llm))


@pytest.fixture(scope="module")
def runs(data, cfg):
    root, _ = data
    # float64: the pipeline must reproduce one process to rounding (Adam amplifies float32 noise)
    cfgs = {"f64": _variant(cfg, {}, {"dtype": "float64"}), "f32": _variant(cfg, {}, {"steps": 4})}
    pp2, single = side_by_side(  # other run folders: the one process runs on the pipeline's idle core
        lambda: run_world(
            _run, 2, args=(cfgs, GRID + MEMORY + RESUME + BF16 + SPLITS, str(root / "pp2")), timeout_s=600
        ),
        lambda: run_world(_run, 1, args=(cfgs, SINGLE, str(root / "pp1")), timeout_s=300)[0],
    )
    return pp2, single, root


def _merged(runs_of_ranks: list[dict], key: str) -> dict[str, torch.Tensor]:
    """Every rank's ``{name: tensor}`` in one dict; a name on several ranks (the encoders) must agree."""
    out: dict[str, torch.Tensor] = {}
    for d in runs_of_ranks:
        for n, t in d[key].items():
            if n in out:
                assert torch.equal(t, out[n]), n
            out[n] = t
    return out


def _close(got: dict, want: dict, tol: float = 1e-10) -> None:
    assert sorted(got) == sorted(want)
    for n, t in want.items():
        torch.testing.assert_close(got[n], t, rtol=tol, atol=tol, msg=n)


def _col(rows: list[dict], key: str) -> list:
    return [r[key] for r in rows]


def test_gpipe_and_interleaved_with_every_placement_equal_one_process(runs):
    pp2, single, _ = runs
    ref = single["pp1"]
    assert len(ref["rows"]) == STEPS and ref["rows"][-1]["loss"] < ref["rows"][0]["loss"]
    local = single["pp1-interleaved"]
    assert local["stages"] == [0, 1] and ref["stages"] == [0]
    assert _col(local["rows"], "loss") == pytest.approx(_col(ref["rows"], "loss"), rel=1e-10, abs=1e-10)
    _close(local["grads"], ref["grads"])
    for name, *_ in GRID:
        kind = "ScheduleGPipe" if name.startswith("gpipe") else "ScheduleInterleaved1F1B"
        assert [(r[name]["schedule"], r[name]["stages"]) for r in pp2] == [
            (kind, [0] if kind == "ScheduleGPipe" else [0, 2]),
            (kind, [1] if kind == "ScheduleGPipe" else [1, 3]),
        ]
        rows = pp2[0][name]["rows"]
        for key in ("loss", "grad_norm"):
            assert _col(rows, key) == pytest.approx(_col(ref["rows"], key), rel=1e-10, abs=1e-10), (name, key)
        _close(_merged([r[name] for r in pp2], "grads"), ref["grads"])


def test_planned_placement_and_explicit_or_auto_splits_equal_one_process(runs):
    pp2, single, _ = runs
    ref = single["pp1"]
    # auto: a block (attention over a 96-token document) outweighs this tiny model's LM head: [2, 2]
    held = {"1f1b-planned-3-1": [[0, 1, 2], [3]], "interleaved-planned-explicit": [[0, 2], [1, 3]]}
    held["1f1b-auto"] = [[0, 1], [2, 3]]
    for name, *_ in SPLITS:
        assert [r[name]["layers"] for r in pp2] == held[name], name
        rows = pp2[0][name]["rows"]
        for key in ("loss", "grad_norm"):
            assert _col(rows, key) == pytest.approx(_col(ref["rows"], key), rel=1e-10, abs=1e-10), (name, key)
        _close(_merged([r[name] for r in pp2], "grads"), ref["grads"])


def test_checkpoint_saved_under_1f1b_resumes_under_interleaved_exactly(runs):
    pp2, single, _ = runs
    saved = _merged([r["1f1b"] for r in pp2], "state")
    for rank in pp2:
        restored = rank["resumed"]["state"]
        assert restored and set(restored) <= set(saved)
        for n, t in restored.items():
            assert torch.equal(t, saved[n]), n
    rows, ref = pp2[0]["resumed"]["rows"], single["pp1"]["rows"]
    assert _col(rows, "step") == list(range(STEPS))
    assert _col(rows, "loss") == pytest.approx(_col(ref, "loss"), rel=1e-10, abs=1e-10)
    _close(_merged([r["resumed"] for r in pp2], "grads"), single["pp1"]["grads"])


def test_recompute_and_offload_are_bit_identical_and_measured(runs):
    pp2, _, root = runs
    base = "interleaved-uniform_on_demand"
    for name, *_ in MEMORY:
        for key in ("loss", "grad_norm"):
            assert _col(pp2[0][name]["rows"], key) == _col(pp2[0][base]["rows"], key), (name, key)
        for rank in pp2:
            assert rank[name]["grads"].keys() == rank[base]["grads"].keys()
            for n, g in rank[base]["grads"].items():
                assert torch.equal(rank[name]["grads"][n], g), (name, n)
    step0 = {name: pp2[0][name]["rows"][0] for name in pp2[0]}
    kept = {n: r["peak_activation_bytes_per_rank"] for n, r in step0.items()}
    offloaded = {n: r["peak_offloaded_bytes_per_rank"] for n, r in step0.items()}
    for i in range(2):
        assert kept["recompute"][i] < kept[base][i] / 2, kept
        assert kept["selective-offload"][i] < kept[base][i] / 2, kept
        assert offloaded["selective-offload"][i] > 0 == offloaded["recompute"][i] == offloaded[base][i]
    # GPipe keeps both microbatches' activations on the last stage, 1F1B one at a time (step 0: same data)
    assert kept["gpipe-uniform_on_demand"][1] > 1.5 * kept["1f1b"][1], kept
    summary = json.loads((root / "pp2" / "gpipe-isolated" / "summary.json").read_text())
    rows = pp2[0]["gpipe-isolated"]["rows"]
    assert summary["peak_activation_bytes_per_rank"] == [
        max(r["peak_activation_bytes_per_rank"][i] for r in rows) for i in range(2)
    ]


def test_bf16_trains_with_fp32_master_weights_and_bf16_on_the_wire(runs):
    pp2, _, _ = runs
    fp32, bf16 = _col(pp2[0]["float32"]["rows"], "loss"), _col(pp2[0]["bfloat16"]["rows"], "loss")
    assert len(bf16) == 4 and bf16[-1] < bf16[0]
    assert bf16 == pytest.approx(fp32, rel=0.02) and bf16 != fp32
    for rank in pp2:
        assert rank["float32"]["sent"] == {torch.float32} and rank["float32"]["wire"] == torch.float32
        b = rank["bfloat16"]
        assert {t.dtype for t in b["state"].values() if t.is_floating_point()} == {torch.float32}
        assert {g.dtype for g in b["grads"].values()} == b["moments"] == {torch.float32}
        assert b["sent"] == {torch.bfloat16} and b["wire"] == torch.bfloat16
    # autocast really ran the blocks in bf16: what they save for backward shrinks on both ranks
    peak = {d: pp2[0][d]["rows"][-1]["peak_activation_bytes_per_rank"] for d in ("float32", "bfloat16")}
    assert all(b < 0.9 * f for b, f in zip(peak["bfloat16"], peak["float32"])), peak


def test_schedule_validation_names_the_fields(cfg):
    def bad(nproc=2, llm=None, **changes):
        c = cfg
        if llm:
            c = dataclasses.replace(
                c, model=dataclasses.replace(c.model, llm=dataclasses.replace(c.model.llm, **llm))
            )
        sections: dict[str, dict] = {}
        for path, value in changes.items():
            section, key = path.split("__")
            sections.setdefault(section, {})[key] = value
        for section, kw in sections.items():
            c = dataclasses.replace(c, **{section: dataclasses.replace(getattr(c, section), **kw)})
        with pytest.raises(ConfigError) as exc:
            validate(c, nproc)
        return str(exc.value)

    validate(_variant(cfg, INTER, {}), 2)
    assert bad(parallel__virtual_stages=2).startswith("parallel.virtual_stages: 2 stages per rank need")
    assert bad(parallel__virtual_stages=0, parallel__schedule="gpipe").startswith("parallel.virtual_stages")
    msg = bad(parallel__schedule="interleaved", parallel__virtual_stages=3)
    assert msg.startswith("model.llm.n_layers: 4 layers cannot fill parallel.pp * parallel.virtual_stages")
    msg = bad(parallel__schedule="interleaved", parallel__virtual_stages=2, data__microbatches=5)
    assert msg.startswith("data.microbatches: 5 microbatches") and "parallel.pp = 2" in msg
    msg = bad(
        1, {"tie_embeddings": True}, parallel__pp=1, parallel__schedule="gpipe", parallel__virtual_stages=2
    )
    assert msg.startswith("model.llm.tie_embeddings: needs one LLM stage")
    assert bad(train__recompute_modules=["attn"]).startswith("train.recompute_modules: 'attn'")
    assert bad(train__offload=["vision"]).startswith("train.offload: 'vision'")
    assert bad(train__offload=["llm"], train__recompute=["llm"]).startswith("train.offload: 'llm' is also")
    validate(_variant(cfg, {}, {"offload": ["llm"], "recompute": ["llm"], "recompute_modules": ["mlp"]}), 2)
    msg = bad(parallel__stage_layers=[1, 1, 2])
    assert (
        msg.startswith("parallel.stage_layers: 3 entries") and "parallel.pp * parallel.virtual_stages" in msg
    )
    msg = bad(
        parallel__stage_layers=[1, 1], **{"parallel__schedule": "interleaved", "parallel__virtual_stages": 2}
    )
    assert msg.startswith("parallel.stage_layers: 2 entries") and "= 2 * 2 = 4" in msg
    assert bad(parallel__stage_layers=[4, 0]).startswith("parallel.stage_layers[1]: stage 1 must hold >= 1")
    assert bad(parallel__stage_layers=[2, 3]).startswith("parallel.stage_layers: [2, 3] sum to 5")
    assert bad(parallel__stage_layers="even").startswith("parallel.stage_layers: 'even' is not 'auto'")
    raw = cfg.to_dict()
    raw["parallel"]["stage_layers"] = "auto"
    assert config_from_dict(raw).parallel.stage_layers == "auto"
    raw["parallel"]["stage_layers"] = [3, 1]
    assert config_from_dict(raw).parallel.stage_layers == [3, 1]
    for text, want in (("auto", "auto"), ("[2, 1]", [2, 1]), ("none", None)):  # --parallel.stage_layers
        assert load_config("omni-heavy", [("parallel.stage_layers", text)]).parallel.stage_layers == want
    raw = cfg.to_dict()
    raw["parallel"]["schedule"] = "zb"
    with pytest.raises(ConfigError, match=r"^parallel\.schedule: 'zb' is not one of"):
        config_from_dict(raw)

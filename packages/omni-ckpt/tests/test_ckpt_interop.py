"""Interop and API surface: exports read back with safetensors.safe_open / torch.load, the CLI, rank files
are valid safetensors, optimizer state round-trips into a fresh optimizer, and the README example runs."""

import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from omni_ckpt import (
    CheckpointError,
    CheckpointManager,
    FlatShard,
    export,
    import_dcp,
    load,
    load_optimizer_state_dict,
    optimizer_state_dict,
    read_full,
    save,
    save_ranks,
)
from omni_ckpt.cli import main

README = Path(__file__).resolve().parents[1] / "README.md"


def _bits(t):
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def test_readme_example_runs():
    src = re.search(r"```python\n(.*?)```", README.read_text(), re.S).group(1)
    exec(compile(src, str(README), "exec"), {})


def _sharded_checkpoint(url):
    full = {
        "w": torch.randn(6, 700),
        "h": torch.arange(10, dtype=torch.int32),
        "bf": torch.randn(3, 3).bfloat16(),
    }
    states = []
    for r, (lo, hi) in enumerate([(0, 1000), (1000, 4200)]):
        states.append({
            "w": FlatShard(full["w"].reshape(-1)[lo:hi].clone(), (6, 700), lo),
            "h": full["h"], "bf": full["bf"], "meta": {"rank": r, "name": "run"},
        })  # fmt: skip
    save_ranks(states, url)
    return full


def test_exports_and_rank_files_load_with_safetensors_and_torch(tmp_path, capsys):
    url = str(tmp_path / "ckpt")
    full = _sharded_checkpoint(url)
    for f in sorted((tmp_path / "ckpt").glob("rank-*.safetensors")):
        with safe_open(str(f), "pt") as st:
            keys = set(st.keys())
            assert "__objects__" in keys and st.metadata()["format"] == "omni-ckpt"
    with safe_open(str(tmp_path / "ckpt" / "rank-00001.safetensors"), "pt") as st:
        assert torch.equal(st.get_tensor("w@2,0"), full["w"][2:6])  # a ZeRO body block, by its offsets
    result = export(url, str(tmp_path / "out.safetensors"), "safetensors")
    assert result.tensors == 3 and result.skipped_objects == [
        "meta.name",
        "meta.rank@rank0",
        "meta.rank@rank1",
    ]
    with safe_open(str(tmp_path / "out.safetensors"), "pt") as st:
        assert set(st.keys()) == set(full)
        for k, v in full.items():
            got = st.get_tensor(k)
            assert got.dtype == v.dtype and torch.equal(got, v)
    assert main(["export", "--format", "torch", url, str(tmp_path / "out.pt")]) == 0
    assert "exported 3 tensors" in capsys.readouterr().out
    obj = torch.load(tmp_path / "out.pt", weights_only=True)
    assert all(torch.equal(obj["tensors"][k], v) for k, v in full.items())
    assert obj["objects"] == {"meta.name": "run", "meta.rank@rank0": 0, "meta.rank@rank1": 1}


OPTIMIZERS = {
    "adamw_decay": lambda params, **kw: torch.optim.AdamW(params, **{"weight_decay": 0.1, **kw}),
    "adam_amsgrad_l2": lambda params, **kw: torch.optim.Adam(
        params, **{"amsgrad": True, "weight_decay": 0.01, **kw}
    ),
}


def _mlp(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))


def _train(model, opt, x):
    model(x).square().sum().backward()
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_optimizer_state_round_trips_into_a_fresh_optimizer(tmp_path, kind):
    make = OPTIMIZERS[kind]
    model = _mlp(0)
    opt = make(model.parameters(), lr=1e-2, betas=(0.8, 0.95))
    for _ in range(3):
        _train(model, opt, torch.randn(5, 4))
    save({"model": model.state_dict(), "optim": optimizer_state_dict(model, opt)}, str(tmp_path / "c"))

    fresh = _mlp(1)
    fresh_opt = make(fresh.parameters(), lr=0.5)
    before = [p.detach().clone() for p in fresh.parameters()]
    target = {"model": fresh.state_dict(), "optim": optimizer_state_dict(fresh, fresh_opt)}
    # Building the load target changes no parameter bit (-0.0 included) and leaves the optimizer fresh.
    assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(before, fresh.parameters()))
    assert len(fresh_opt.state) == 0
    load(target, str(tmp_path / "c"))
    load_optimizer_state_dict(fresh, fresh_opt, target["optim"])
    group = fresh_opt.param_groups[0]
    assert group["lr"] == 1e-2 and tuple(group["betas"]) == (0.8, 0.95) and group["weight_decay"] > 0
    ref, got = opt.state_dict(), fresh_opt.state_dict()
    assert set(got["state"]) == set(ref["state"])
    for i, s in ref["state"].items():
        assert set(got["state"][i]) == set(s)
        for k, v in s.items():
            assert torch.equal(got["state"][i][k], v), (i, k)  # moments and step (3) alike
    x = torch.randn(5, 4)
    for m, o in ((model, opt), (fresh, fresh_opt)):
        _train(m, o, x)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters()))


def test_building_a_load_target_does_not_change_how_a_fresh_optimizer_trains():
    # No checkpoint to resume from: an optimizer whose state dict was taken must train exactly like an
    # untouched one (Adam's step count starts at 0, moments at nothing), for every kind above.
    for make in OPTIMIZERS.values():
        runs = []
        for take_state_dict in (False, True):
            model = _mlp(0)
            with torch.no_grad():
                model[0].weight[0, 0] = -0.0
            opt = make(model.parameters(), lr=1e-2)
            if take_state_dict:
                optimizer_state_dict(model, opt)
            torch.manual_seed(2)
            for _ in range(2):
                _train(model, opt, torch.randn(5, 4))
            runs.append(([p.detach().clone() for p in model.parameters()], opt.state_dict()["state"]))
        (p0, s0), (p1, s1) = runs
        assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(p0, p1))
        assert all(torch.equal(s0[i]["step"], s1[i]["step"]) for i in s0) and s1[0]["step"].item() == 2


def test_bad_inputs_name_what_is_wrong(tmp_path):
    url = str(tmp_path / "c")
    save({"w": torch.arange(6.0).reshape(2, 3), "meta": {"epoch": 1}}, url)
    with pytest.raises(TypeError, match=r"state must be a dict.*got list"):
        load([torch.zeros(2, 3)], url)
    with pytest.raises(ValueError, match=r"tensor 'w': checkpoint shape \(2, 3\), state dict shape \(3, 2\)"):
        load({"w": torch.zeros(3, 2)}, url)
    with pytest.raises(CheckpointError, match=r"object 'meta\.step' is not in the checkpoint"):
        load({"meta": {"step": 0}}, url)
    with pytest.raises(ValueError, match="no rank states"):
        save_ranks([], str(tmp_path / "none"))
    with pytest.raises(ValueError, match="step must be an int >= 0, got -1"):
        CheckpointManager(str(tmp_path / "m"), async_save=False).save(-1, {"w": torch.zeros(1)})
    (tmp_path / "c" / "manifest.msgpack").write_bytes(b"\xc1")
    with pytest.raises(CheckpointError, match=r"manifest.msgpack: not an omni-ckpt manifest"):
        load({"w": torch.zeros(2, 3)}, url)


def _dcp_state():
    return {
        "model": {
            "w": torch.randn(5, 6),
            "h": torch.arange(7, dtype=torch.int32),
            "bf": torch.randn(3).bfloat16(),
        },
        "extra": {"epoch": 3, "names": ["a", "b"]},
    }


def test_import_dcp_is_bit_exact_against_dcp_load(tmp_path):
    import torch.distributed.checkpoint as dcp

    state = _dcp_state()
    dcp.save(state, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    assert import_dcp(str(tmp_path / "dcp"), str(tmp_path / "omni")) == 3
    oracle = {
        "model": {k: torch.zeros_like(v) for k, v in state["model"].items()},
        "extra": {"epoch": 0, "names": []},
    }
    dcp.load(oracle, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    tensors, objects = read_full(str(tmp_path / "omni"))
    for k, v in oracle["model"].items():
        assert tensors[f"model.{k}"].dtype == v.dtype and torch.equal(_bits(tensors[f"model.{k}"]), _bits(v))
    assert (
        objects
        == {"extra.epoch": 3, "extra.names": ["a", "b"]}
        == {f"extra.{k}": v for k, v in oracle["extra"].items()}
    )


class _RunsCode:
    """Pickles as a call of ``fn(arg)``: what a crafted checkpoint uses to run code on load."""

    def __init__(self, fn, arg):
        self.fn, self.arg = fn, arg

    def __reduce__(self):
        return self.fn, (self.arg,)


@pytest.mark.parametrize("how", ["exec", "os.system", "nested"])
def test_crafted_dcp_metadata_that_would_run_code_is_refused(tmp_path, how):
    import builtins
    import os
    import pickle

    import torch.distributed.checkpoint as dcp

    dcp.save(_dcp_state(), checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    marker = tmp_path / "marker"
    payload = {
        "exec": _RunsCode(builtins.exec, f"open({str(marker)!r}, 'w').close()"),
        "os.system": _RunsCode(os.system, f"touch {marker}"),
        # Hidden inside real DCP metadata, as one more planner_data value.
        "nested": None,
    }[how]
    if how == "nested":
        with open(tmp_path / "dcp" / ".metadata", "rb") as f:
            md = pickle.load(f)  # the test's own trusted file
        md.planner_data["evil"] = _RunsCode(builtins.exec, f"open({str(marker)!r}, 'w').close()")
        payload = md
    (tmp_path / "dcp" / ".metadata").write_bytes(pickle.dumps(payload))
    with pytest.raises(
        CheckpointError, match=r"\.metadata: refused .*(exec|system).* is not a DCP metadata type"
    ):
        import_dcp(str(tmp_path / "dcp"), str(tmp_path / "omni"))
    assert not marker.exists()
    assert not (tmp_path / "omni").exists()


def test_crafted_dcp_data_entry_is_refused(tmp_path):
    import builtins
    import io
    import pickle

    import torch.distributed.checkpoint as dcp

    dcp.save(_dcp_state(), checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    marker = tmp_path / "marker"
    with open(tmp_path / "dcp" / ".metadata", "rb") as f:
        md = pickle.load(f)
    blob = io.BytesIO()
    torch.save(_RunsCode(builtins.exec, f"open({str(marker)!r}, 'w').close()"), blob)
    (tmp_path / "dcp" / "evil.distcp").write_bytes(blob.getvalue())
    index = next(i for i in md.storage_data if i.fqn == "extra.epoch")
    info = md.storage_data[index]
    md.storage_data[index] = type(info)(relative_path="evil.distcp", offset=0, length=len(blob.getvalue()))
    (tmp_path / "dcp" / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(
        CheckpointError, match=r"evil\.distcp: entry 'extra\.epoch': not loadable with weights_only=True"
    ):
        import_dcp(str(tmp_path / "dcp"), str(tmp_path / "omni"))
    assert not marker.exists()
    # A storage path leaving the checkpoint directory is refused too.
    md.storage_data[index] = type(info)(relative_path="../outside.distcp", offset=0, length=1)
    (tmp_path / "dcp" / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(CheckpointError, match=r"entry 'extra\.epoch' points outside the checkpoint"):
        import_dcp(str(tmp_path / "dcp"), str(tmp_path / "omni"))

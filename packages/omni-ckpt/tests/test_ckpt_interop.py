"""Interop and API surface: exports read back with safetensors.safe_open / torch.load, the CLI, rank files
are valid safetensors, optimizer state round-trips into a fresh optimizer, and the README example runs."""

import re
from pathlib import Path

import torch
from safetensors import safe_open

from omni_ckpt import (
    FlatShard,
    export,
    load,
    load_optimizer_state_dict,
    optimizer_state_dict,
    save,
    save_ranks,
)
from omni_ckpt.cli import main

README = Path(__file__).resolve().parents[1] / "README.md"


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


def test_optimizer_state_round_trips_into_a_fresh_optimizer(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.8, 0.95), weight_decay=0.1)
    for _ in range(3):
        model(torch.randn(5, 4)).square().sum().backward()
        opt.step()
        opt.zero_grad()
    save({"model": model.state_dict(), "optim": optimizer_state_dict(model, opt)}, str(tmp_path / "c"))

    fresh = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.5)
    before = [p.detach().clone() for p in fresh.parameters()]
    target = {"model": fresh.state_dict(), "optim": optimizer_state_dict(fresh, fresh_opt)}
    assert all(torch.equal(a, b) for a, b in zip(before, fresh.parameters()))  # init changed no parameter
    load(target, str(tmp_path / "c"))
    load_optimizer_state_dict(fresh, fresh_opt, target["optim"])
    assert fresh_opt.param_groups[0]["lr"] == 1e-2 and tuple(fresh_opt.param_groups[0]["betas"]) == (
        0.8,
        0.95,
    )
    ref, got = opt.state_dict(), fresh_opt.state_dict()
    for i, s in ref["state"].items():
        for k, v in s.items():
            assert torch.equal(got["state"][i][k], v), (i, k)
    x = torch.randn(5, 4)
    for m, o in ((model, opt), (fresh, fresh_opt)):
        m(x).square().sum().backward()
        o.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters()))

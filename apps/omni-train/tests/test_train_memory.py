"""``omni-train memory`` (issue 27 item 5) against bytes measured in real runs.

One 4-process gloo world trains each layout for one step and logs, per rank, the bytes its LLM stages and
encoders hold (``metrics.jsonl``: ``llm_state_bytes_per_rank``, ``encoder_state_bytes_per_rank``, measured
from the tensors' storages by ``omni_parallel.memory.state_bytes``). The plan of the same layout, built on
the meta device over torch's fake process group (``omni_train.memory_plan``), must EQUAL them byte for
byte for parameters, gathered copies, gradients and optimizer state, at every rank it plans; its LLM
activation estimate is compared with the measured peak of saved activations (an estimate: the ratio is
printed and held within a loose band). The paper-scale plan (512 ranks) must run and report, and bad
inputs fail in one line.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from train_fixtures import make_dataset, write_config
from train_reference import with_parallel

from omni_parallel.memory import KINDS
from omni_parallel.testing import run_world
from omni_train.binder import load_config
from omni_train.cli import main
from omni_train.memory_plan import memory_plan

pytestmark = pytest.mark.slow

LAYOUTS = {
    "pp1-tp2-dp2": {"pp": 1, "tp": 2, "dp": 2},
    "pp2-dp2-enczero2": {"pp": 2, "dp": 2, "encoder_zero": 2},
    "pp2-dp2-llmzero1": {"pp": 2, "dp": 2, "llm_zero": 1},
    "pp2-dp2-llmzero2": {"pp": 2, "dp": 2, "llm_zero": 2, "encoder_zero": 2},
    "pp2-dp2-llmzero3": {"pp": 2, "dp": 2, "llm_zero": 3, "encoder_zero": 3},
}
TP_SHARDED = ("attn.wq.", "attn.wk.", "attn.wv.", "attn.wo.", "mlp.w1.", "mlp.w2.", "mlp.w3.")


def _train(rank, world_size, cfg, root):
    from omni_train.trainer import Trainer

    rows = {}
    for name, par in LAYOUTS.items():
        out = Path(root) / name
        Trainer(with_parallel(cfg, **par), out, resume=False).run()
        if rank == 0:
            rows[name] = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    return rows


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("memory")
    data = make_dataset(tmp / "data")
    cfg = load_config(str(write_config(tmp / "c.toml", data, steps=1, every=0)))
    return cfg, run_world(_train, 4, args=(cfg, str(tmp / "runs")), timeout_s=600)[0]


def test_plan_equals_measured_bytes(measured):
    cfg, rows = measured
    for name, par in LAYOUTS.items():
        plan = memory_plan(with_parallel(cfg, **par), 4)
        row = rows[name]
        for r in plan["ranks"]:
            for owner, key in (
                ("llm", "llm_state_bytes_per_rank"),
                ("encoders", "encoder_state_bytes_per_rank"),
            ):
                got = {k: row[key][k][r["rank"]] for k in KINDS}
                assert r[owner] == got, f"{name} rank {r['rank']} {owner}: planned {r[owner]}, measured {got}"
            act = row["peak_activation_bytes_per_rank"][r["rank"]]
            ratio = r["llm_activations_estimate"] / act
            print(f"{name} rank {r['rank']}: activation estimate / measured = {ratio:.2f}")
            # the measured peak adds the encoders' activations, the embedding / loss and the pipeline's
            # buffers to the LLM blocks' (which the estimate counts exactly: test below)
            assert 0.5 < ratio < 0.85, (name, r["rank"], r["llm_activations_estimate"], act)
    # FSDP2's gathered copies (ZeRO-1/2) are the whole padded stage on every rank: W x its padded shards,
    # the stage modules' root units (embedding, final norm, LM head) included
    for name in ("pp2-dp2-llmzero1", "pp2-dp2-llmzero2"):
        b = rows[name]["llm_state_bytes_per_rank"]
        assert all(b["gathered"][r] == 2 * b["parameters"][r] > 0 for r in range(4)), (name, b)
    _assert_analytic(cfg, rows)
    # the layouts did what they are for (measured)
    z0, z3 = rows["pp2-dp2-enczero2"]["llm_state_bytes"], rows["pp2-dp2-llmzero3"]["llm_state_bytes"]
    assert (
        abs(z3["optimizer"] / z0["optimizer"] - 0.5) < 0.01
        and abs(z3["parameters"] / z0["parameters"] - 0.5) < 0.01
    )


def _stage_counts(cfg, par, vocab):
    """``{pp rank: (TP-sharded parameters, TP-replicated parameters, tensors)}`` of the layout's LLM
    stages, counted from the stage modules (built on meta)."""
    import torch

    from omni_train.models.llm import LLMStage
    from omni_train.pipeline import stage_split

    llm = cfg.model.llm_config(vocab)
    split = stage_split(par, llm, cfg.data.max_seq_len)
    out = {}
    for s in range(par.pp):
        with torch.device("meta"):
            stage = LLMStage(llm, s, par.pp, layers=split[s])
        named = list(stage.named_parameters())
        sharded = sum(p.numel() for n, p in named if any(k in n for k in TP_SHARDED))
        out[s] = (sharded, sum(p.numel() for _, p in named) - sharded, len(named))
    return out


def _assert_analytic(cfg, rows):
    """The analytic formula (``omni_parallel.memory.analytic_state_bytes``) against the measured LLM bytes:
    every kind on every rank of every layout (llm_zero 0-3, tp 1 and 2), within FSDP2's padding."""
    from omni_parallel.memory import analytic_state_bytes
    from omni_train.data_files import load_tokenizer

    vocab = load_tokenizer(cfg.data).get_vocab_size()
    for name, par in LAYOUTS.items():
        p = with_parallel(cfg, **par).parallel
        counts = _stage_counts(cfg, p, vocab)
        for rank in range(4):
            sharded, replicated, tensors = counts[rank // (4 // p.pp)]
            want = analytic_state_bytes(
                sharded, replicated=replicated, tp=p.tp, zero=p.llm_zero, shards=p.dp, tensors=tensors
            )
            got = {k: rows[name]["llm_state_bytes_per_rank"][k][rank] for k in KINDS}
            for k in KINDS:
                assert got[k] == pytest.approx(want[k], rel=0.01), (name, rank, k, got, want)


def test_analytic_gathered_follows_the_bf16_param_dtype(tmp_path):
    """At ``train.dtype = "bfloat16"`` FSDP2 gathers in the ``MixedPrecisionPolicy``'s bf16: ZeRO-1/2's kept
    gathered copy of the trainer's build (``omni-train memory``, equal byte for byte to the measured bytes:
    the test above at float32; ``omni_parallel``'s ``test_parallel_llm_zero`` measures bf16 on gloo) is half
    the float32 one, and the analytic formula with ``gathered_bytes_per = 2`` gives it (within padding)."""
    from omni_parallel.memory import analytic_state_bytes
    from omni_train.data_files import load_tokenizer

    data = make_dataset(tmp_path / "data")
    cfg = load_config(
        str(write_config(tmp_path / "c.toml", data, steps=1, every=0, extra='dtype = "bfloat16"'))
    )
    vocab = load_tokenizer(cfg.data).get_vocab_size()
    for zero in (1, 2):
        par = {"pp": 2, "dp": 2, "llm_zero": zero}
        counts = _stage_counts(cfg, with_parallel(cfg, **par).parallel, vocab)
        for r in memory_plan(with_parallel(cfg, **par), 4)["ranks"]:
            sharded, replicated, tensors = counts[r["pp_rank"]]
            args = dict(replicated=replicated, zero=zero, shards=2, tensors=tensors)
            want = analytic_state_bytes(sharded, gathered_bytes_per=2, **args)
            assert r["llm"]["gathered"] == pytest.approx(want["gathered"], rel=0.01), (zero, r, want)
            assert want["gathered"] == analytic_state_bytes(sharded, **args)["gathered"] / 2


def test_block_estimate_equals_saved_bytes():
    """``block_activation_bytes`` equals the bytes autograd saves in the app's decoder block, at tp 1, 2
    and 4 with and without Megatron SP (plain and async TP), float32 and bf16 autocast over float32, with
    selective recompute:
    measured on torch's fake process group (TP as ``omni_train.parallelize`` applies it)."""
    import torch

    from omni_parallel import ParallelConfig, ParallelState
    from omni_parallel.memory import block_activation_bytes, saved_activation_bytes
    from omni_parallel.parallelize import apply_ac, apply_tp
    from omni_parallel.tensor_parallel import llama_tp_plan
    from omni_parallel.testing import fake_world
    from omni_train.models.attention import rope_angles
    from omni_train.models.llm import Block, LLMConfig
    from omni_train.parallelize import BRANCHES

    tokens, cfg = 48, LLMConfig(vocab_size=8, dim=64, n_heads=8, n_kv_heads=4, ffn_dim=96)
    rope = rope_angles(torch.arange(tokens), cfg.head_dim, cfg.rope_theta)
    cu = torch.tensor([0, 20, tokens])
    cases = [(tp, sp, dt, ()) for tp in (1, 2, 4) for sp in (False, True) if tp > 1 or not sp
             for dt in (torch.float32, torch.bfloat16)]  # fmt: skip
    cases += [(2, True, torch.bfloat16, ("attention",)), (2, False, torch.float32, ("mlp",))]
    # async TP (sp = "async"): one gathered copy per region instead of one cast per projection
    cases += [(tp, "async", dt, ()) for tp in (2, 4) for dt in (torch.float32, torch.bfloat16)]
    cases += [(2, "async", torch.bfloat16, ("mlp",))]
    for tp, sp, dt, branches in cases:
        with fake_world(tp):
            ps = ParallelState.build(ParallelConfig(tp=tp))
            block = Block(cfg)
            plan = llama_tp_plan(attention="attn", mlp="mlp", attention_norm="attn_norm", mlp_norm="mlp_norm",
                                 attention_args=3, sequence_dim=0 if sp else None,
                                 async_tp=sp == "async")  # fmt: skip
            apply_tp([block], ps, plan)
            if branches:  # (no branches: apply_ac checkpoints the whole block)
                apply_ac([block], [BRANCHES[b] for b in branches])
            x = torch.randn(tokens // tp if sp else tokens, cfg.dim, requires_grad=True)

            def forward(block=block, x=x, dt=dt):
                with torch.autocast("cpu", dtype=dt, enabled=dt != torch.float32):
                    return block(x * 1.0, rope, cu)  # x * 1.0: the block input is an activation

            got, _out = saved_activation_bytes(forward, [*block.parameters(), *rope])
        want = block_activation_bytes(
            tokens, cfg.dim, cfg.n_kv_heads * cfg.head_dim, cfg.ffn_dim, heads=cfg.n_heads, tp=tp,
            sequence_parallel=bool(sp), async_tp=sp == "async", bytes_per=dt.itemsize, master_bytes=4, kernel="reference",
            recompute=bool(branches), recompute_branches=branches,
        )  # fmt: skip
        # checkpointed attention also saves its cu_seqlens argument (3 int64)
        assert want == got - (24 if "attention" in branches else 0), (tp, sp, dt, branches, want, got)


def test_table_words(capsys):
    from omni_train.memory_plan import format_plan

    kinds = dict.fromkeys(KINDS, 2**20)
    plan = {
        "gpus": 4,
        "layout": {"pp": 2, "dp": 2, "sequence_parallel": False, "llm_zero": 3},
        "ranks": [{"rank": 0, "same_pp_ranks": [0], "llm": kinds, "encoders": kinds,
                   "in_step": {"llm": {"gradients": 2**22, "gathered": 2**21}},
                   "llm_activations_estimate": 2**21}],
    }  # fmt: skip
    text = format_plan(plan)
    head, kinds_line = text.splitlines()[1:3]
    assert "sequence_parallel off" in text and "False" not in text and "True" not in text
    in_step = ["gradients", "gathered", "peak"]
    assert kinds_line.split() == ["rank", "pp", "ranks", *KINDS, *KINDS, "activations", "total", *in_step]
    assert head.split() == ["llm"] * 4 + ["encoders"] * 4 + ["llm", "in-step", "in-step", "step"]
    assert text.splitlines()[3].split() == ["0", "0", *["1.00"] * 8, "2.00", "10.00", "4.00", "2.00", "16.00"]
    # the verdict is the step peak's (16 MiB), against 80 and 141 GB, or the device given
    assert "step peak" in text and "fits in 80 GB, fits in 141 GB" in text
    assert "OOM in 0.01 GB" in format_plan(plan, 0.01)


@pytest.mark.parametrize(
    ("where", "words"), [("missing/plan.json", "is not a directory"), (".", "is a directory")]
)
def test_json_path_errors_one_line(where, words, tmp_path, capsys):
    path = tmp_path / where
    # checked before the plan is built (a paper-scale plan takes seconds to minutes)
    assert main(["memory", "--gpus", "4", "--json", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--json" in err and words in err, err
    assert str(path.parent if where != "." else path) in err, err


def test_paper_scale_runs_and_reports(tmp_path, capsys):
    start = time.perf_counter()
    args = ["memory", "--scale", "paper", "--gpus", "512", "--json", str(tmp_path / "p.json")]
    args += ["--parallel.pp", "8", "--parallel.tp", "4", "--parallel.cp", "2"]
    assert main(args) == 0
    took = time.perf_counter() - start
    plan = json.loads((tmp_path / "p.json").read_text())
    # equal stages are built once: pipeline rank 0, 1-6 and 7, each at its first and last rank
    assert plan["layout"]["dp"] == 8 and [r["rank"] for r in plan["ranks"]] == [0, 63, 64, 127, 448, 511]
    assert sorted({p for r in plan["ranks"] for p in r["same_pp_ranks"]}) == list(range(8))
    # LLaMA-12B over pp 8 x tp 4 at float32: ~0.4e9 parameters on a middle stage, ~1.5 GiB
    mid = plan["ranks"][2]["llm"]["parameters"]
    assert 1.2 * 2**30 < mid < 1.8 * 2**30, mid
    assert "largest: rank" in capsys.readouterr().out
    assert took < 60, f"{took:.1f} s"


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--gpus", "6", "--parallel.pp", "4"], "--gpus: 6 is not a multiple of parallel.pp"),
        (["--gpus", "0"], "--gpus: must be >= 1, got 0"),
        (["--gpus", "8", "--scale", "huge"], "--scale: paper or config"),
        (["--gpus", "12", "--parallel.tp", "3"], "parallel.tp"),
    ],
)
def test_bad_inputs_one_line(args, words, capsys):
    assert main(["memory", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and len(err.splitlines()) == 1, err


def test_state_bytes_measured_until_the_optimizer_stepped_then_kept():
    from omni_train.wiring import _measured_once

    calls = []
    steps = iter([{"parameters": 8, "optimizer": 0}, {"parameters": 8, "optimizer": 16}])

    def measure():
        calls.append(1)
        return next(steps)

    read = _measured_once(measure)
    assert read()["optimizer"] == 0  # before AdamW's first step: measured again next time
    assert [read() for _ in range(3)] == [{"parameters": 8, "optimizer": 16}] * 3
    assert len(calls) == 2  # the bytes do not change after: no walk over the tensors per step


def test_plan_runs_the_steps_microbatches_under_data_replicas(tmp_path):
    """With ``data.replicas`` a DP rank trains ``replicas / dp`` replicas' ``microbatches`` packs per step
    (``data_pipeline.step_config``): the plan's activations are those of that many microbatches in flight
    (GPipe: every microbatch of the step is in flight at once)."""
    import dataclasses

    data = make_dataset(tmp_path / "data")
    cfg = with_parallel(
        load_config(str(write_config(tmp_path / "c.toml", data, steps=1, every=0))), pp=2, dp=2
    )
    cfg = dataclasses.replace(
        cfg, parallel=dataclasses.replace(cfg.parallel, schedule="gpipe")
    )  # all in flight
    m = cfg.data.microbatches

    def plan(microbatches, replicas):
        d = dataclasses.replace(cfg.data, microbatches=microbatches, replicas=replicas)
        return [
            r["llm_activations_estimate"] for r in memory_plan(dataclasses.replace(cfg, data=d), 4)["ranks"]
        ]

    assert plan(m, 4) == plan(2 * m, 0) != plan(m, 0)

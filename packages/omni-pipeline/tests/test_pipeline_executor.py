"""Executor on gloo against one process running the whole model on the same microbatches (float64).

One 4-rank world checks three layouts: pp=4 (1F1B), pp=2 x dp=2 (1F1B, each replica its own data) and
pp=2 x dp=2 interleaved (2 virtual stages per rank), all under uniform_on_demand with two encoders and
microbatches of different lengths. pp=1 runs in this process. Tolerance 1e-10 on every parameter's grad.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from omni_parallel.data_parallel import all_reduce_gradients
from omni_parallel.testing import WorldError, run_world
from omni_pipeline import (
    Action,
    DataFlow,
    EncoderAnchor,
    EncoderDataConfig,
    EncoderParallelConfig,
    P2PError,
    PipelineExecutor,
    PipelineGroups,
    Schedule1F1B,
    ScheduleInterleaved1F1B,
    StepFunctions,
    StepPlan,
    stage_slices,
    uniform_on_demand,
)

H, VOCAB, D_IMG, D_AUD, LAYERS = 8, 13, 6, 5, 4


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(H, H)

    def forward(self, x, scale=1.0):
        return x + scale * torch.tanh(self.lin(x))


class Stage(nn.Module):
    """A slice of the LLM: optional embedding (stage 0, used by first_stage_input), layers, optional head."""

    def __init__(self, model: Model, layers: range, first: bool, last: bool) -> None:
        super().__init__()
        self.embed = model.embed if first else None
        self.layers = nn.ModuleList(model.layers[i] for i in layers)
        self.head = model.head if last else None

    def forward(self, x, scale=1.0):
        for layer in self.layers:
            x = layer(x, scale)
        return self.head(x) if self.head is not None else x


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, H)
        self.layers = nn.ModuleList(Layer() for _ in range(LAYERS))
        self.head = nn.Linear(H, VOCAB)
        self.encoders = nn.ModuleDict(
            {"image": nn.Sequential(nn.Linear(D_IMG, H), nn.Tanh()), "audio": nn.Linear(D_AUD, H)}
        )
        self.double()


def make_data(seed: int, num_mb: int):
    """LLM microbatches of different lengths, each consuming one image and one audio encoder microbatch
    whose outputs replace placeholder positions."""
    g = torch.Generator().manual_seed(seed)
    llm, enc, consumes = {}, {}, {}
    e = 1
    for k in range(1, num_mb + 1):
        n_img, n_aud = 1 + (k + seed) % 3, 2 + k % 2
        tokens = 3 + n_img + n_aud + (2 * k) % 5
        ids = torch.randint(0, VOCAB, (tokens,), generator=g)
        labels = torch.randint(0, VOCAB, (tokens,), generator=g)
        enc[e] = {
            "modality": "image",
            "x": torch.randn(n_img, D_IMG, generator=g, dtype=torch.float64),
            "pos": torch.arange(1, 1 + n_img),
        }
        enc[e + 1] = {
            "modality": "audio",
            "x": torch.randn(n_aud, D_AUD, generator=g, dtype=torch.float64),
            "pos": torch.arange(tokens - n_aud, tokens),
        }
        llm[k] = {"ids": ids, "labels": labels}
        consumes[k] = [e, e + 1]
        e += 2
    return llm, enc, consumes


def step_functions(model: Model, llm, enc_pos, num_mb: int) -> StepFunctions:
    def first_stage_input(k, outs):
        h = model.embed(llm[k]["ids"])
        for e, out in sorted(outs.items()):
            h = h.index_copy(0, enc_pos[e], out)
        return h

    def loss(k, logits):
        ce = nn.functional.cross_entropy(logits, llm[k]["labels"]) / num_mb
        return ce, {"tokens": float(logits.shape[0])}

    def encoder(e, inputs):
        return model.encoders[inputs["modality"]](inputs["x"])

    return StepFunctions(
        first_stage_input, loss, encoder, stage_kwargs=lambda stage, k: {"scale": 1.0 + 0.1 * (k % 3)}
    )


def reference(seeds: list[int], num_mb: int):
    """One process, whole model, same microbatches: loss per replica and grads averaged over replicas."""
    model = Model()
    losses = []
    for seed in seeds:
        llm, enc, consumes = make_data(seed, num_mb)
        total = torch.zeros((), dtype=torch.float64)
        per = {}
        for k in range(1, num_mb + 1):
            h = model.embed(llm[k]["ids"])
            for e in consumes[k]:
                h = h.index_copy(0, enc[e]["pos"], model.encoders[enc[e]["modality"]](enc[e]["x"]))
            for layer in model.layers:
                h = layer(h, 1.0 + 0.1 * (k % 3))
            lk = nn.functional.cross_entropy(model.head(h), llm[k]["labels"]) / num_mb
            per[k] = float(lk.detach())
            total = total + lk
        (total / len(seeds)).backward()
        losses.append(per)
    return losses, {n: p.grad.clone() for n, p in model.named_parameters()}


def run_layout(pp_rank: int, pp: int, virtual: int, seed: int, num_mb: int, groups: PipelineGroups):
    """One pipeline rank's step. This test's ``loss_fn`` is normalised per replica (``reference`` averages
    the replicas' losses), so its reduction hook divides the objective's plain sums by the replica count;
    with one replica it is the executor's default hook."""
    model = Model()
    llm, enc, consumes = make_data(seed, num_mb)
    if virtual == 1:
        schedule = Schedule1F1B(pp, num_mb)
    else:
        schedule = ScheduleInterleaved1F1B(pp, num_mb, virtual)
    flow = uniform_on_demand(schedule, consumes)
    flow.validate(schedule)
    slices = stage_slices(LAYERS, schedule.num_stages)
    stages = {
        s: Stage(model, slices[s], s == 0, s == schedule.num_stages - 1)
        for s in schedule.rank_stages(pp_rank)
    }
    # parameters no microbatch reaches: must end the step with zero .grad in every layout; frozen: None
    unused = {}
    for s, stage in stages.items():
        stage.unused = nn.Linear(2, 2).double()
        stage.frozen = nn.Parameter(torch.ones(2, dtype=torch.float64), requires_grad=False)
        unused.update({f"stage{s}.unused.{n}": p for n, p in stage.unused.named_parameters()})
    idle = nn.Linear(3, H).double()  # an encoder no encoder microbatch uses
    unused.update({f"idle.{n}": p for n, p in idle.named_parameters()})
    anchor = EncoderAnchor({**model.encoders, "idle": idle}, data=EncoderDataConfig(max_seq_len=64))
    replicas = 1 if groups.llm_dp is None else dist.get_world_size(groups.llm_dp)

    def per_replica_mean() -> None:
        all_reduce_gradients(
            [p for s in stages.values() for p in s.parameters()], groups.llm_dp, divide_by=replicas
        )
        all_reduce_gradients(anchor.parameters(), groups.encoder_dp, divide_by=replicas)

    executor = PipelineExecutor(
        stages,
        anchor,
        step_functions(model, llm, {e: v["pos"] for e, v in enc.items()}, num_mb),
        groups,
        reduce_gradients=per_replica_mean if replicas > 1 else None,
    )
    plan = StepPlan(
        schedule,
        flow,
        llm_shapes={k: (len(v["ids"]), H) for k, v in llm.items()},
        encoder_shapes={e: (len(v["pos"]), H) for e, v in enc.items()},
        dtype=torch.float64,
    )
    mine = {e: enc[e] for e in flow.encoders_on(pp_rank)}
    result = executor.step(plan, mine, gather_timelines=True)
    held = {id(p) for m in stages.values() for p in m.parameters()} | {
        id(p) for p in model.encoders.parameters()
    }
    # numpy arrays pickle by value (tensors would go through shared-memory handles the child outlives)
    missing = [n for n, p in model.named_parameters() if id(p) in held and p.grad is None]
    missing += [n for n, p in unused.items() if p.grad is None]
    grads = {
        n: p.grad.numpy().copy() for n, p in model.named_parameters() if id(p) in held and p.grad is not None
    }
    no_grad = {
        "missing": missing,  # trainable parameters left without .grad (must be none)
        "unused_max": max(float(p.grad.abs().max()) for p in unused.values() if p.grad is not None),
        "frozen_grads": [s for s, m in stages.items() if m.frozen.grad is not None],
    }
    return result.losses, grads, {r: len(t) for r, t in result.timelines.items()}, result.metrics, no_grad


def _check_no_grad(no_grad) -> None:
    """Every trainable parameter has a .grad; unreached ones hold exact zeros; frozen ones stay None."""
    assert no_grad["missing"] == [], f"trainable parameters without .grad: {no_grad['missing']}"
    assert no_grad["unused_max"] == 0.0, f"unreached parameters got gradient {no_grad['unused_max']}"
    assert no_grad["frozen_grads"] == [], f"frozen parameters got .grad on stages {no_grad['frozen_grads']}"


def _world(rank: int, world_size: int):
    everyone = dist.new_group(list(range(4)))
    out = {}
    # pp=4, one replica
    pp4 = dist.new_group([0, 1, 2, 3])
    out["pp4"] = run_layout(rank, 4, 1, 1, 6, PipelineGroups(pp=pp4, encoder_dp=everyone, llm_dp=None))
    # pp=2 x dp=2: pipelines [0, 1] and [2, 3]; LLM DP groups [0, 2] and [1, 3]
    pps = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dps = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    replica, pp_rank = divmod(rank, 2)
    enc_p2p = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    for name, virtual in (("pp2", 1), ("pp2v2", 2)):
        groups = PipelineGroups(
            pp=pps[replica], encoder_dp=everyone, llm_dp=dps[pp_rank], encoder_p2p=enc_p2p[replica]
        )
        out[name] = run_layout(pp_rank, 2, virtual, 2 + replica, 4, groups)
    return out


def _check(grads_by_rank, ref_grads):
    seen = {}
    for grads in grads_by_rank:
        for n, g in grads.items():
            assert (torch.from_numpy(g) - ref_grads[n]).abs().max().item() <= 1e-10, (
                f"gradient of {n} differs"
            )
            seen[n] = True
    assert set(seen) == set(ref_grads), f"parameters without gradient: {set(ref_grads) - set(seen)}"


def test_executor_matches_single_process_on_gloo():
    results = run_world(_world, 4, timeout_s=180)
    # pp=4
    ref_losses, ref_grads = reference([1], 6)
    for r in range(4):
        losses, _, lens, metrics, no_grad = results[r]["pp4"]
        _check_no_grad(no_grad)  # pp=4 has no llm_dp group: stage grads are filled without a reduction
        assert losses.keys() == ref_losses[0].keys()
        assert all(abs(losses[k] - ref_losses[0][k]) <= 1e-10 for k in losses)
        assert set(lens) == {0, 1, 2, 3}
        assert metrics[1]["tokens"] > 0
    _check([results[r]["pp4"][1] for r in range(4)], ref_grads)
    # pp=2 x dp=2 (1F1B and interleaved): grads averaged over the two replicas' data
    ref_losses, ref_grads = reference([2, 3], 4)
    for name in ("pp2", "pp2v2"):
        for r in range(4):
            losses = results[r][name][0]
            _check_no_grad(results[r][name][4])
            assert all(abs(losses[k] - ref_losses[r // 2][k]) <= 1e-10 for k in losses), (name, r)
        _check([results[r][name][1] for r in range(4)], ref_grads)


def test_executor_pp1_in_one_process():
    model_ref_losses, ref_grads = reference([5], 3)
    losses, grads, lens, _, no_grad = run_layout(0, 1, 1, 5, 3, PipelineGroups())
    assert all(abs(losses[k] - model_ref_losses[0][k]) <= 1e-10 for k in losses)
    _check([grads], ref_grads)
    _check_no_grad(no_grad)  # pp=1, no groups at all: same rule as with groups
    assert lens == {0: 3 * 2 + 2 * 6}  # 3 F, 3 B, 6 encoder forwards and 6 backwards


def test_stage_slices_split_layers_evenly_or_refuse():
    assert [list(r) for r in stage_slices(5, 3)] == [[0, 1], [2, 3], [4]]
    for layers, stages in ((4, 0), (2, 3)):
        with pytest.raises(ValueError, match=f"{layers} layers cannot fill {stages} stages"):
            stage_slices(layers, stages)


def test_executor_rejects_output_of_unplanned_shape():
    model = Model()
    llm, enc, consumes = make_data(7, 2)
    schedule = Schedule1F1B(1, 2)
    flow = uniform_on_demand(schedule, consumes)
    stage = Stage(model, range(LAYERS), True, True)
    fns = step_functions(model, llm, {e: v["pos"] for e, v in enc.items()}, 2)
    executor = PipelineExecutor({0: stage}, EncoderAnchor(dict(model.encoders)), fns)
    shapes = {e: (len(v["pos"]), H) for e, v in enc.items()}
    shapes[1] = (shapes[1][0] + 1, H)
    plan = StepPlan(schedule, flow, {k: (len(v["ids"]), H) for k, v in llm.items()}, shapes, torch.float64)
    try:
        executor.step(plan, enc)
    except ValueError as exc:
        assert "EF1" in str(exc) and "plan says" in str(exc)
    else:
        raise AssertionError("a wrongly planned encoder shape was accepted")


def _disagreeing_plans(rank: int, world_size: int):
    """Rank 1 plans LLM microbatch 1 one token longer than rank 0 (which produces the planned shape)."""
    model = Model()
    llm, enc, consumes = make_data(4, 2)
    schedule = Schedule1F1B(2, 2)
    flow = uniform_on_demand(schedule, consumes)
    slices = stage_slices(LAYERS, 2)
    stage = Stage(model, slices[rank], rank == 0, rank == 1)
    fns = step_functions(model, llm, {e: v["pos"] for e, v in enc.items()}, 2)
    executor = PipelineExecutor(
        {rank: stage}, EncoderAnchor(dict(model.encoders)), fns, PipelineGroups(pp=dist.group.WORLD)
    )
    shapes = {k: (len(v["ids"]) + (1 if rank == 1 and k == 1 else 0), H) for k, v in llm.items()}
    plan = StepPlan(schedule, flow, shapes, {e: (len(v["pos"]), H) for e, v in enc.items()}, torch.float64)
    executor.step(plan, {e: enc[e] for e in flow.encoders_on(rank)})


def test_executor_names_rank_action_and_shapes_when_plans_disagree():
    with pytest.raises(WorldError) as info:
        run_world(_disagreeing_plans, 2, timeout_s=60)
    msg = str(info.value)
    assert info.value.rank == 1 and P2PError.__name__ in msg, msg
    assert "1F0 input" in msg and "rank 0 sent shape" in msg and "planned" in msg, msg


def test_anchor_runs_exactly_what_the_flow_places_at_each_boundary():
    schedule = Schedule1F1B(2, 2)  # rank 1: 1F0 1B0 1F1 1B1
    flow = DataFlow(
        {1: (1, (0, 1)), 2: (1, (-1, 2)), -1: (1, (-1, 2)), -2: (1, (-2, 0))},
        {1: [1], 2: [2]},
    )
    flow.validate(schedule)
    anchor = EncoderAnchor(
        {"lin": nn.Linear(2, 3).double()},
        EncoderParallelConfig(),
        EncoderDataConfig(max_seq_len=4),
    )
    anchor.register(1, flow, schedule)
    at = {str(a): [str(x) for x in anchor.at(a)] for a in schedule.actions(1)}
    assert at == {"1F0": ["EF1"], "1B0": [], "1F1": ["EF2", "EB1"], "1B1": []}
    assert [str(x) for x in anchor.at(None)] == ["EB2"]
    # the two-argument form: a placement policy's flow knows its schedule
    placed = uniform_on_demand(schedule, {1: [1, 2], 2: [3, 4]})
    two_arg = EncoderAnchor({})
    two_arg.register(1, placed)
    assert two_arg.placed() == [a for a in placed.programs(schedule)[1] if a.kind.is_encoder]
    assert {str(a) for a in two_arg.placed()} == {"EF2", "EB2", "EF4", "EB4"}
    with pytest.raises(ValueError, match="does not know its schedule"):
        EncoderAnchor({}).register(1, DataFlow.from_json(placed.to_json()))
    # a virtual stage index binds to the rank holding it (stage 3 of pp=2 x 2 lives on rank 1)
    inter = ScheduleInterleaved1F1B(2, 4, 2)
    inter_flow = uniform_on_demand(inter, {k: [k] for k in range(1, 5)})
    by_stage, by_rank = EncoderAnchor({}), EncoderAnchor({})
    by_stage.register(3, inter_flow)
    by_rank.register(1, inter_flow, inter)
    assert by_stage.stage == 1 and by_stage.placed() == by_rank.placed() != []
    with pytest.raises(ValueError, match=r"stage 4 out of range \[0, 4\)"):
        EncoderAnchor({}).register(4, inter_flow)
    lin = anchor.encoders["lin"]
    x = torch.randn(3, 2, dtype=torch.float64)
    out = anchor.forward(1, lambda e, inp: lin(inp), x)
    anchor.backward(1, torch.ones_like(out))
    assert torch.allclose(lin.weight.grad, torch.ones(3, 3, dtype=torch.float64) @ x, atol=1e-12)
    with pytest.raises(ValueError, match="EF2: 5 encoder tokens exceed max_seq_len 4"):
        anchor.forward(2, lambda e, inp: lin(inp), torch.randn(5, 2, dtype=torch.float64))
    with pytest.raises(KeyError, match="EB3"):
        anchor.backward(3, torch.ones(1))
    assert Action.parse("EF1") in anchor.placed()


def _tag_blind(rank: int, world_size: int, own_encoder_group: bool):
    """pp=2 on a backend that ignores P2P tags, as NCCL does: every isend/irecv of this process is sent
    with tag 0, so messages between two ranks of one group match in posting order only."""
    isend, irecv = dist.isend, dist.irecv
    dist.isend = lambda tensor, dst, group=None, tag=0: isend(tensor, dst, group=group, tag=0)
    dist.irecv = lambda tensor, src, group=None, tag=0: irecv(tensor, src, group=group, tag=0)
    everyone = dist.new_group([0, 1])
    pp = dist.new_group([0, 1])
    enc = dist.new_group([0, 1]) if own_encoder_group else None
    return run_layout(rank, 2, 1, 8, 4, PipelineGroups(pp=pp, encoder_dp=everyone, encoder_p2p=enc))


def test_encoder_transfers_never_rely_on_tags():
    """With encoder traffic on its own group, a tag-blind backend computes the single-process step;
    sharing the pp group (kept apart only by tags) mismatches messages there: a planned receive gets
    another transfer's header (P2PError) or payload (gloo aborts on the size)."""
    ref_losses, ref_grads = reference([8], 4)
    results = run_world(_tag_blind, 2, args=(True,), timeout_s=120)
    for r in range(2):
        losses = results[r][0]
        assert all(abs(losses[k] - ref_losses[0][k]) <= 1e-10 for k in losses)
    _check([results[r][1] for r in range(2)], ref_grads)
    with pytest.raises(WorldError) as info:
        run_world(_tag_blind, 2, args=(False,), timeout_s=120)
    msg = str(info.value)
    assert P2PError.__name__ in msg or "SIGABRT" in msg, msg

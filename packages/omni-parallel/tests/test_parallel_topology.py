"""rank_groups golden tables (hand-worked, Megatron-Core's examples), properties, and ParallelState."""

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from omni_parallel import EncoderLayout, ParallelConfig, ParallelState, mesh_device_type, rank_groups
from omni_parallel.testing import fake_world, run_world


def test_golden_megatron_docstring_tp2_pp4_16_ranks():
    # Megatron-Core initialize_model_parallel docstring: 16 GPUs, tp=2, pp=4 -> dp=2.
    g = rank_groups(16, ParallelConfig(tp=2, pp=4))
    assert g["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]]
    assert g["dp"] == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    assert g["pp"] == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
    assert g["dp_cp"] == g["dp"]
    assert g["cp"] == g["ulysses"] == g["ep"] == [[r] for r in range(16)]


def test_golden_tp2_cp2_ep2_pp2_16_ranks():
    # Worked by hand: strides tp=1, cp=2, ep=4, dp_rest(1)=8, pp=8.
    g = rank_groups(16, ParallelConfig(tp=2, cp=2, ep=2, pp=2))
    assert g["cp"] == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    assert g["ep"] == [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]]
    assert g["dp"] == g["ep"]
    assert g["pp"] == [[r, r + 8] for r in range(8)]
    assert g["dp_cp"] == [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]]
    assert g["tp_cp"] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]


def test_golden_ulysses_inside_cp_and_other_order():
    g = rank_groups(8, ParallelConfig(ulysses=2, cp=2))
    assert g["ulysses"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g["cp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g["dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert g["dp_cp"] == [[0, 1, 2, 3, 4, 5, 6, 7]]
    # Megatron's "tp-pp-dp" style order: pp before dp.
    g = rank_groups(8, ParallelConfig(tp=2, pp=2), order="tp-cp-pp-ep-dp")
    assert g["pp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g["dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_config_errors_are_clear():
    with pytest.raises(ValueError, match="not divisible"):
        rank_groups(12, ParallelConfig(tp=8))
    with pytest.raises(ValueError, match="!= world_size 16"):
        rank_groups(16, ParallelConfig(tp=2, dp=4))
    with pytest.raises(ValueError, match="ep = 3 must divide dp = 4"):
        rank_groups(4, ParallelConfig(ep=3))
    with pytest.raises(ValueError, match="adjacent"):
        rank_groups(4, ParallelConfig(), order="tp-ep-cp-dp-pp")
    with pytest.raises(ValueError, match="permutation"):
        rank_groups(4, ParallelConfig(), order="tp-dp-pp")
    with pytest.raises(ValueError, match="tp must be a positive int"):
        ParallelConfig(tp=0)


_sizes = st.sampled_from([1, 2, 4])


@settings(max_examples=60, deadline=None)
@given(tp=_sizes, cp=_sizes, ul=st.sampled_from([1, 2]), pp=_sizes, ep=_sizes, dpx=st.sampled_from([1, 2, 4]))
def test_every_rank_in_exactly_one_group_per_axis(tp, cp, ul, pp, ep, dpx):
    dp = ep * dpx
    world = tp * cp * ul * pp * dp
    if world > 1024:
        return
    cfg = ParallelConfig(tp=tp, cp=cp, ulysses=ul, pp=pp, ep=ep)
    g = rank_groups(world, cfg)
    expected = {"tp": tp, "cp": cp, "ulysses": ul, "ep": ep, "dp": dp, "pp": pp, "dp_cp": dp * cp * ul}
    expected["tp_cp"] = tp * cp * ul
    for name, groups in g.items():
        flat = sorted(r for grp in groups for r in grp)
        assert flat == list(range(world)), name
        assert all(len(grp) == expected[name] for grp in groups), name
    # Orthogonality: a TP group and a DP group share at most one rank; TP groups are contiguous.
    tp_of = {r: i for i, grp in enumerate(g["tp"]) for r in grp}
    for grp in g["dp"] + g["pp"] + g["cp"]:
        assert len({tp_of[r] for r in grp}) == len(grp)
    assert all(grp == list(range(grp[0], grp[0] + tp)) for grp in g["tp"])


def test_parallel_state_under_fake_world_pp4_dp8_cp2_tp4():
    cfg = ParallelConfig(pp=4, dp=8, cp=2, tp=4)
    table = rank_groups(256, cfg)
    for rank in (0, 77, 255):
        with fake_world(256, rank=rank):
            st_ = ParallelState.build(cfg)
            assert st_.config.dp == 8
            for name, groups in table.items():
                mine = next(g for g in groups if rank in g)
                assert st_.members[name] == mine
                assert dist.get_process_group_ranks(st_.group(name)) == mine, name
            pp = st_.members["pp"]
            assert st_.is_first_stage == (rank == pp[0]) and st_.is_last_stage == (rank == pp[-1])
            assert st_.next_rank == pp[(pp.index(rank) + 1) % 4]
            assert st_.prev_rank == pp[(pp.index(rank) - 1) % 4]
            assert st_.size("dp_cp") == 16 and st_.size("encoder_dp") == 256
            enc = st_.encoder_state(EncoderLayout(sp=4))
            sp = dist.get_process_group_ranks(enc.sp_group)
            assert sp == list(range(rank // 4 * 4, rank // 4 * 4 + 4))
            assert dist.get_process_group_ranks(enc.dp_group) == list(range(rank % 4, 256, 4))
            with pytest.raises(KeyError, match="unknown group"):
                st_.size("xx")


def test_build_without_process_group_is_a_clear_error():
    with pytest.raises(RuntimeError, match="needs a default process group"):
        ParallelState.build(ParallelConfig())


def _group_sums(rank, world_size):
    st_ = ParallelState.build(ParallelConfig(tp=2))
    out = {}
    for name in ("tp", "dp", "pp", "dp_cp", "tp_cp", "encoder_dp"):
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=st_.group(name))
        out[name] = t.item()
    enc = st_.encoder_state(EncoderLayout(sp=2))
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=enc.sp_group)
    return out, t.item(), enc.sp_rank, enc.dp_rank


def test_groups_reduce_over_expected_ranks_on_gloo():
    for rank, (sums, sp_sum, sp_rank, dp_rank) in enumerate(run_world(_group_sums, 4, timeout_s=120)):
        assert sums["tp"] == {0: 1, 1: 1, 2: 5, 3: 5}[rank]
        assert sums["dp"] == {0: 2, 1: 4, 2: 2, 3: 4}[rank]
        assert sums["pp"] == rank and sums["dp_cp"] == sums["dp"] and sums["encoder_dp"] == 6
        assert sums["tp_cp"] == sums["tp"]  # TP alone: tp_cp is the TP group itself
        assert sp_sum == sums["tp"]  # encoder SP groups are contiguous pairs, like TP here
        assert (sp_rank, dp_rank) == (rank % 2, rank // 2)


def _megatron_groups(world_size, sizes, masked):
    # Peer oracle, Megatron-Core's generate_masked_orthogonal_rank_groups re-derived: rank =
    # sum(index_i * stride_i) with strides the prefix products of `sizes` (fastest first); a group
    # varies the masked axes (group_index decomposed over the unmasked ones, fastest first).
    strides = [1]
    for s in sizes[:-1]:
        strides.append(strides[-1] * s)

    def decompose(index, shape):
        out = []
        for s in shape:
            out.append(index % s)
            index //= s
        return out

    m_shape = [s for s, m in zip(sizes, masked) if m]
    u_shape = [s for s, m in zip(sizes, masked) if not m]
    m_stride = [d for d, m in zip(strides, masked) if m]
    u_stride = [d for d, m in zip(strides, masked) if not m]
    group_size = 1
    for s in m_shape:
        group_size *= s
    groups = []
    for g in range(world_size // group_size):
        base = sum(i * d for i, d in zip(decompose(g, u_shape), u_stride))
        groups.append(
            [base + sum(i * d for i, d in zip(decompose(r, m_shape), m_stride)) for r in range(group_size)]
        )
    return groups


@settings(max_examples=40, deadline=None)
@given(
    tp=_sizes,
    cp=_sizes,
    pp=_sizes,
    ep=st.sampled_from([1, 2]),
    dpx=_sizes,
    order=st.sampled_from(["tp-cp-ep-dp-pp", "tp-cp-pp-ep-dp", "tp-pp-cp-dp-ep", "cp-tp-ep-dp-pp"]),
)
def test_rank_groups_match_megatron_generator(tp, cp, pp, ep, dpx, order):
    # Megatron's RankGenerator: non-expert groups use the order without ep and the full dp size;
    # ep groups use the order with ep and dp // ep.
    dp = ep * dpx
    world = tp * cp * pp * dp
    g = rank_groups(world, ParallelConfig(tp=tp, cp=cp, pp=pp, ep=ep), order=order)
    size = {"tp": tp, "cp": cp, "pp": pp, "dp": dp, "ep": ep}
    wo_ep = [t for t in order.split("-") if t != "ep"]
    for name, tokens in (
        ("tp", {"tp"}),
        ("cp", {"cp"}),
        ("pp", {"pp"}),
        ("dp", {"dp"}),
        ("dp_cp", {"dp", "cp"}),
        ("tp_cp", {"tp", "cp"}),  # Megatron's tensor-and-context-parallel group
    ):
        want = _megatron_groups(world, [size[t] for t in wo_ep], [t in tokens for t in wo_ep])
        assert g[name] == want, (name, order)
    w_ep = order.split("-")
    sizes_w_ep = [dp // ep if t == "dp" else size[t] for t in w_ep]
    assert g["ep"] == _megatron_groups(world, sizes_w_ep, [t == "ep" for t in w_ep]), order


@pytest.mark.parametrize(
    ("backend", "expected"),
    # "cpu:gloo,cuda:fake" has the shape of the trainer's "cpu:gloo,cuda:nccl" (a backend of CUDA's own
    # next to gloo for the CPU) and initialises without a GPU, which NCCL does not; dist.get_backend()
    # returns either string whole, so a mesh device chosen by `get_backend() == "nccl"` was "cpu".
    [("cpu:gloo,cuda:fake", "cuda"), ("gloo", "cpu"), ("cpu:gloo", "cpu"), ("fake", "cpu")],
)
def test_mesh_device_type_comes_from_the_backend_config_per_group(backend, expected):
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers the "fake" backend)

    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        ps = ParallelState.build(ParallelConfig(tp=1, pp=1))
        assert ps.mesh.device_type == expected
        assert mesh_device_type(ps.group("dp")) == expected  # groups created after the mesh too
        assert mesh_device_type(dist.new_group([0], backend="gloo")) == "cpu"
    finally:
        dist.destroy_process_group()

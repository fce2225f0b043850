"""CP and hybrid DP/CP delivery (``omni_pipeline.cp_delivery.CPSharding``) on its own, against the pure
head-tail shard map (``omni_parallel.shard_for_cp`` of the whole pack) as reference.

Regressions from the field: a document of length 7 at cp=2 (padding tokens carry no target and every real
token is held once); a microbatch with fewer images than CP ranks (a rank without media still joins the
resharding all-reduce, forward and backward); RoPE positions per CP rank equal the reference (the pack's
positions through the head-tail shard map). Also the spec's checks: ``build_cp_sharding`` refuses hybrid
DP/CP on a ``ParallelState`` without the hybrid blocks and takes its groups from it.
"""

import pytest
import torch
import torch.distributed as dist

from omni_data import Modality, Pack, SampleMeta
from omni_parallel import GroupSpec, ParallelConfig, ParallelState, cp_layout, shard_for_cp
from omni_parallel.testing import run_world
from omni_pipeline import IGNORE, CPSharding, CPSpec, build_cp_sharding, build_llm_microbatch

TOL = 1e-10


def _pack(lengths_media):
    samples = []
    for i, (media, text) in enumerate(lengths_media):
        mod = Modality.IMAGE if media else Modality.TEXT
        flops = 1.0 + i if media else 0.0
        shape = (3, 28, 28) if media else (text,)
        samples.append(SampleMeta(f"s{i}", mod.value, mod, media, text, flops, shape))
    return Pack(samples, sum(m + t for m, t in lengths_media))


def test_document_of_length_7_at_cp2_and_rope_positions_per_rank():
    pack = _pack([(0, 7), (4, 3), (0, 12), (2, 1)])  # documents of 7, 7, 12 and 3 tokens
    ids = {s.uid: torch.arange(s.text_tokens) + 10 for s in pack.samples}
    mb = build_llm_microbatch(pack, ids, {Modality.IMAGE: 3})
    cu = mb.cu_seqlens
    held, targets = [], 0
    for r in range(2):
        sh = CPSharding(2, r, {}, "allgather", microbatches=1, slices=1)
        local = sh.microbatch(mb, pack)
        src = torch.tensor(sh.local(pack).source)
        real = src >= 0
        assert local.num_tokens == cp_layout(cu, 2).tokens_local
        # RoPE: every real token keeps its in-document position (not its row on this rank)
        want = shard_for_cp(pack.position_ids.unsqueeze(1), cu, cp_rank=r, cp_size=2).squeeze(1)
        assert torch.equal(local.position_ids[real], want[real])
        assert torch.equal(local.position_ids[real], pack.position_ids[src[real]])
        # padding: token 0, no target; real rows keep the whole pack's label (across chunk boundaries)
        assert (local.labels[~real] == IGNORE).all() and (local.input_ids[~real] == 0).all()
        assert torch.equal(local.labels[real], mb.labels[src[real]])
        held += src[real].tolist()
        targets += local.num_targets
    assert sorted(held) == list(range(mb.num_tokens)) and targets == mb.num_targets


def _media_world(rank, world_size):
    # Two packs, one image each: the image is encoded by CP rank 0 (its owner), rank 1 encodes nothing.
    # Pack 1: rank 1 holds two of the image's tokens; pack 2: rank 1 holds none of them. Either way both
    # ranks run the resharding all-reduce forward and backward, and the embeddings land where the
    # reference (the whole pack's embedding rows through the head-tail shard map) puts them.
    out = []
    for lengths in ([(4, 3), (0, 7)], [(1, 6), (0, 5)]):
        pack = _pack(lengths)
        sh = CPSharding(2, rank, {(2, 0): dist.group.WORLD}, "allgather", microbatches=1, slices=1)
        positions = sh.rank_positions([pack], 1)
        g = torch.Generator().manual_seed(len(lengths[0]) + lengths[0][0])
        emb = torch.randn(pack.num_tokens, 5, generator=g, dtype=torch.float64)
        w = torch.randn(pack.num_tokens, 5, generator=g, dtype=torch.float64)
        mine = emb[positions[rank]].clone().requires_grad_(True) if positions[rank] else None
        rows_in = mine if mine is not None else torch.zeros(0, 5, dtype=torch.float64)
        embeds, rows = sh.deliver_media(pack, rows_in, positions)
        cu = [0, *torch.cumsum(torch.tensor(pack.seqlens), 0).tolist()]
        h = torch.zeros(sh.local(pack).tokens, 5, dtype=torch.float64).index_put((rows,), embeds)
        full = torch.zeros_like(emb)
        media = [p for rank_rows in positions for p in rank_rows]
        full[media] = emb[media]
        want = shard_for_cp(full, cu, cp_rank=rank, cp_size=2)
        (h * shard_for_cp(w, cu, cp_rank=rank, cp_size=2)).sum().backward()
        grad_err = 0.0 if mine is None else (mine.grad - w[positions[rank]]).abs().max().item()
        out.append((len(positions[1]), (h - want).abs().max().item(), grad_err, int(rows.numel())))
    return out


def test_microbatch_with_fewer_images_than_cp_ranks():
    results = run_world(_media_world, 2, timeout_s=120)
    for rank, res in enumerate(results):
        for encoded_by_rank1, err, grad_err, _ in res:
            assert encoded_by_rank1 == 0, rank  # one image: rank 1 has nothing to encode
            assert err <= TOL and grad_err <= TOL, (rank, res)
    assert [r[3] for r in results[1]] == [
        2,
        0,
    ]  # rank 1 holds 2 of the first image's tokens, none of the second's


def _spec_world(rank, world_size):
    plain = ParallelState.build(ParallelConfig(cp=2, dp=2))
    try:
        build_cp_sharding(plain, CPSpec(hybrid=True, max_tokens=16))
    except ValueError as exc:
        refused = str(exc)
    else:
        refused = None
    cp = build_cp_sharding(plain, CPSpec(encoder_sp=2))
    hybrid_state = ParallelState.build(ParallelConfig(cp=2, dp=2), groups=GroupSpec(hybrid_cp=True))
    hybrid = build_cp_sharding(hybrid_state, CPSpec(hybrid=True, max_tokens=16))
    groups = {k: dist.get_process_group_ranks(g) for k, g in hybrid.groups.items()}
    return refused, (cp.size, cp.rank, cp.encoder_sp), (hybrid.size, hybrid.rank, groups)


def test_build_cp_sharding_takes_its_groups_from_the_parallel_state():
    for rank, (refused, cp, hybrid) in enumerate(run_world(_spec_world, 4, timeout_s=120)):
        assert refused == (
            "hybrid DP/CP needs the CP blocks: build the ParallelState with GroupSpec(hybrid_cp=True)"
        )
        assert cp == (2, rank % 2, 2)
        # dp_cp = every rank (cp fastest): blocks of 2 ({0, 1}, {2, 3}) and of 4
        assert hybrid == (
            4,
            rank,
            {(2, rank - rank % 2): [rank - rank % 2, rank - rank % 2 + 1], (4, 0): [0, 1, 2, 3]},
        )
    with pytest.raises(ValueError, match=r"CPSpec\.microbatches must be >= 1"):
        CPSpec(microbatches=0)

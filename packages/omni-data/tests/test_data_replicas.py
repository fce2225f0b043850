"""Data replicas independent of the DP size (``ReplicaMerge``): one DP rank's step is its replicas' steps
concatenated in replica order, so the global step (every DP rank's, in DP order) is the same at every DP
size dividing the replica count; a state saved at one DP size resumes at another by handing each rank its
replicas' states whole. Oracle: each replica's own :class:`PackedLoader`, run alone."""

import pytest

from omni_data import (
    HybridPacker,
    LayoutMismatchError,
    MixtureSchedule,
    MixtureStream,
    PackedLoader,
    PayloadReader,
    ReplicaMerge,
    WebDatasetSource,
    ZeroRedundancyFilter,
    hand_over_replicas,
    replica_ids,
)
from omni_data.testing import image_samples, text_samples, train_tiny_bpe, write_shards

REPLICAS, M = 4, 2


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("replicas")
    write_shards(f"{d}/img-%03d.tar", image_samples(24, sizes=(16, 48)), per_shard=3)  # 8 shards
    write_shards(f"{d}/txt-%03d.tar", text_samples(32, words=(5, 60)), per_shard=4)  # 8 shards
    return str(d), train_tiny_bpe()


def _loader(data, replica):
    d, tok = data
    kw = dict(tokenizer=tok, epochs=None, rank=replica, world_size=REPLICAS, shuffle_shards=True, seed=5)
    sources = {
        "img": WebDatasetSource(f"{d}/img-{{000..007}}.tar", modality="image", name="img", **kw),
        "txt": WebDatasetSource(f"{d}/txt-{{000..007}}.tar", modality="text", name="txt", **kw),
    }
    mix = MixtureStream(sources, MixtureSchedule.constant({"img": 0.5, "txt": 0.5}))
    return PackedLoader(HybridPacker(mix, max_seq_len=96, buffer_size=4), M, mixture=mix)


def _merge(data, dp_rank, dp):
    return ReplicaMerge({r: _loader(data, r) for r in replica_ids(REPLICAS, dp_rank, dp)}, REPLICAS)


def _uids(batch):
    return [[(s.uid, s.epoch) for s in p.samples] for p in batch.packs]


def test_replicas_merge_in_order_and_resume_at_another_dp_size(data):
    alone = [_loader(data, r) for r in range(REPLICAS)]
    for lo in alone:
        lo.reset()
    want = [[u for lo in alone for u in _uids(next(lo))] for _ in range(5)]  # the global steps

    # dp = 2: ranks 0 and 1 run replicas {0, 1} and {2, 3}; their steps side by side are the global step
    ranks = [_merge(data, d, 2) for d in range(2)]
    for m in ranks:
        m.reset()
    for step in range(2):
        got = [_uids(next(m)) for m in ranks]
        assert all(len(g) == 2 * M for g in got)
        assert got[0] + got[1] == want[step], step

    # resume at dp = 1 from the two ranks' states: the replicas handed over whole, the same steps follow
    states = [m.state_dict() for m in ranks]
    held = {k: v for st in states for k, v in st["replicas"].items()}
    one = _merge(data, 0, 1)
    one.reset({"step": 2, "replicas": held})
    for step in (2, 3):
        assert _uids(next(one)) == want[step], step

    # and at dp = 4 (one replica per rank) from the dp = 1 rank's state
    state = one.state_dict()
    for d in range(4):
        m = _merge(data, d, 4)
        m.reset(state)
        assert _uids(next(m)) == want[4][d * M : (d + 1) * M], d

    # a rank whose replicas are missing from the state is refused before anything is read
    with pytest.raises(LayoutMismatchError, match=r"no data replicas \[2, 3\]"):
        _merge(data, 1, 2).reset({"step": 2, "replicas": {k: held[k] for k in ("0", "1")}})
    with pytest.raises(ValueError, match="do not split over 3 DP ranks"):
        replica_ids(REPLICAS, 0, 3)


def _filter(data, dp_rank, dp):
    m = M * REPLICAS // dp
    return ZeroRedundancyFilter(
        _merge(data, dp_rank, dp), [], microbatches=m, slices=1, reader=PayloadReader(data[1]), prefetch=2
    )


def test_filter_states_hand_over_with_pre_filtered_steps(data):
    """The filters' states (pre-filtered steps in flight) at dp = 1 handed to dp = 2 ranks: each takes its
    replicas' loader states and its replicas' shares of the pending steps, and the global steps go on."""
    with _filter(data, 0, 1) as one:
        want = [_uids(next(one)) for _ in range(4)]
    with _filter(data, 0, 1) as one:
        next(one)
        state = one.state_dict()
    assert state["pending"], "the test needs steps in flight"
    for d in range(2):
        with _filter(data, d, 2) as zr:
            zr.reset(hand_over_replicas([state], replica_ids(REPLICAS, d, 2)))
            half = 2 * M
            for step in (1, 2, 3):
                assert _uids(next(zr)) == want[step][d * half : (d + 1) * half], (d, step)

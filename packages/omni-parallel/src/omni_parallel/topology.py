"""Rank layout as pure functions: which global ranks form each TP/CP/Ulysses/EP/DP/PP group.

The layout follows Megatron-Core's ``RankGenerator`` (``generate_masked_orthogonal_rank_groups``): the
order string lists the axes from fastest- to slowest-varying, so with the default ``"tp-cp-ep-dp-pp"``
TP ranks are adjacent and PP ranks are the farthest apart. As in Megatron, EP is carved out of DP (the
``ep`` and ``dp`` tokens must be adjacent; ``dp`` groups span both) and, when DP alone is too small, out
of DP x CP (:meth:`ParallelConfig.ep_split`: EP then spans all of its DP share and the slowest-varying
sequence-parallel ranks, the layout of Megatron-Core's expert rank generator and torchtitan's EP over
``dp_shard x cp``), ``dp_cp`` spans DP and the
sequence-parallel axes, and ``tp_cp`` spans TP and the sequence-parallel axes (Megatron's
"tensor and context parallel" group: the ranks of one pipeline stage of one DP replica, which train on the
same packs).

Our addition: the ``cp`` token stands for the LLM's whole sequence-parallel block of size
``cp * ulysses``, laid out as Ulysses (inner, contiguous ranks: all-to-all wants the fastest links) times
CP (outer), the USP ("unified sequence parallelism") layout. With ``ulysses == 1`` or ``cp == 1`` it is
exactly Megatron's layout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["GROUP_NAMES", "ParallelConfig", "expert_groups", "mesh_axes", "rank_groups"]

# Every name rank_groups() returns, and ParallelState exposes as a process group.
GROUP_NAMES: tuple[str, ...] = ("tp", "cp", "ulysses", "ep", "dp", "pp", "dp_cp", "tp_cp")

_TOKENS = ("tp", "cp", "ep", "dp", "pp")


@dataclass(frozen=True)
class ParallelConfig:
    """Sizes of the LLM's parallel axes. ``dp=None`` means "whatever the world size leaves".

    Attributes:
        tp: tensor-parallel size (Megatron TP).
        pp: pipeline-parallel size (number of stages).
        cp: context-parallel size (ring / all-gather KV, head-tail causal balancing).
        ulysses: Ulysses sequence-parallel size (all-to-all sequence <-> heads).
        ep: expert-parallel size; carved out of the ``dp x cp x ulysses`` ranks of a stage
            (:meth:`ep_split`): ``ep`` divides ``dp`` (experts sharded inside DP, Megatron's layout), or
            ``ep / gcd(ep, dp)`` divides ``cp * ulysses`` (EP also spans sequence-parallel ranks).
        dp: data-parallel size including EP; inferred by :meth:`resolve` when ``None``.
    """

    tp: int = 1
    pp: int = 1
    cp: int = 1
    ulysses: int = 1
    ep: int = 1
    dp: int | None = None

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "cp", "ulysses", "ep"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ParallelConfig.{name} must be a positive int, got {value!r}")
        if self.dp is not None and (not isinstance(self.dp, int) or isinstance(self.dp, bool) or self.dp < 1):
            raise ValueError(f"ParallelConfig.dp must be a positive int or None, got {self.dp!r}")

    @property
    def model_size(self) -> int:
        """Ranks holding one model replica's share of the work: ``tp * cp * ulysses * pp``."""
        return self.tp * self.cp * self.ulysses * self.pp

    def ep_split(self) -> tuple[int, int]:
        """``(ep_dp, ep_seq)``: how many of the EP group's ranks differ in DP (``gcd(ep, dp)``) and how
        many in the sequence-parallel block (``ep / ep_dp``, the slowest-varying of its ``cp * ulysses``
        ranks); ``ep = ep_dp * ep_seq``. ``ep_seq`` is 1 when ``ep`` divides ``dp`` (EP inside DP).

        Raises:
            ValueError: ``dp`` unresolved, or ``ep_seq`` does not divide ``cp * ulysses`` (``ep`` is not
                carved out of the ``dp x cp x ulysses`` ranks).
        """
        if self.dp is None:
            raise ValueError("ep_split needs a resolved config (dp set); call config.resolve(world_size)")
        ep_dp = math.gcd(self.ep, self.dp)
        ep_seq = self.ep // ep_dp
        if (self.cp * self.ulysses) % ep_seq:
            raise ValueError(
                f"ep = {self.ep} must divide dp = {self.dp}, or ep / gcd(ep, dp) = {ep_seq} must divide "
                f"cp * ulysses = {self.cp * self.ulysses} (EP is carved out of the DP x CP ranks)"
            )
        return ep_dp, ep_seq

    def resolve(self, world_size: int) -> ParallelConfig:
        """Return a copy with ``dp`` set for ``world_size`` ranks.

        Raises:
            ValueError: ``world_size`` is not a positive int, the sizes do not multiply to it, or ``ep``
                is not carved out of the ``dp x cp x ulysses`` ranks (:meth:`ep_split`).
        """
        if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {world_size!r}")
        dp = self.dp
        if dp is None:
            if world_size % self.model_size:
                raise ValueError(
                    f"world_size {world_size} is not divisible by tp*cp*ulysses*pp = {self.model_size} "
                    f"({self.tp}*{self.cp}*{self.ulysses}*{self.pp})"
                )
            dp = world_size // self.model_size
        if dp * self.model_size != world_size:
            raise ValueError(
                f"tp*cp*ulysses*pp*dp = {self.tp}*{self.cp}*{self.ulysses}*{self.pp}*{dp} = "
                f"{dp * self.model_size} != world_size {world_size}"
            )
        ParallelConfig(tp=self.tp, pp=self.pp, cp=self.cp, ulysses=self.ulysses, ep=self.ep, dp=dp).ep_split()
        return ParallelConfig(tp=self.tp, pp=self.pp, cp=self.cp, ulysses=self.ulysses, ep=self.ep, dp=dp)


def mesh_axes(config: ParallelConfig, order: str = "tp-cp-ep-dp-pp") -> list[tuple[str, int]]:
    """Elementary axes ``(name, size)`` from fastest- to slowest-varying for a *resolved* config.

    Names: ``tp``, ``ulysses``, ``cp``, ``ep``, ``dp_rest`` (DP without EP), ``pp``. Reversed, this is the
    mesh shape for ``init_device_mesh`` (whose last dimension varies fastest). ``ep`` is EP's share of DP
    (``ep_dp`` of :meth:`ParallelConfig.ep_split`): the EP group itself when ``ep`` divides ``dp``; when EP
    also spans sequence-parallel ranks its groups are :func:`expert_groups`'s (not one mesh axis).

    Raises:
        ValueError: ``order`` is not a permutation of tp, cp, ep, dp, pp; ep and dp are not adjacent;
            EP spans sequence-parallel ranks but ``cp-ep-dp`` is not in ``order``; or ``config.dp`` is
            unresolved.
    """
    tokens = order.split("-")
    if sorted(tokens) != sorted(_TOKENS):
        raise ValueError(f"order {order!r} must be a '-'-joined permutation of {'-'.join(_TOKENS)}")
    if abs(tokens.index("ep") - tokens.index("dp")) != 1:
        raise ValueError(f"order {order!r}: ep and dp must be adjacent (EP is carved out of DP)")
    if config.dp is None:
        raise ValueError("mesh_axes needs a resolved config (dp set); call config.resolve(world_size)")
    ep_dp, ep_seq = config.ep_split()
    if ep_seq > 1 and "cp-ep-dp" not in order:
        raise ValueError(
            f"order {order!r}: ep = {config.ep} spans sequence-parallel ranks (dp = {config.dp}), which "
            "needs cp, ep and dp adjacent in that order"
        )
    expand = {
        "tp": [("tp", config.tp)],
        "cp": [("ulysses", config.ulysses), ("cp", config.cp)],
        "ep": [("ep", ep_dp)],
        "dp": [("dp_rest", config.dp // ep_dp)],
        "pp": [("pp", config.pp)],
    }
    return [axis for token in tokens for axis in expand[token]]


# Which elementary axes each named group spans.
_GROUP_AXES: dict[str, tuple[str, ...]] = {
    "tp": ("tp",),
    "cp": ("cp",),
    "ulysses": ("ulysses",),
    "ep": ("ep",),
    "dp": ("ep", "dp_rest"),
    "pp": ("pp",),
    "dp_cp": ("ulysses", "cp", "ep", "dp_rest"),
    "tp_cp": ("tp", "ulysses", "cp"),
}


def _groups(axes: list[tuple[str, int]], masked: tuple[str, ...]) -> list[list[int]]:
    # Megatron's generate_masked_orthogonal_rank_groups: ranks in a group differ only along `masked`
    # axes; groups are enumerated by the remaining axes, fastest first.
    strides = [math.prod(size for _, size in axes[:i]) for i in range(len(axes))]
    inner = [(size, stride) for (name, size), stride in zip(axes, strides) if name in masked]
    outer = [(size, stride) for (name, size), stride in zip(axes, strides) if name not in masked]

    def offsets(dims: list[tuple[int, int]]) -> list[int]:
        out = [0]
        for size, stride in dims:
            out = [o + j * stride for j in range(size) for o in out]
        return out

    return [[base + off for off in offsets(inner)] for base in offsets(outer)]


def rank_groups(
    world_size: int, config: ParallelConfig, order: str = "tp-cp-ep-dp-pp"
) -> dict[str, list[list[int]]]:
    """Rank lists of every parallel group, with no process group needed.

    Args:
        world_size: total ranks.
        config: axis sizes; ``dp=None`` is inferred from ``world_size``.
        order: axes from fastest- to slowest-varying (Megatron-Core's ``order``).

    Returns:
        ``{name: groups}`` for each name in :data:`GROUP_NAMES`; ``groups`` partitions ``range(world_size)``
        into equal-size ascending lists, enumerated as Megatron does (by the other axes, fastest first). Example: 16 ranks, tp=2, pp=4 gives tp
        ``[[0, 1], [2, 3], ...]``, dp ``[[0, 2], [1, 3], [4, 6], ...]``, pp ``[[0, 4, 8, 12], ...]``.

    Raises:
        ValueError: see :meth:`ParallelConfig.resolve` and :func:`mesh_axes`.

    Source: Megatron-Core ``parallel_state.RankGenerator``.
    """
    resolved = config.resolve(world_size)
    axes = mesh_axes(resolved, order)
    table = {name: _groups(axes, _GROUP_AXES[name]) for name in GROUP_NAMES}
    table["ep"] = expert_groups(world_size, resolved, order)["ep"]
    return table


def expert_groups(
    world_size: int, config: ParallelConfig, order: str = "tp-cp-ep-dp-pp"
) -> dict[str, list[list[int]]]:
    """Rank lists of the expert layout of a stage, with no process group needed.

    The ``dp_cp`` ranks of one pipeline stage and TP rank (one stage's data replicas and sequence
    shares) are cut into ``ep`` expert shards: ``"ep"`` groups hold one copy of every expert between them
    (rank ``j`` of a group holds experts ``[j * E/ep, (j+1) * E/ep)``) and exchange tokens;
    ``"edp"`` (expert data parallel) groups are the ranks holding the *same* expert shard, over which
    expert gradients are reduced (non-expert gradients stay on ``dp_cp``). ``ep * edp = dp * cp *
    ulysses``; with ``ep == 1`` ``edp`` equals ``dp_cp``. The ``ep`` groups are :func:`rank_groups`'s.

    Within a stage's ``dp_cp`` block, numbered as its ranks vary (Ulysses fastest, then CP, then DP), an
    EP group is ``ep`` ranks at stride ``cp * ulysses / ep_seq``: with ``ep_seq = 1``
    (:meth:`ParallelConfig.ep_split`) ranks that differ in DP only (stride ``tp * cp * ulysses`` in the
    world); otherwise all ``ep_dp`` of its DP share times the ``ep_seq`` slowest-varying sequence ranks.

    Returns:
        ``{"ep": groups, "edp": groups}``, each partitioning ``range(world_size)`` in ascending lists.

    Raises:
        ValueError: see :meth:`ParallelConfig.resolve` and :func:`mesh_axes`.

    Source: Megatron-Core's expert rank generator (``expert_data_parallel`` over the DP x CP ranks left
    by EP) and torchtitan's ``ep`` / ``dp_shard_mod_ep`` mesh split.
    """
    resolved = config.resolve(world_size)
    axes = mesh_axes(resolved, order)
    ep_seq = resolved.ep_split()[1]
    if ep_seq > 1:  # the sequence block (ulysses x cp, ulysses fastest) as (inner, ep_seq): same radix
        seq = resolved.ulysses * resolved.cp
        i = next(k for k, (name, _) in enumerate(axes) if name == "ulysses")
        assert [name for name, _ in axes[i : i + 3]] == ["ulysses", "cp", "ep"]
        axes = [*axes[:i], ("seq_in", seq // ep_seq), ("ep_seq", ep_seq), *axes[i + 2 :]]
        return {"ep": _groups(axes, ("ep_seq", "ep")), "edp": _groups(axes, ("seq_in", "dp_rest"))}
    return {"ep": _groups(axes, ("ep",)), "edp": _groups(axes, ("ulysses", "cp", "dp_rest"))}

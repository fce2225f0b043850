"""Process groups for one rank: the LLM's layout and the encoders' decoupled layout over the same ranks.

``ParallelState`` is built from the *existing* default process group, whoever created it: ``torchrun``
(call ``ParallelState.build(config, init_from_env=True)`` or ``dist.init_process_group`` first),
``omni_parallel.testing.run_world`` (already initialised inside each rank) or ``fake_world`` (topology at
1,000+ ranks in one process). It is a plain object passed explicitly; nothing is stored globally.

Groups come from ``torch.distributed.device_mesh.init_device_mesh`` with one named dimension per
elementary axis of :func:`omni_parallel.topology.mesh_axes`; combined groups (``dp``, ``dp_cp``,
``tp_cp``, and ``ep`` when it spans sequence-parallel ranks: ``ParallelConfig.ep_split``) are created by
enumerating :func:`omni_parallel.topology.rank_groups`, whose member lists they all equal (``tp_cp`` is
the ``tp``, ``ulysses`` or ``cp`` group itself when only one of them exceeds 1).

Every process group of a run is created here, in :meth:`ParallelState.build`, in one fixed order (group
creation is collective: every rank must create the same groups in the same order, so no caller creates
any elsewhere): the mesh's elementary axes, ``dp``, ``dp_cp`` and ``tp_cp``, then the optional groups a
:class:`GroupSpec` asks for, in this order: the loader's copy of ``dp``, the reordering groups across DP,
the encoders' point-to-point copy of ``pp``, the hybrid DP/CP blocks, the expert-data-parallel groups, the
data mesh of LLM ZeRO with TP, and a gloo group over every rank for checkpoint bookkeeping.

Decoupled encoders (§ decoupled parallelism): encoder data parallelism spans every rank, pipeline ranks
included; encoder SP groups are ``sp`` contiguous ranks; ZeRO over all ranks through FSDP2, on the
step-scoped schedule of :mod:`omni_parallel.encoder_zero` (one all-gather per step before the first encoder
forward, one reduce-scatter after the last backward, on every rank whatever its encoder work).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from omni_parallel.hybrid_cp import hybrid_cp_blocks
from omni_parallel.topology import GROUP_NAMES, ParallelConfig, expert_groups, mesh_axes, rank_groups

__all__ = [
    "EncoderLayout",
    "EncoderState",
    "GroupSpec",
    "ParallelState",
    "default_reorder_group_size",
    "mesh_device_type",
]

_COMBINED = ("dp", "dp_cp", "tp_cp")


def _combined(config: ParallelConfig) -> tuple[str, ...]:
    """The groups created by enumeration rather than taken from the mesh: :data:`_COMBINED`, and ``ep``
    when it spans sequence-parallel ranks (not one mesh axis)."""
    return _COMBINED + (("ep",) if config.ep_split()[1] > 1 else ())


def mesh_device_type(group: dist.ProcessGroup | None = None) -> str:
    """The device type a :class:`DeviceMesh` over ``group`` (default: the world) is built for.

    Read from the group's backend config (``dist.get_backend_config``: ``"cpu:gloo,cuda:nccl"`` for a
    mixed group, ``"cuda:nccl"`` for NCCL, ``"cpu:gloo,cuda:gloo"`` for gloo), not from
    ``dist.get_backend``, which returns a mixed config whole (``"cpu:gloo,cuda:nccl"``, never equal to
    ``"nccl"``). ``"cuda"`` when CUDA tensors have a backend of their own (one that does not also serve
    the CPU in this config: NCCL, or any ``cuda:X`` next to a different ``cpu:Y``); ``"cpu"`` when one
    backend serves every device (gloo, fake), which is how CPU jobs run.
    """
    backends = dict(entry.split(":", 1) for entry in dist.get_backend_config(group).split(","))
    cuda = backends.get("cuda")
    return "cuda" if cuda is not None and cuda != backends.get("cpu") else "cpu"


@dataclass(frozen=True)
class GroupSpec:
    """The process groups :meth:`ParallelState.build` creates beyond the parallel axes (all off by default).

    Attributes:
        loader_dp: a second group over each ``dp`` group's ranks, for a data loader whose per-step
            collectives run on a thread of their own (two threads must never share a group):
            :attr:`ParallelState.loader_dp_group`. Not created for ``dp`` 1.
        reorder_group_size: DP replicas per reordering group of the decentralised grouped reordering
            across DP (MegaScale-Omni §5.1): ``size`` consecutive members of each ``dp`` group,
            :attr:`ParallelState.reorder_group`. 1: no reordering across DP (no group); ``None``: the
            replicas whose ranks share a node (:func:`default_reorder_group_size`).
        encoder_p2p: a second group over each ``pp`` group's ranks in the same order, for encoder outputs
            and their gradients, so they never share a communicator with LLM activations (NCCL ignores
            P2P tags): :attr:`ParallelState.encoder_p2p_group`. Not created for ``pp`` 1.
        hybrid_cp: every aligned CP block of every CP size of each ``dp_cp`` group
            (:func:`omni_parallel.hybrid_cp_blocks`), the groups a hybrid DP/CP plan may pick per pack
            (ByteScale's hybrid DP/CP): :attr:`ParallelState.hybrid_cp_groups`.
        expert_dp: the expert-data-parallel groups of :func:`omni_parallel.topology.expert_groups` (the
            ``dp_cp`` ranks of a stage holding the same expert shard; expert gradients are reduced over
            them): :attr:`ParallelState.expert_dp_group`. Not created for ``ep`` 1 (``dp_cp`` serves) nor
            when each shard has one holder.
        data_mesh: LLM ZeRO over TP (:mod:`omni_parallel.llm_zero`): the ``dp_cp`` ranks as one dimension
            of the root mesh (its ``dp_rest``, ``cp`` and ``ulysses`` dimensions flattened,
            ``DeviceMesh._flatten``, which creates the group), so FSDP2 joins it with the TP mesh into
            its 2-D ``(dp_cp, tp)`` mesh: :attr:`ParallelState.data_mesh`. Only created for ``tp > 1``
            with ``ep = 1``; with ``ulysses = cp = 1`` the ``dp_rest`` dimension is sliced, no group.
        encoder_sync: a group over every rank for the encoders' gradient reductions
            (:func:`omni_parallel.apply_encoder_zero`: issued inside the step at points that differ per
            rank, so no other collective may share their group): :attr:`ParallelState.encoder_sync_group`.
            Not created for a world of one rank.
        checkpoint: a gloo group over every rank for checkpoint bookkeeping (omni-ckpt's
            ``CheckpointManager(process_group=...)``: its plan exchange and commit run on CPU objects, an
            async save's from a thread of its own, so it needs a group no step collective uses):
            :attr:`ParallelState.checkpoint_group`. Created last.

    Raises:
        ValueError: ``reorder_group_size`` neither ``None`` nor a positive int, or a flag not a bool.
    """

    loader_dp: bool = False
    reorder_group_size: int | None = 1
    encoder_p2p: bool = False
    hybrid_cp: bool = False
    checkpoint: bool = False
    expert_dp: bool = False
    encoder_sync: bool = False
    data_mesh: bool = False

    def __post_init__(self) -> None:
        g = self.reorder_group_size
        if g is not None and (not isinstance(g, int) or isinstance(g, bool) or g < 1):
            raise ValueError(f"GroupSpec.reorder_group_size must be a positive int or None, got {g!r}")
        for name in (
            "loader_dp",
            "encoder_p2p",
            "hybrid_cp",
            "checkpoint",
            "expert_dp",
            "data_mesh",
            "encoder_sync",
        ):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"GroupSpec.{name} must be a bool, got {getattr(self, name)!r}")


def default_reorder_group_size(layout: ParallelState) -> int:
    """DP replicas per reordering group when :attr:`GroupSpec.reorder_group_size` is ``None``: those whose
    ranks share a node (``LOCAL_WORLD_SIZE`` consecutive ranks, as ``torchrun`` numbers them), the same on
    every rank (the gcd over nodes and DP groups); every replica when ``LOCAL_WORLD_SIZE`` is unset.

    ``layout``: anything with ``world_size``, a resolved ``config`` and ``order`` (a :class:`ParallelState`);
    pure: no process group is needed.
    """
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "0"))
    dp_groups = rank_groups(layout.world_size, layout.config, layout.order)["dp"]
    if local < 1:
        return len(dp_groups[0])
    g = 0
    for members in dp_groups:
        for node in {m // local for m in members}:
            g = math.gcd(g, sum(1 for m in members if m // local == node))
    return max(1, g)


@dataclass(frozen=True)
class EncoderLayout:
    """Parallel layout of the encoders, independent of the LLM's.

    Attributes:
        sp: encoder sequence-parallel size (long samples split over ``sp`` contiguous ranks, Ulysses
            inside attention); must divide the world size.
        long_threshold: samples with more than this many tokens are "long" and SP-split; the rest go
            whole to single ranks (long-short SP, see :func:`omni_parallel.plan_long_short`).
        fsdp: shard encoder parameters over all ranks with FSDP2 (``fully_shard``).
        reshard_after_forward: True = ZeRO-3 (parameters sharded at rest: the copy gathered for a step
            is freed when the step's gradients are reduced), False = ZeRO-2 (the gathered copy stays
            allocated between steps); see :mod:`omni_parallel.encoder_zero`.

    Raises:
        ValueError: ``sp`` or ``long_threshold`` not a positive int, or a flag that is not a bool.
    """

    sp: int = 1
    long_threshold: int = 8192
    fsdp: bool = True
    reshard_after_forward: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.sp, int) or isinstance(self.sp, bool) or self.sp < 1:
            raise ValueError(f"EncoderLayout.sp must be a positive int, got {self.sp!r}")
        if not isinstance(self.long_threshold, int) or self.long_threshold < 1:
            raise ValueError(
                f"EncoderLayout.long_threshold must be a positive int, got {self.long_threshold!r}"
            )
        for name in ("fsdp", "reshard_after_forward"):
            # A string such as "no" would be truthy and silently turn the option on.
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"EncoderLayout.{name} must be a bool, got {getattr(self, name)!r}")


@dataclass(eq=False)
class EncoderState:
    """One rank's encoder groups. Ranks ``[s*sp, (s+1)*sp)`` form SP group ``s``.

    Attributes:
        layout: the layout it was built from.
        mesh: 2-D mesh ``(edp, esp)`` over every rank; ``esp`` varies fastest.
        sp_group: this rank's encoder SP group (``sp`` contiguous ranks).
        dp_group: ranks with the same SP index: one per SP group (``world // sp`` ranks), the replicas
            that split encoder samples between them.
        world_group: all ranks: encoder gradients are reduced (and FSDP2-sharded) over it.
        fsdp_mesh: 1-D mesh over every rank (the default group), the FSDP2 sharding mesh.
        sp_rank: index of this rank in ``sp_group``. dp_rank: index of its SP group.
    """

    layout: EncoderLayout
    mesh: DeviceMesh
    sp_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup
    world_group: dist.ProcessGroup
    fsdp_mesh: DeviceMesh
    sp_rank: int
    dp_rank: int

    @property
    def sp_size(self) -> int:
        return self.layout.sp

    @property
    def dp_size(self) -> int:
        return self.mesh.size(0)

    def shard(self, module: torch.nn.Module, blocks: list[torch.nn.Module] | None = None) -> torch.nn.Module:
        """Apply FSDP2 ``fully_shard`` over all ranks (ZeRO-3, or ZeRO-2 without reshard after forward) on
        the step-scoped schedule of :mod:`omni_parallel.encoder_zero`.

        ``blocks`` (e.g. transformer layers) are sharded first, each its own all-gather unit, then the
        root. Returns ``module`` itself (FSDP2 swaps its class in place). No-op when ``layout.fsdp`` is
        False. The sharded module issues no collective in forward or backward: every rank calls
        :func:`~omni_parallel.encoder_zero.gather_parameters` before the step's first encoder forward and
        :func:`~omni_parallel.encoder_zero.reduce_scatter_gradients` after its last backward (an
        ``EncoderAnchor`` with ``zero_stage`` 2 or 3 makes the pipeline executor do both), which sum the
        gradients (FSDP2's own reduction would average them over the mesh). ``reshard_after_forward``
        False (ZeRO-2) keeps the gathered storage between steps; True (ZeRO-3) frees it.

        Raises:
            ValueError: a block is not a submodule of the module.
        """
        if not self.layout.fsdp:
            return module
        from torch.distributed.fsdp import fully_shard

        from omni_parallel.encoder_zero import configure_step_schedule

        mesh = self.fsdp_mesh
        inside = {id(m) for m in module.modules()}
        for i, block in enumerate(blocks or []):
            if id(block) not in inside:
                raise ValueError(f"blocks[{i}] ({type(block).__name__}) is not a submodule of the module")
            fully_shard(block, mesh=mesh, reshard_after_forward=self.layout.reshard_after_forward)
        fully_shard(module, mesh=mesh, reshard_after_forward=self.layout.reshard_after_forward)
        configure_step_schedule([module], keep_gathered=not self.layout.reshard_after_forward)
        return module


@dataclass(eq=False)
class ParallelState:
    """One rank's view of the LLM layout: its groups, sizes, coordinates and pipeline neighbours.

    Build with :meth:`build`; pass it explicitly to whatever needs groups.

    Attributes:
        config: the resolved :class:`ParallelConfig` (``dp`` set).
        order: axis order, fastest first (Megatron-Core's convention).
        rank, world_size: this rank and the world size of the default group.
        mesh: the device mesh, one named dimension per elementary axis (``tp``, ``ulysses``, ``cp``,
            ``ep``, ``dp_rest``, ``pp``), slowest first.
        groups: ``{name: ProcessGroup}`` for every name in ``GROUP_NAMES`` plus ``"encoder_dp"`` (world).
        members: ``{name: global ranks of this rank's group}``, equal to ``rank_groups``'s entry.
        spec: the :class:`GroupSpec` of the optional groups below.
        loader_dp_group: this rank's copy of its ``dp`` group for the loader (``None``: not asked for, or
            ``dp`` 1).
        reorder_group: this rank's reordering group across DP (``None``: size 1).
        reorder_size: DP replicas per reordering group (``spec.reorder_group_size`` resolved; 1: none).
        encoder_p2p_group: this rank's copy of its ``pp`` group for encoder transfers (``None``: not asked
            for, or ``pp`` 1).
        hybrid_cp_groups: ``{(cp, first): ProcessGroup}`` of the hybrid DP/CP blocks this rank belongs to
            (``first``: the block's first ``dp_cp`` index); empty unless ``spec.hybrid_cp``.
        expert_dp_group: this rank's expert-data-parallel group (``None``: not asked for, ``ep`` 1, or one
            holder per expert shard); its members: ``members["edp"]`` when created.
        checkpoint_group: a gloo group over every rank for checkpoint bookkeeping (``None``: not asked
            for).
        encoder_sync_group: the encoders' gradient-reduction group over every rank
            (``GroupSpec.encoder_sync``; ``None``: not asked for, or one rank).
        data_mesh: the ``dp_cp`` ranks as one dimension of :attr:`mesh` (``GroupSpec.data_mesh``;
            ``None``: not asked for, ``tp`` 1 or ``ep > 1``).
        timeout: the collective timeout of every group (``None``: torch's defaults; see :meth:`build`).
    """

    config: ParallelConfig
    order: str
    rank: int
    world_size: int
    mesh: DeviceMesh
    groups: dict[str, dist.ProcessGroup] = field(default_factory=dict)
    members: dict[str, list[int]] = field(default_factory=dict)
    spec: GroupSpec = field(default_factory=GroupSpec)
    loader_dp_group: dist.ProcessGroup | None = None
    reorder_group: dist.ProcessGroup | None = None
    reorder_size: int = 1
    encoder_p2p_group: dist.ProcessGroup | None = None
    hybrid_cp_groups: dict[tuple[int, int], dist.ProcessGroup] = field(default_factory=dict)
    checkpoint_group: dist.ProcessGroup | None = None
    encoder_sync_group: dist.ProcessGroup | None = None
    expert_dp_group: dist.ProcessGroup | None = None
    data_mesh: DeviceMesh | None = None
    timeout: timedelta | None = None

    @classmethod
    def build(
        cls,
        config: ParallelConfig,
        *,
        order: str = "tp-cp-ep-dp-pp",
        init_from_env: bool = False,
        backend: str | None = None,
        groups: GroupSpec | None = None,
        timeout: timedelta | None = None,
    ) -> ParallelState:
        """Create every group from the default process group (collective: all ranks must call it, with
        the same arguments: groups are created in one fixed order, see the module docstring).

        Args:
            config: axis sizes; ``dp=None`` is inferred from the world size.
            order: axis order, fastest first.
            init_from_env: if no default group exists, initialise one from ``torchrun``'s environment
                (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) with ``backend``.
            backend: for ``init_from_env``; default ``"nccl"`` if CUDA is available, else ``"gloo"``.
            groups: the optional groups to create as well (default: none).
            timeout: how long any collective of any group built here (the default group too, and the
                encoder groups of :meth:`encoder_state`) waits for the other ranks before it raises;
                ``None``: torch's defaults (30 minutes for gloo, 10 for NCCL). A rank that stops answering
                then fails the others in bounded time instead of hanging them.

        Raises:
            RuntimeError: no default process group and ``init_from_env`` is False or the environment
                lacks ``RANK``/``WORLD_SIZE``.
            ValueError: the sizes do not multiply to the world size (see ``ParallelConfig.resolve``), or
                the reordering group size does not divide ``dp``.
        """
        if not dist.is_initialized():
            if not init_from_env:
                raise RuntimeError(
                    "ParallelState.build needs a default process group: run under torchrun and pass "
                    "init_from_env=True, call dist.init_process_group first, or use run_world/fake_world"
                )
            missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
            if missing:
                raise RuntimeError(
                    f"init_from_env: environment variables {missing} are not set (torchrun sets them)"
                )
            dist.init_process_group(
                backend or ("nccl" if torch.cuda.is_available() else "gloo"), timeout=timeout
            )
        world_size = dist.get_world_size()
        rank = dist.get_rank()
        groups_spec = groups if groups is not None else GroupSpec()
        resolved = config.resolve(world_size)
        axes = mesh_axes(resolved, order)
        names = tuple(name for name, _ in reversed(axes))  # the mesh's last dimension varies fastest
        mesh = init_device_mesh(
            mesh_device_type(), tuple(size for _, size in reversed(axes)), mesh_dim_names=names
        )
        table = rank_groups(world_size, resolved, order)
        # Elementary axes come from the root mesh by name. The combined ones are created by enumeration:
        # flattening would slice the mesh, which imports torch._dynamo (seconds per process).
        # EP also spanning sequence-parallel ranks (ParallelConfig.ep_split) is no mesh axis: enumerated
        combined = _combined(resolved)
        axis_groups = {name: mesh.get_group(name) for name in GROUP_NAMES if name not in combined}
        for name in combined:
            # tp_cp over the ranks of one elementary axis (TP, Ulysses or CP alone, or none) is that
            # axis's group: no second communicator over the same ranks
            alias = next(
                (a for a in ("tp", "ulysses", "cp") if name == "tp_cp" and table[a] == table[name]), None
            )
            if alias is not None:
                axis_groups[name] = axis_groups[alias]
            else:
                axis_groups[name], _ = dist.new_subgroups_by_enumeration(table[name], timeout=timeout)
        axis_groups["encoder_dp"] = dist.group.WORLD
        if timeout is not None:
            # init_device_mesh takes no timeout (only per-backend options): set it on what it built, and
            # on the default group, which the mesh and encoder_dp may reuse
            for g in {id(g): g for g in [dist.group.WORLD, *axis_groups.values()]}.values():
                dist.set_timeout(timeout, g)
        members = {name: next(g for g in table[name] if rank in g) for name in GROUP_NAMES}
        members["encoder_dp"] = list(range(world_size))
        state = cls(
            resolved, order, rank, world_size, mesh, axis_groups, members, groups_spec, timeout=timeout
        )
        state._build_optional(table)
        return state

    def _build_optional(self, table: dict[str, list[list[int]]]) -> None:
        """The :class:`GroupSpec`'s groups, in the order of the module docstring (collective)."""
        spec, dp = self.spec, self.size("dp")
        if spec.loader_dp and dp > 1:
            self.loader_dp_group, _ = dist.new_subgroups_by_enumeration(table["dp"], timeout=self.timeout)
        size = spec.reorder_group_size
        size = default_reorder_group_size(self) if size is None else size
        if dp % size:
            raise ValueError(f"reordering group size {size} must divide the DP size {dp}")
        self.reorder_size = size
        if size > 1:
            blocks = [g[i : i + size] for g in table["dp"] for i in range(0, dp, size)]
            self.reorder_group, _ = dist.new_subgroups_by_enumeration(blocks, timeout=self.timeout)
        if spec.encoder_p2p and self.size("pp") > 1:
            self.encoder_p2p_group, _ = dist.new_subgroups_by_enumeration(table["pp"], timeout=self.timeout)
        if spec.hybrid_cp:
            local = self.local_rank("dp_cp")
            for c, blocks in hybrid_cp_blocks(self.size("dp_cp")).items():
                enumeration = [[g[i] for i in b] for g in table["dp_cp"] for b in blocks]
                mine, _ = dist.new_subgroups_by_enumeration(enumeration, timeout=self.timeout)
                self.hybrid_cp_groups[(c, local - local % c)] = mine
        if spec.expert_dp and self.config.ep > 1:
            edp = expert_groups(self.world_size, self.config, self.order)["edp"]
            if len(edp[0]) > 1:
                self.expert_dp_group, _ = dist.new_subgroups_by_enumeration(edp, timeout=self.timeout)
                self.members["edp"] = next(g for g in edp if self.rank in g)
        if spec.data_mesh and self.size("tp") > 1 and self.size("ep") == 1:
            names = self.mesh.mesh_dim_names or ()
            dims = tuple(n for n in names if n in ("dp_rest", "cp", "ulysses") and self.mesh[n].size() > 1)
            if len(dims) > 1:  # one new group over the dp_cp ranks, in the root mesh's order
                self.data_mesh = self.mesh[dims]._flatten("dp_cp")
                if self.timeout is not None:
                    dist.set_timeout(self.timeout, self.data_mesh.get_group())
            else:
                self.data_mesh = self.mesh[dims[0] if dims else "dp_rest"]
        if spec.encoder_sync and self.world_size > 1:
            self.encoder_sync_group = dist.new_group(timeout=self.timeout)
        if spec.checkpoint:
            self.checkpoint_group = dist.new_group(backend="gloo", timeout=self.timeout)

    def device_mesh(self, name: str) -> DeviceMesh:
        """1-D :class:`DeviceMesh` of group ``name`` (e.g. ``"tp"`` for ``parallelize_module``).

        Slicing the root mesh imports ``torch._dynamo``, so it is done on demand, not in :meth:`build`.
        """
        if name in _combined(self.config) or name == "encoder_dp":
            return DeviceMesh.from_group(self.group(name), self.mesh.device_type, mesh_dim_names=(name,))
        self._members(name)
        return self.mesh[name]

    # Sizes and this rank's index in each group.
    def size(self, name: str) -> int:
        """Size of group ``name``. Raises ``KeyError`` naming the valid names."""
        return len(self._members(name))

    def local_rank(self, name: str) -> int:
        """This rank's index in group ``name``."""
        return self._members(name).index(self.rank)

    def group(self, name: str) -> dist.ProcessGroup:
        """Process group ``name`` (one of ``GROUP_NAMES`` or ``"encoder_dp"``)."""
        self._members(name)
        return self.groups[name]

    def _members(self, name: str) -> list[int]:
        if name not in self.members:
            raise KeyError(f"unknown group {name!r}; known: {sorted(self.members)}")
        return self.members[name]

    @property
    def tp_group(self) -> dist.ProcessGroup:
        return self.groups["tp"]

    @property
    def cp_group(self) -> dist.ProcessGroup:
        return self.groups["cp"]

    @property
    def ulysses_group(self) -> dist.ProcessGroup:
        return self.groups["ulysses"]

    @property
    def ep_group(self) -> dist.ProcessGroup:
        return self.groups["ep"]

    @property
    def dp_group(self) -> dist.ProcessGroup:
        return self.groups["dp"]

    @property
    def pp_group(self) -> dist.ProcessGroup:
        return self.groups["pp"]

    @property
    def dp_cp_group(self) -> dist.ProcessGroup:
        return self.groups["dp_cp"]

    @property
    def encoder_dp_group(self) -> dist.ProcessGroup:
        """Every rank: encoder data parallelism spans pipeline ranks too."""
        return self.groups["encoder_dp"]

    # Pipeline neighbours.
    @property
    def pp_rank(self) -> int:
        """Stage index of this rank, 0 .. pp-1."""
        return self.local_rank("pp")

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.config.pp - 1

    @property
    def next_rank(self) -> int:
        """Global rank of the next stage; wraps around from the last stage to the first (as Megatron's
        ``get_pipeline_model_parallel_next_rank``, which interleaved schedules need)."""
        ranks = self.members["pp"]
        return ranks[(self.pp_rank + 1) % len(ranks)]

    @property
    def prev_rank(self) -> int:
        """Global rank of the previous stage; wraps around from the first stage to the last."""
        ranks = self.members["pp"]
        return ranks[(self.pp_rank - 1) % len(ranks)]

    def encoder_state(self, layout: EncoderLayout) -> EncoderState:
        """Build the encoders' groups over the same ranks (collective: all ranks must call it).

        Raises:
            ValueError: ``layout.sp`` does not divide the world size.
        """
        if self.world_size % layout.sp:
            raise ValueError(f"EncoderLayout.sp = {layout.sp} must divide the world size {self.world_size}")
        mesh = init_device_mesh(
            self.mesh.device_type, (self.world_size // layout.sp, layout.sp), mesh_dim_names=("edp", "esp")
        )
        if self.timeout is not None:
            for name in ("edp", "esp"):
                dist.set_timeout(self.timeout, mesh.get_group(name))
        return EncoderState(
            layout=layout,
            mesh=mesh,
            sp_group=mesh.get_group("esp"),
            dp_group=mesh.get_group("edp"),
            world_group=dist.group.WORLD,
            fsdp_mesh=DeviceMesh.from_group(
                dist.group.WORLD, self.mesh.device_type, mesh_dim_names=("encoder",)
            ),
            sp_rank=self.rank % layout.sp,
            dp_rank=self.rank // layout.sp,
        )

"""LLM pipeline schedules as data: per pipeline rank, an ordered list of compute actions.

Schedules: GPipe ("forward-then-backward", Huang et al. 2019; MegaScale-Omni §7 long-context lesson),
1F1B (PipeDream-flush, Narayanan et al. 2021) and interleaved 1F1B with virtual stages (Megatron-LM VPP,
Narayanan et al. 2021 §2.2; microbatch rounds as in torch's ``ScheduleInterleaved1F1B``). Stage ``s`` lives
on pipeline rank ``s % num_ranks``. Microbatch indices are torch's 0-based ones (see ``actions``).

Every schedule is checked by :meth:`Schedule.validate` (ours: each stage runs F and B of every microbatch
exactly once, B after F, no deadlock), then, where the installed torch has them, cross-checked by torch's
``_validate_schedule`` / ``_add_send_recv`` / ``_simulate_comms_compute`` on its :meth:`Schedule.to_torch`
projection. Those helpers are private (seen with the same positional arguments in torch 2.9 and 2.15), so
they are imported when used and their arity checked first; a torch without them only loses the
cross-check (see :meth:`Schedule.validate`'s ``torch_check``).
"""

from __future__ import annotations

import inspect
import warnings
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from enum import StrEnum
from functools import cache, cached_property

from omni_pipeline.actions import Action, ActionKind, ScheduleError
from omni_pipeline.graph import Deadlock, execution_order, llm_encoder_deps, vector_clocks

__all__ = [
    "Schedule",
    "Schedule1F1B",
    "ScheduleFromActions",
    "ScheduleGPipe",
    "ScheduleInterleaved1F1B",
    "ScheduleKind",
    "build_schedule",
    "validate_comms",
]

F, B = ActionKind.FORWARD, ActionKind.BACKWARD


class Schedule(ABC):
    """Base: a schedule over ``num_ranks`` pipeline ranks, ``num_microbatches`` LLM microbatches and
    ``virtual`` stages per rank (``num_stages = num_ranks * virtual``).

    ``num_stages=`` (keyword) may be given instead of ``num_ranks``, as in the issue's
    ``ScheduleGPipe(num_stages, num_microbatches)``: it is the total number of LLM stages, so
    ``num_ranks = num_stages // virtual`` (the same number for one stage per rank).

    Raises:
        ScheduleError: missing, non-int or non-positive sizes; ``num_stages`` not a multiple of
            ``virtual``, or disagreeing with ``num_ranks * virtual`` when both are given.
    """

    def __init__(
        self,
        num_ranks: int | None = None,
        num_microbatches: int | None = None,
        virtual: int = 1,
        *,
        num_stages: int | None = None,
    ) -> None:
        num_ranks = _ranks_from(type(self).__name__, num_ranks, num_stages, virtual)
        sizes = {"num_ranks": num_ranks, "num_microbatches": num_microbatches, "virtual": virtual}
        for name, value in sizes.items():
            if value is None:
                raise ScheduleError(f"{type(self).__name__}: {name} is required")
            if not isinstance(value, int) or isinstance(value, bool):
                raise ScheduleError(
                    f"{type(self).__name__}: {name} must be an int, got {type(value).__name__} {value!r}"
                )
        if num_ranks < 1 or num_microbatches < 1 or virtual < 1:
            raise ScheduleError(
                f"{type(self).__name__}: num_ranks, num_microbatches and virtual must be >= 1, got "
                f"{num_ranks}, {num_microbatches}, {virtual}"
            )
        self.num_ranks = num_ranks
        self.num_microbatches = num_microbatches
        self.virtual = virtual
        self.num_stages = num_ranks * virtual

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(num_ranks={self.num_ranks}, num_microbatches={self.num_microbatches}, "
            f"virtual={self.virtual})"
        )

    def stage_to_rank(self, stage: int) -> int:
        """Pipeline rank that holds ``stage`` (round-robin, as Megatron-LM and torch)."""
        return stage % self.num_ranks

    def rank_stages(self, rank: int) -> list[int]:
        """Stages held by ``rank``, lowest first."""
        return [rank + v * self.num_ranks for v in range(self.virtual)]

    @abstractmethod
    def _build(self, rank: int) -> list[Action]:
        """Compute actions of ``rank`` in execution order."""

    @cached_property
    def _programs(self) -> dict[int, tuple[Action, ...]]:
        return {r: tuple(self._build(r)) for r in range(self.num_ranks)}

    @cached_property
    def analysis(
        self,
    ) -> tuple[list[tuple[int, Action]], dict[Action, tuple[int, int]], dict[Action, list[int]]]:
        """``(order, where, clock)`` of the LLM actions: an execution order and vector clocks
        (``graph.vector_clocks``), computed once per schedule.

        Raises:
            Deadlock: the schedule cannot run.
        """
        deps = llm_encoder_deps(self.num_stages, {})
        order = execution_order(self._programs, deps)
        where, clock = vector_clocks(self._programs, deps, order)
        return order, where, clock

    def actions(self, rank: int) -> list[Action]:
        """Compute actions (F/B) of ``rank`` in execution order.

        Raises:
            ScheduleError: ``rank`` outside ``[0, num_ranks)``.
        """
        if not 0 <= rank < self.num_ranks:
            raise ScheduleError(f"{self!r}: rank {rank} out of range [0, {self.num_ranks})")
        return list(self._programs[rank])

    def programs(self) -> dict[int, list[Action]]:
        """``{rank: actions(rank)}`` for every rank (fresh lists)."""
        return {r: list(p) for r, p in self._programs.items()}

    @property
    def program_view(self) -> Mapping[int, tuple[Action, ...]]:
        """``{rank: actions}`` as the schedule's own read-only tuples (no copy)."""
        return self._programs

    def to_torch(self) -> dict[int, list]:
        """``{rank: [torch _Action, ...]}``, the compute-only IR torch's pipelining checkers take."""
        return {r: [a.to_torch() for a in p] for r, p in self._programs.items()}

    def with_comms(self) -> dict[int, list[Action]]:
        """Compute actions plus SEND/RECV actions, placed by torch's ``_add_send_recv``.

        Raises:
            ScheduleError: torch cannot place the communication (a malformed schedule).
            ImportError: the installed torch has no ``_add_send_recv`` taking these arguments (private API).
        """
        _, add_send_recv, _ = _torch_checkers("Schedule.with_comms")
        try:
            comm = add_send_recv(self.to_torch(), self.stage_to_rank, self.num_stages)
        except AssertionError as exc:
            raise ScheduleError(f"{self!r}: torch's _add_send_recv rejected the schedule: {exc}") from exc
        return {r: [Action.from_torch(a) for a in acts] for r, acts in comm.items()}

    def validate(self, torch_check: bool | None = None) -> None:
        """Check the schedule: actions on the right rank, each stage runs F then B of every microbatch
        exactly once, and the ranks can run their programs without deadlock. Then, once those rules
        hold, cross-check with torch's private pipelining checkers: ``_validate_schedule`` on
        :meth:`to_torch`, ``_add_send_recv`` places the SEND/RECV actions, ``_simulate_comms_compute``
        replays them, and :func:`validate_comms` checks the placement.

        Args:
            torch_check: ``None`` (default): cross-check when the installed torch has those helpers taking
                the arguments passed here; when it does not, only our rules are checked and a
                ``UserWarning`` says torch's cross-check was skipped and why (once per process under
                Python's default warning filter). ``True``: the cross-check is required. ``False``: our
                rules only.

        Raises:
            ScheduleError: names every violated rule with its rank, position and action; or torch's
                checkers reject a schedule our rules accept (the message quotes torch's).
            ImportError: ``torch_check=True`` and the installed torch lacks the helpers, or they take
                other arguments.
        """
        errors: list[str] = []
        seen: dict[Action, tuple[int, int]] = {}
        for r, prog in self._programs.items():
            for pos, a in enumerate(prog):
                where = f"rank {r} position {pos} action {a}"
                if a.kind not in (F, B):
                    errors.append(f"{where}: only F/B compute actions belong in a schedule")
                    continue
                if not 0 <= a.stage < self.num_stages:
                    errors.append(f"{where}: stage {a.stage} out of range [0, {self.num_stages})")
                    continue
                if self.stage_to_rank(a.stage) != r:
                    errors.append(f"{where}: stage {a.stage} belongs to rank {self.stage_to_rank(a.stage)}")
                if not 0 <= a.microbatch < self.num_microbatches:
                    errors.append(
                        f"{where}: microbatch {a.microbatch} out of range [0, {self.num_microbatches})"
                    )
                if a in seen:
                    errors.append(f"{where}: runs twice (also rank {seen[a][0]} position {seen[a][1]})")
                    continue
                seen[a] = (r, pos)
                if a.kind == B:
                    fwd = Action(F, a.microbatch, a.stage)
                    if fwd not in seen:
                        errors.append(
                            f"{where}: backward of stage {a.stage} microbatch {a.microbatch} before its forward"
                        )
        for s in range(self.num_stages):
            for i in range(self.num_microbatches):
                for kind in (F, B):
                    a = Action(kind, i, s)
                    if a not in seen:
                        errors.append(
                            f"missing action {a} (stage {s}, microbatch {i}) on rank {self.stage_to_rank(s)}"
                        )
        if not errors:
            try:
                self.analysis  # noqa: B018 - computes (and caches) the execution order
            except Deadlock as exc:
                errors.append(str(exc))
        if errors:
            raise ScheduleError(f"{self!r} is invalid:\n  " + "\n  ".join(errors))
        if torch_check is False:
            return
        if torch_check:
            checkers = _torch_checkers("Schedule.validate(torch_check=True)")
        else:
            checkers, why = _probe_torch_checkers()
            if checkers is None:
                # stacklevel=1 and a text fixed per process: the default filter shows it once
                warnings.warn(
                    f"Schedule.validate: torch's pipelining cross-check skipped, only omni-pipeline's "
                    f"rules checked: {why}",
                    stacklevel=1,
                )
                return
        self._torch_cross_check(*checkers)

    def _torch_cross_check(self, validate_schedule, add_send_recv, simulate_comms_compute) -> None:
        try:
            validate_schedule(self.to_torch(), self.num_ranks, self.num_stages, self.num_microbatches)
            comms = add_send_recv(self.to_torch(), self.stage_to_rank, self.num_stages)
            simulate_comms_compute(comms, self.stage_to_rank, self.num_stages)
        except (AssertionError, ValueError, RuntimeError) as exc:
            raise ScheduleError(
                f"{self!r} passes our rules but torch's pipelining checkers reject it: {exc}"
            ) from exc
        validate_comms({r: [Action.from_torch(a) for a in acts] for r, acts in comms.items()}, self)


# torch.distributed.pipelining.schedules' private checkers and the positional arguments passed to them
_TORCH_CHECKERS = (
    ("_validate_schedule", 4),  # (actions, pp_group_size, num_stages, num_microbatches)
    ("_add_send_recv", 3),  # (compute_actions, stage_to_rank, num_stages)
    ("_simulate_comms_compute", 3),  # (pipeline_order, stage_to_rank, num_stages)
)


@cache  # describes the installed torch, which cannot change within a process
def _probe_torch_checkers() -> tuple[tuple | None, str]:
    """``(checkers, "")``: torch's private checkers in ``_TORCH_CHECKERS`` order, or ``(None, why)`` when
    this torch lacks one of them (or ``_Action`` / ``_ComputationType.from_str``, which
    :meth:`Action.to_torch` needs) or one takes other arguments."""
    try:
        import torch
        from torch.distributed.pipelining import schedules as tps
    except ImportError as exc:
        return None, f"torch.distributed.pipelining does not import ({exc})"
    where = f"torch {torch.__version__}'s torch.distributed.pipelining.schedules"
    if not hasattr(tps, "_Action") or not hasattr(getattr(tps, "_ComputationType", None), "from_str"):
        return None, f"{where} has no _Action or _ComputationType.from_str"
    found = []
    for name, arity in _TORCH_CHECKERS:
        fn = getattr(tps, name, None)
        if not callable(fn):
            return None, f"{where} has no {name}"
        try:
            inspect.signature(fn).bind(*range(arity))
        except (TypeError, ValueError):
            return None, f"{where}.{name} does not take the {arity} positional arguments omni-pipeline passes"
        found.append(fn)
    return tuple(found), ""


def _torch_checkers(caller: str) -> tuple:
    """torch's private checkers for a caller that needs them.

    Raises:
        ImportError: the installed torch lacks them or they take other arguments.
    """
    checkers, why = _probe_torch_checkers()
    if checkers is None:
        raise ImportError(
            f"{caller} needs torch's private pipelining helpers, but {why}; "
            "omni-pipeline's own checks (Schedule.validate(torch_check=False), validate_comms) need none"
        )
    return checkers


def _ranks_from(name: str, num_ranks: int | None, num_stages: int | None, virtual: int) -> int | None:
    """``num_ranks`` from the ``num_stages=`` keyword (total LLM stages = ranks * virtual)."""
    if num_stages is None:
        return num_ranks
    if not isinstance(num_stages, int) or isinstance(num_stages, bool) or num_stages < 1:
        raise ScheduleError(f"{name}: num_stages must be an int >= 1, got {num_stages!r}")
    if isinstance(virtual, int) and virtual >= 1 and num_stages % virtual:
        raise ScheduleError(f"{name}: num_stages {num_stages} is not a multiple of virtual {virtual}")
    ranks = num_stages // virtual if isinstance(virtual, int) and virtual >= 1 else num_stages
    if num_ranks is not None and num_ranks != ranks:
        raise ScheduleError(
            f"{name}: num_ranks {num_ranks} disagrees with num_stages {num_stages} / virtual {virtual}"
        )
    return ranks


class ScheduleGPipe(Schedule):
    """GPipe: every rank runs all forwards (stage order), then all backwards (Huang et al. 2019)."""

    def _build(self, rank: int) -> list[Action]:
        stages = self.rank_stages(rank)
        mk = Action.unchecked
        fwd = [mk(F, i, s) for s in stages for i in range(self.num_microbatches)]
        bwd = [mk(B, i, s) for s in reversed(stages) for i in range(self.num_microbatches)]
        return fwd + bwd


class Schedule1F1B(Schedule):
    """1F1B (PipeDream-flush): rank r runs ``min(P-1-r, M)`` warmup forwards, then alternates one
    forward and one backward, then drains the backwards. Works for any ``M >= 1`` (also ``M < P``)."""

    def __init__(
        self,
        num_ranks: int | None = None,
        num_microbatches: int | None = None,
        virtual: int = 1,
        *,
        num_stages: int | None = None,
    ) -> None:
        if virtual != 1:
            raise ScheduleError(
                f"Schedule1F1B has one stage per rank; use ScheduleInterleaved1F1B for virtual={virtual}"
            )
        super().__init__(num_ranks, num_microbatches, 1, num_stages=num_stages)

    def _build(self, rank: int) -> list[Action]:
        m = self.num_microbatches
        warmup = min(self.num_ranks - 1 - rank, m)
        out = [Action(F, i, rank) for i in range(warmup)]
        for j in range(m - warmup):
            out.append(Action(F, warmup + j, rank))
            out.append(Action(B, j, rank))
        out.extend(Action(B, j, rank) for j in range(m - warmup, m))
        return out


class ScheduleInterleaved1F1B(Schedule):
    """Interleaved 1F1B over ``virtual`` stages per rank (Megatron-LM VPP, depth-first).

    Microbatches run in rounds of ``M // max(1, M // P)``; rank r warms up with
    ``min((v-1) * round + 2 * (P-1-r), M * v)`` forwards (as torch's ``ScheduleInterleaved1F1B``).

    ``num_stages=`` counts every virtual stage: ``ScheduleInterleaved1F1B(num_stages=8, num_microbatches=8,
    virtual=2)`` runs on 4 ranks.

    Raises:
        ScheduleError: ``M`` is not a multiple of the number of rounds ``max(1, M // P)``.
    """

    def __init__(
        self,
        num_ranks: int | None = None,
        num_microbatches: int | None = None,
        virtual: int = 2,
        *,
        num_stages: int | None = None,
    ) -> None:
        super().__init__(num_ranks, num_microbatches, virtual, num_stages=num_stages)
        num_ranks, num_microbatches = self.num_ranks, self.num_microbatches
        self.rounds = max(1, num_microbatches // num_ranks)
        if num_microbatches % self.rounds:
            raise ScheduleError(
                f"ScheduleInterleaved1F1B: {num_microbatches} microbatches is not a multiple of the "
                f"{self.rounds} rounds (= max(1, microbatches // ranks {num_ranks})); pick a multiple"
            )
        self.per_round = num_microbatches // self.rounds

    def _build(self, rank: int) -> list[Action]:
        p, v, m, per = self.num_ranks, self.virtual, self.num_microbatches, self.per_round
        total = m * v
        warmup = min((v - 1) * per + 2 * (p - 1 - rank), total)
        next_f = [0] * v
        next_b = [0] * v

        def fwd(op: int) -> Action:
            local = (op // per) % v
            next_f[local] += 1
            return Action(F, next_f[local] - 1, local * p + rank)

        def bwd(op: int) -> Action:
            local = v - 1 - ((op - warmup) // per) % v
            next_b[local] += 1
            return Action(B, next_b[local] - 1, local * p + rank)

        out = [fwd(op) for op in range(warmup)]
        for op in range(warmup, total):
            out.append(fwd(op))
            out.append(bwd(op))
        out.extend(bwd(op) for op in range(total, total + warmup))
        return out


class ScheduleFromActions(Schedule):
    """A schedule given explicitly, e.g. parsed from ``{rank: ["0F0", "0B0", ...]}``.

    Not validated on construction: call :meth:`validate`.
    """

    def __init__(
        self,
        num_ranks: int,
        num_microbatches: int,
        actions: Mapping[int, Sequence[str | Action]],
        virtual: int = 1,
    ) -> None:
        super().__init__(num_ranks, num_microbatches, virtual)
        if sorted(actions) != list(range(num_ranks)):
            raise ScheduleError(f"ScheduleFromActions: ranks {sorted(actions)} != 0..{num_ranks - 1}")
        self._given = {
            r: [a if isinstance(a, Action) else Action.parse(a) for a in acts] for r, acts in actions.items()
        }

    def _build(self, rank: int) -> list[Action]:
        return list(self._given[rank])


class ScheduleKind(StrEnum):
    """Names of the LLM schedules (for configs and command lines): ``1f1b`` (PipeDream-flush),
    ``gpipe`` (all forwards, then all backwards; looped over virtual stages), ``interleaved``
    (interleaved 1F1B over virtual stages, Megatron-LM VPP)."""

    ONE_F_ONE_B = "1f1b"
    GPIPE = "gpipe"
    INTERLEAVED = "interleaved"


def build_schedule(
    kind: ScheduleKind | str, num_ranks: int, num_microbatches: int, virtual: int = 1
) -> Schedule:
    """The schedule named ``kind`` over ``num_ranks`` pipeline ranks, ``num_microbatches`` LLM
    microbatches and ``virtual`` stages per rank.

    Raises:
        ValueError: an unknown ``kind`` (naming the known ones).
        ScheduleError: sizes the schedule cannot run (e.g. ``1f1b`` with ``virtual > 1``, or no
            microbatches).
    """
    known = [str(k) for k in ScheduleKind]
    if kind not in known:
        raise ValueError(f"{kind!r} is not a valid ScheduleKind (build_schedule kind: one of {known})")
    kind = ScheduleKind(kind)
    if kind is ScheduleKind.GPIPE:
        return ScheduleGPipe(num_ranks, num_microbatches, virtual)
    if kind is ScheduleKind.INTERLEAVED:
        return ScheduleInterleaved1F1B(num_ranks, num_microbatches, virtual)
    return Schedule1F1B(num_ranks, num_microbatches, virtual)


def validate_comms(comm_actions: Mapping[int, Sequence[Action]], schedule: Schedule) -> None:
    """Check a schedule with communication: every SEND has the matching RECV on the peer rank and
    vice versa, on the rank that holds the peer stage, and each send follows the compute it sends.

    Raises:
        ScheduleError: names every unmatched or misplaced SEND/RECV action with its rank.
    """
    errors: list[str] = []
    peer_kind = {
        ActionKind.SEND_F: (ActionKind.RECV_F, 1),
        ActionKind.SEND_B: (ActionKind.RECV_B, -1),
        ActionKind.RECV_F: (ActionKind.SEND_F, -1),
        ActionKind.RECV_B: (ActionKind.SEND_B, 1),
    }
    present = {(r, a) for r, acts in comm_actions.items() for a in acts}
    for r, acts in comm_actions.items():
        done: set[Action] = set()
        for pos, a in enumerate(acts):
            done.add(a)
            if a.kind not in peer_kind:
                continue
            where = f"rank {r} position {pos} action {a}"
            if schedule.stage_to_rank(a.stage) != r:
                errors.append(f"{where}: stage {a.stage} is on rank {schedule.stage_to_rank(a.stage)}")
            kind, step = peer_kind[a.kind]
            peer_stage = a.stage + step
            if not 0 <= peer_stage < schedule.num_stages:
                errors.append(f"{where}: no stage {peer_stage} to talk to")
                continue
            peer = Action(kind, a.microbatch, peer_stage)
            peer_rank = schedule.stage_to_rank(peer_stage)
            if (peer_rank, peer) not in present:
                side = "receive" if a.kind in (ActionKind.SEND_F, ActionKind.SEND_B) else "send"
                errors.append(f"{where}: no matching {side} {peer} on rank {peer_rank}")
            if a.kind in (ActionKind.SEND_F, ActionKind.SEND_B):
                src = Action(F if a.kind == ActionKind.SEND_F else B, a.microbatch, a.stage)
                if src not in done:
                    errors.append(f"{where}: sends before its compute {src} ran")
    if errors:
        raise ScheduleError("communication plan is invalid:\n  " + "\n  ".join(errors))

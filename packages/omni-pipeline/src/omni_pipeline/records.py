"""Measured per-action records of real pipeline steps: what the trainer writes, what calibration reads.

One JSON object per line (JSONL) in ``<run dir>/actions.jsonl`` (:data:`RECORDS_FILE`), each with a
``"type"``:

* ``"action"`` (:class:`ActionRecord`): one compute action of one step on one pipeline rank: ``kind``
  (``F``/``B``/``EF``/``EB``), ``stage`` (LLM actions; ``null`` for encoder actions), ``microbatch``
  (torch's 0-based index for LLM actions, the encoder microbatch id ``e >= 1`` for encoder actions, as
  :class:`~omni_pipeline.actions.Action`), ``tokens`` / ``tokens_sq`` per module (``{"llm": T}``,
  ``{"image": patches, "audio": frames}``; see :class:`~omni_pipeline.cost.TokenCost`), ``start_s`` /
  ``end_s`` from the executor's step start, and ``wait_s``: seconds the rank blocked on receives between
  the previous action's end and this action's start.
* ``"p2p"`` (:class:`P2PRecord`): one point-to-point message: ``src`` / ``dst`` pipeline ranks, ``what``
  (``activation``, ``gradient``, ``encoder_output``, ``encoder_gradient``), ``microbatch``, ``bytes``,
  ``wait_s`` (the receiver's blocked time) and ``transfer_s`` (send posted to receive complete on one
  clock, e.g. ``time.perf_counter`` on one host; only meaningful when the receiver blocked, else
  ``null``).
* ``"step"`` (:class:`StepRecord`): one step on one rank: ``step_s`` (wall time of the whole training
  step, data to optimizer), ``actions_end_s`` (end of the rank's last action, from the executor's
  step start) and ``cpu_s`` (the rank's process CPU seconds, user + system of all its threads, over the
  same interval as ``step_s``: ``time.process_time``) and ``pipeline_cpu_s`` (the same over the executor's
  step within it: the actions, their dispatch and receives, and the gradient reduction after them; so
  ``cpu_s - pipeline_cpu_s`` is the CPU of the time outside the pipeline: data, clipping, optimizer,
  metrics); both ``null`` or absent in records written before they were recorded. ``checkpoint_save``:
  ``true`` when a checkpoint save was in flight at any time during the step's CPU interval (the
  trainer's synchronous save, or an async save's staging and writing thread: ``time.process_time``
  counts every thread, so its CPU lands in ``cpu_s``); ``null`` or absent in records written before it
  was recorded (unknown: readers treat such a step as unmarked).
* ``"flow"`` (:class:`FlowRecord`): the data flow one step ran, when the flow changes from step to step
  (a placement planned per step): ``flow``, :meth:`DataFlow.to_json`'s text.

Run directories are untrusted input: lines are bounded in length and count, every field is type-checked,
and an error names the file, the line and the field.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed as dist

from omni_pipeline.actions import Action, ActionKind, flow_index
from omni_pipeline.cost import ActionTokens
from omni_pipeline.dataflow import DataFlow
from omni_pipeline.trace import TimelineEvent

__all__ = [
    "RECORDS_FILE",
    "ActionRecord",
    "FlowRecord",
    "P2PRecord",
    "RecordError",
    "RecordWriter",
    "RunRecords",
    "StepRecord",
    "action_records",
    "gather_step_records",
    "read_records",
]

RECORDS_FILE = "actions.jsonl"
MAX_LINE_BYTES = 1 << 20
MAX_LINES = 10_000_000
P2P_KINDS = ("activation", "gradient", "encoder_output", "encoder_gradient")


class RecordError(ValueError):
    """A records file is malformed; the message names the file, the line and the field."""


@dataclass(frozen=True)
class ActionRecord:
    """One measured compute action (see the module docstring for the fields' units)."""

    step: int
    rank: int
    kind: str
    stage: int | None
    microbatch: int
    tokens: Mapping[str, int]
    tokens_sq: Mapping[str, int]
    start_s: float
    end_s: float
    wait_s: float = 0.0

    @property
    def seconds(self) -> float:
        """Compute seconds: ``end_s - start_s``."""
        return self.end_s - self.start_s

    @property
    def action(self) -> Action:
        """The :class:`~omni_pipeline.actions.Action` this record measured."""
        return Action(ActionKind(self.kind), self.microbatch, self.stage)


@dataclass(frozen=True)
class P2PRecord:
    """One measured point-to-point message (see the module docstring)."""

    step: int
    src: int
    dst: int
    what: str
    microbatch: int
    bytes: int
    wait_s: float
    transfer_s: float | None = None


@dataclass(frozen=True)
class StepRecord:
    """One step on one rank: whole-step wall seconds, the end of its last pipeline action and its
    process's CPU seconds over the step and over the executor's step within it (``None``: not
    recorded); ``checkpoint_save``: a checkpoint save (synchronous, or an async save's staging and
    writing thread) was in flight at some time during the step's CPU interval (``None``: not recorded,
    records written before it was; treated as unmarked by :func:`omni_pipeline.calibrate.fit_process_cpu`)."""

    step: int
    rank: int
    step_s: float
    actions_end_s: float
    cpu_s: float | None = None
    pipeline_cpu_s: float | None = None
    checkpoint_save: bool | None = None


@dataclass(frozen=True)
class FlowRecord:
    """The data flow of one step (see the module docstring): ``flow`` is ``DataFlow.to_json()``."""

    step: int
    flow: str

    @property
    def data_flow(self) -> DataFlow:
        """The parsed :class:`~omni_pipeline.dataflow.DataFlow`."""
        return DataFlow.from_json(self.flow)


Record = ActionRecord | P2PRecord | StepRecord | FlowRecord


@dataclass
class RunRecords:
    """Everything a records file holds, by type, in file order."""

    actions: list[ActionRecord] = field(default_factory=list)
    p2p: list[P2PRecord] = field(default_factory=list)
    steps: list[StepRecord] = field(default_factory=list)
    flows: list[FlowRecord] = field(default_factory=list)
    # (the flows list it was built from, its length then, {step: its last flow record}): rebuilt when
    # ``flows`` is another list or has grown
    _flow_index: tuple[list[FlowRecord], int, dict[int, FlowRecord]] | None = field(
        default=None, init=False, repr=False, compare=False
    )

    def add(self, record: Record) -> None:
        kinds = {
            ActionRecord: self.actions,
            P2PRecord: self.p2p,
            StepRecord: self.steps,
            FlowRecord: self.flows,
        }
        kinds[type(record)].append(record)

    def from_step(self, first: int) -> RunRecords:
        """Only the records of steps ``>= first`` (e.g. to drop warm-up steps)."""
        return RunRecords(
            [r for r in self.actions if r.step >= first],
            [r for r in self.p2p if r.step >= first],
            [r for r in self.steps if r.step >= first],
            [r for r in self.flows if r.step >= first],
        )

    def flow(self, step: int) -> DataFlow | None:
        """The data flow recorded for ``step`` (the last one if a resumed run recorded it again), or
        ``None`` (a run whose one flow is in its ``dataflow.json``). Looked up in an index of the flow
        records by step, rebuilt only when records were added or ``flows`` was replaced since (so a pass
        over every step of a long run stays linear)."""
        index = self._flow_index
        if index is None or index[0] is not self.flows or index[1] != len(self.flows):
            self._flow_index = index = (self.flows, len(self.flows), {r.step: r for r in self.flows})
        got = index[2].get(step)  # later records won in the dict
        return got.data_flow if got is not None else None

    @property
    def step_ids(self) -> list[int]:
        """Sorted distinct steps with any record."""
        return sorted({r.step for r in (*self.actions, *self.p2p, *self.steps, *self.flows)})


def action_records(
    step: int,
    timeline: Iterable[TimelineEvent],
    llm_tokens: Mapping[int, ActionTokens],
    encoder_tokens: Mapping[int, ActionTokens],
    waits: Mapping[str, float] | None = None,
) -> list[ActionRecord]:
    """Records of one step from a rank's timeline (``PipelineExecutor``'s ``StepResult.timeline`` or a
    simulated one) and the step's token counts.

    Args:
        step: the training step.
        timeline: the rank's events (``TimelineEvent.action`` like ``"0F1"`` or ``"EF3"``).
        llm_tokens: ``{k: ActionTokens}`` per LLM microbatch ``k`` (from 1).
        encoder_tokens: ``{e: ActionTokens}`` per encoder microbatch.
        waits: ``{action: seconds}`` the rank blocked on receives before each action (missing: 0).

    Raises:
        KeyError: an action whose microbatch has no token counts.
    """
    out = []
    for ev in timeline:
        a = Action.parse(ev.action)
        toks = encoder_tokens[a.microbatch] if a.kind.is_encoder else llm_tokens[flow_index(a.microbatch)]
        tokens = {m: int(n) for m, (n, _) in toks.modules.items()}
        tokens_sq = {m: int(sq) for m, (_, sq) in toks.modules.items()}
        wait = float((waits or {}).get(ev.action, 0.0))
        out.append(
            ActionRecord(
                step,
                ev.rank,
                str(a.kind),
                a.stage,
                a.microbatch,
                tokens,
                tokens_sq,
                ev.start_s,
                ev.end_s,
                wait,
            )
        )
    return out


def gather_step_records(
    step: int,
    result: Any,
    llm_tokens: Mapping[int, ActionTokens],
    encoder_tokens: Mapping[int, ActionTokens],
    *,
    wall_s: float,
    pp_rank: int,
    pp_group: dist.ProcessGroup | None,
    flow: DataFlow | None = None,
    cpu_s: tuple[float, float] | None = None,
    checkpoint_save: bool | None = None,
) -> list[Record] | None:
    """One step's records of every rank of a pipeline, gathered to the pipeline's first rank.

    Each rank turns its ``result`` (a :class:`~omni_pipeline.PipelineExecutor` ``StepResult``: its
    ``timeline``, ``waits`` and ``p2p``) into action records (:func:`action_records`), its receives and
    one :class:`StepRecord` (``wall_s``: the whole training step's wall time, seconds; ``cpu_s``: the
    rank's process CPU seconds over it and over the executor's step within it, ``time.process_time``,
    or ``None``; ``checkpoint_save``: a save was in flight during the step's CPU interval, see
    :class:`StepRecord`); ``flow``, given on
    pipeline rank 0 when the data flow changes from step to step, adds a :class:`FlowRecord`. Collective
    over ``pp_group`` (``gather_object``; ``None`` for pp=1).

    Returns:
        On the pipeline's first rank, every rank's records in pipeline-rank order (what
        :class:`RecordWriter` writes); ``None`` on the others.

    Raises:
        KeyError: an action whose microbatch has no token counts.
    """
    mine: list[Record] = list(action_records(step, result.timeline, llm_tokens, encoder_tokens, result.waits))
    end = max((ev.end_s for ev in result.timeline), default=0.0)
    mine += [*result.p2p, StepRecord(step, pp_rank, wall_s, end, *(cpu_s or (None, None)), checkpoint_save)]
    if flow is not None:
        mine.append(FlowRecord(step, flow.to_json()))
    if pp_group is None or dist.get_world_size(pp_group) == 1:
        return mine
    first = dist.get_global_rank(pp_group, 0)
    gathered: list[Any] | None = [None] * dist.get_world_size(pp_group) if dist.get_rank() == first else None
    dist.gather_object(mine, gathered, dst=first, group=pp_group)
    return None if gathered is None else [r for rank in gathered for r in rank]


_TYPES = {"action": ActionRecord, "p2p": P2PRecord, "step": StepRecord, "flow": FlowRecord}
_NAMES = {v: k for k, v in _TYPES.items()}


def _to_json(record: Record) -> str:
    return json.dumps({"type": _NAMES[type(record)], **asdict(record)}, sort_keys=True)


class RecordWriter:
    """Appends records to a JSONL file (one per line, flushed per :meth:`write` call).

    Args:
        path: the file (parent directories are created); appended to if it exists.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = self.path.open("a", encoding="utf-8")

    def write(self, records: Iterable[Record]) -> None:
        """Append ``records`` and flush."""
        for r in records:
            self._f.write(_to_json(r) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> RecordWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _int(obj: Mapping[str, Any], name: str, where: str, *, optional: bool = False) -> int | None:
    v = obj.get(name)
    if v is None and optional:
        return None
    if not isinstance(v, int) or isinstance(v, bool):
        raise RecordError(f"{where}: field {name!r} must be an integer, got {v!r}")
    return v


def _float(obj: Mapping[str, Any], name: str, where: str, *, optional: bool = False) -> float | None:
    v = obj.get(name)
    if v is None and optional:
        return None
    if not isinstance(v, int | float) or isinstance(v, bool) or not math.isfinite(v):
        raise RecordError(f"{where}: field {name!r} must be a finite number, got {v!r}")
    return float(v)


def _bool(obj: Mapping[str, Any], name: str, where: str) -> bool | None:
    """An optional boolean field: ``None`` when absent or ``null``."""
    v = obj.get(name)
    if v is not None and not isinstance(v, bool):
        raise RecordError(f"{where}: field {name!r} must be true, false or null, got {v!r}")
    return v


def _counts(obj: Mapping[str, Any], name: str, where: str) -> dict[str, int]:
    v = obj.get(name)
    if not isinstance(v, dict) or len(v) > 64:
        raise RecordError(f"{where}: field {name!r} must be an object {{module: count}}, got {v!r}")
    out = {}
    for k, n in v.items():
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise RecordError(f"{where}: {name}[{k!r}] must be an integer >= 0, got {n!r}")
        out[str(k)] = n
    return out


def _parse(obj: Any, where: str) -> Record:
    if not isinstance(obj, dict):
        raise RecordError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    kind = obj.get("type")
    if kind not in _TYPES:
        raise RecordError(f"{where}: field 'type' must be one of {sorted(_TYPES)}, got {kind!r}")
    cls = _TYPES[kind]
    allowed = {"type", *cls.__dataclass_fields__}
    unknown = sorted(set(obj) - allowed)
    if unknown:
        raise RecordError(f"{where}: unknown field {unknown[0]!r} in a {kind!r} record")
    if cls is ActionRecord:
        k = obj.get("kind")
        if k not in ("F", "B", "EF", "EB"):
            raise RecordError(f"{where}: field 'kind' must be F, B, EF or EB, got {k!r}")
        stage = _int(obj, "stage", where, optional=True)
        if (stage is None) != (k in ("EF", "EB")):
            raise RecordError(
                f"{where}: {k} records {'must not' if k in ('EF', 'EB') else 'must'} have a stage"
            )
        rec = ActionRecord(
            step=_int(obj, "step", where),
            rank=_int(obj, "rank", where),
            kind=k,
            stage=stage,
            microbatch=_int(obj, "microbatch", where),
            tokens=_counts(obj, "tokens", where),
            tokens_sq=_counts(obj, "tokens_sq", where),
            start_s=_float(obj, "start_s", where),
            end_s=_float(obj, "end_s", where),
            wait_s=_float(obj, "wait_s", where) if "wait_s" in obj else 0.0,
        )
        try:
            rec.action  # noqa: B018 - checks stage / microbatch numbering
        except ValueError as exc:
            raise RecordError(f"{where}: {exc}") from None
        if rec.end_s < rec.start_s or rec.wait_s < 0:
            raise RecordError(
                f"{where}: end_s < start_s or wait_s < 0 ({rec.start_s}, {rec.end_s}, {rec.wait_s})"
            )
        return rec
    if cls is P2PRecord:
        what = obj.get("what")
        if what not in P2P_KINDS:
            raise RecordError(f"{where}: field 'what' must be one of {list(P2P_KINDS)}, got {what!r}")
        rec = P2PRecord(
            step=_int(obj, "step", where),
            src=_int(obj, "src", where),
            dst=_int(obj, "dst", where),
            what=what,
            microbatch=_int(obj, "microbatch", where),
            bytes=_int(obj, "bytes", where),
            wait_s=_float(obj, "wait_s", where),
            transfer_s=_float(obj, "transfer_s", where, optional=True),
        )
        if rec.bytes < 0 or rec.wait_s < 0 or (rec.transfer_s is not None and rec.transfer_s < 0):
            raise RecordError(f"{where}: bytes, wait_s and transfer_s must be >= 0")
        return rec
    if cls is FlowRecord:
        text = obj.get("flow")
        if not isinstance(text, str):
            raise RecordError(f"{where}: field 'flow' must be a data flow's JSON text, got {text!r}")
        flow = FlowRecord(step=_int(obj, "step", where), flow=text)
        try:
            flow.data_flow  # noqa: B018 - checks the flow parses
        except ValueError as exc:  # DataFlowError
            raise RecordError(f"{where}: field 'flow': {exc}") from None
        return flow
    rec = StepRecord(
        step=_int(obj, "step", where),
        rank=_int(obj, "rank", where),
        step_s=_float(obj, "step_s", where),
        actions_end_s=_float(obj, "actions_end_s", where),
        cpu_s=_float(obj, "cpu_s", where, optional=True),
        pipeline_cpu_s=_float(obj, "pipeline_cpu_s", where, optional=True),
        checkpoint_save=_bool(obj, "checkpoint_save", where),
    )
    cpus = [x for x in (rec.cpu_s, rec.pipeline_cpu_s) if x is not None]
    if rec.step_s < 0 or rec.actions_end_s < 0 or any(x < 0 for x in cpus):
        raise RecordError(f"{where}: step_s, actions_end_s, cpu_s and pipeline_cpu_s must be >= 0")
    # the executor's step lies within the training step: its CPU seconds cannot exceed the step's (a
    # nanosecond of slack for the two clock differences' rounding)
    if len(cpus) == 2 and rec.pipeline_cpu_s > rec.cpu_s + 1e-9 * max(1.0, rec.cpu_s):
        raise RecordError(
            f"{where}: field 'pipeline_cpu_s' of rank {rec.rank} step {rec.step} is {rec.pipeline_cpu_s!r}, more"
            f" than its cpu_s {rec.cpu_s!r} (the executor's step lies within the training step)"
        )
    return rec


def read_records(path: str | Path) -> RunRecords:
    """Read a records file (or ``<dir>/actions.jsonl`` when ``path`` is a directory).

    Raises:
        FileNotFoundError: no such file (names it).
        RecordError: a line that is too long, not JSON, or a record with a missing, unknown or mistyped
            field; more than ``MAX_LINES`` lines (names the file, line and field).
    """
    p = Path(path)
    if p.is_dir():
        p = p / RECORDS_FILE
    if not p.is_file():
        raise FileNotFoundError(f"records file {p} does not exist")
    out = RunRecords()
    with p.open("rb") as f:
        for n, raw in enumerate(f, start=1):
            where = f"{p}:{n}"
            if n > MAX_LINES:
                raise RecordError(f"{where}: more than {MAX_LINES} records")
            if len(raw) > MAX_LINE_BYTES:
                raise RecordError(f"{where}: line longer than {MAX_LINE_BYTES} bytes")
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise RecordError(f"{where}: not JSON: {exc}") from None
            out.add(_parse(obj, where))
    return out

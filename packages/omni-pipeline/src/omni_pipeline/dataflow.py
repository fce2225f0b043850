"""Data flow: where each encoder microbatch runs inside the LLM pipeline schedule.

The paper's JSON-like map (MegaScale-Omni, unified encoder representation): key ``+e`` is the forward and
``-e`` the backward of encoder microbatch ``e``; value ``(pp, [left, right])`` runs it on pipeline rank
``pp`` after LLM action ``left`` and before ``right``, where ``+k`` / ``-k`` are that rank's forward /
backward of LLM microbatch ``k`` (numbered from 1, ``k = torch index + 1``) and ``0`` is the start (as
``left``) or the end (as ``right``). ``left`` and ``right`` must be adjacent on that rank. Under virtual
stages, ``+k`` / ``-k`` name the rank's actions on its first (lowest) stage, and the encoder action runs
immediately before ``right`` (at the very end when ``right`` is 0). Encoder actions placed at the same
point run in the order of the map.

``encoder_inputs`` says which LLM microbatch consumes which encoder microbatches: ``{k: [e, ...]}``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

from omni_pipeline.actions import Action, ActionKind, flow_index
from omni_pipeline.graph import Deadlock, execution_order, happens_before, llm_encoder_deps
from omni_pipeline.schedules import Schedule

__all__ = ["DataFlow", "DataFlowError", "Position"]

Position = tuple[int, tuple[int, int]]
F, B = ActionKind.FORWARD, ActionKind.BACKWARD
EF, EB = ActionKind.ENCODER_FORWARD, ActionKind.ENCODER_BACKWARD


class DataFlowError(ValueError):
    """A data flow breaks rules; ``errors`` lists each violated rule (the message joins them)."""

    def __init__(self, errors: Sequence[str]) -> None:
        self.errors = list(errors)
        super().__init__("invalid data flow:\n  " + "\n  ".join(self.errors))


def _key(signed_e: int) -> str:
    return f"+{signed_e}" if signed_e > 0 else str(signed_e)


class DataFlow:
    """Map from signed encoder microbatch (``+e`` forward, ``-e`` backward) to ``(pp, (left, right))``.

    Args:
        entries: ``{+e or -e: (pp, (left, right))}``; iteration order is run order within one point.
        encoder_inputs: ``{k: [e, ...]}``, the encoder microbatches LLM microbatch ``k`` consumes.
        schedule: the LLM schedule the flow was planned for (placement policies set it); lets
            ``EncoderAnchor.register(stage, flow)`` and ``validate()`` omit it. Not part of equality or JSON.

    Raises:
        DataFlowError: a key is 0 or not an integer, or a value is not ``(pp, (left, right))``.
    """

    def __init__(
        self,
        entries: Mapping[int, tuple[int, Sequence[int]]],
        encoder_inputs: Mapping[int, Sequence[int]] | None = None,
        *,
        schedule: Schedule | None = None,
        _duplicates: Sequence[str] = (),
    ) -> None:
        errors = [f"encoder microbatch {d} placed twice" for d in _duplicates]
        self.entries: dict[int, Position] = {}
        for key, value in entries.items():
            try:
                signed = int(key)
            except (TypeError, ValueError):
                errors.append(f"entry {key!r}: key is not a signed encoder microbatch like +3 or -3")
                continue
            if signed == 0:
                errors.append("entry 0: encoder microbatches are numbered from 1 (+e forward, -e backward)")
                continue
            try:
                pp, (left, right) = value
                self.entries[signed] = (int(pp), (int(left), int(right)))
            except (TypeError, ValueError):
                errors.append(f"entry {_key(signed)}: value {value!r} is not (pp, [left, right])")
        if errors:
            raise DataFlowError(errors)
        try:
            self.encoder_inputs: dict[int, list[int]] = {
                int(k): [int(e) for e in es] for k, es in (encoder_inputs or {}).items()
            }
        except (TypeError, ValueError) as exc:
            raise DataFlowError(
                [f"encoder_inputs must map LLM microbatch k to a list of encoder microbatches: {exc}"]
            ) from None
        self.schedule = schedule

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, DataFlow)
            and list(self.entries.items()) == list(other.entries.items())
            and self.encoder_inputs == other.encoder_inputs
        )

    def __repr__(self) -> str:
        return f"DataFlow({len(self.entries)} entries, {len(self.encoder_inputs)} LLM microbatches)"

    @property
    def encoder_consumer(self) -> dict[int, int]:
        """``{e: torch index of the consuming LLM microbatch}`` (from ``encoder_inputs``)."""
        return {e: k - 1 for k, es in self.encoder_inputs.items() for e in es}

    def encoder_rank(self, e: int) -> int:
        """Pipeline rank that runs encoder microbatch ``e`` (its forward's position).

        Raises:
            KeyError: ``+e`` is not placed.
        """
        return self.entries[e][0]

    def encoders_on(self, rank: int) -> list[int]:
        """Encoder microbatches whose forward runs on ``rank``, in map order."""
        return [e for e, (pp, _) in self.entries.items() if e > 0 and pp == rank]

    # -- JSON ---------------------------------------------------------------------------------------
    def to_json(self) -> str:
        """``{"flow": {"+e": [pp, [left, right]], ...}, "encoder_inputs": {"k": [e, ...]}}``."""
        flow = {_key(k): [pp, [left, right]] for k, (pp, (left, right)) in self.entries.items()}
        enc = {str(k): es for k, es in self.encoder_inputs.items()}
        return json.dumps({"flow": flow, "encoder_inputs": enc})

    @classmethod
    def from_json(cls, text: str) -> DataFlow:
        """Parse :meth:`to_json` output, or a bare paper-style map ``{"+e": [pp, [left, right]]}``.

        Raises:
            DataFlowError: malformed JSON, a key that is not a signed integer, or a key given twice.
        """
        dups: list[str] = []

        def pairs(items):
            seen: dict[str, object] = {}
            for k, v in items:
                if k in seen and k not in ("flow", "encoder_inputs"):
                    dups.append(k)
                seen[k] = v
            return seen

        try:
            obj = json.loads(text, object_pairs_hook=pairs)
        except json.JSONDecodeError as exc:
            raise DataFlowError([f"not JSON: {exc}"]) from exc
        flow = obj.get("flow", obj) if isinstance(obj, dict) else obj
        if not isinstance(flow, dict):
            raise DataFlowError([f"expected a JSON object, got {type(flow).__name__}"])
        entries = {}
        for k, v in flow.items():
            if k == "encoder_inputs":
                continue
            try:
                entries[int(k)] = v
            except ValueError:
                raise DataFlowError(
                    [f"key {k!r} is not a signed encoder microbatch like '+3' or '-3'"]
                ) from None
        return cls(entries, obj.get("encoder_inputs") if "flow" in obj else None, _duplicates=dups)

    # -- placement into rank programs ------------------------------------------------------------------
    @staticmethod
    def _ref(schedule: Schedule, rank: int, signed_k: int) -> Action:
        return Action.unchecked(F if signed_k > 0 else B, abs(signed_k) - 1, rank)

    @staticmethod
    def slot_ref(schedule: Schedule, program: Sequence[Action], rank: int, slot: int) -> tuple[int, int]:
        """``(left, right)`` naming the point before ``program[slot]`` (``slot == len`` is the end).

        Raises:
            ValueError: the point is not expressible (under virtual stages only points before the rank's
                first-stage actions and the end are).
        """
        if slot < len(program) and program[slot].stage != rank:
            raise ValueError(f"rank {rank}: no data-flow name for the point before {program[slot]}")
        before = next((i for i in range(slot - 1, -1, -1) if program[i].stage == rank), None)
        left = 0 if before is None else _signed(program[before])
        right = 0 if slot == len(program) else _signed(program[slot])
        return left, right

    @staticmethod
    def _index(llm: Mapping[int, Sequence[Action]]) -> dict[int, tuple[dict[Action, int], list[int | None]]]:
        """Per rank: action -> position, and for each slot the position of the last addressable action
        before it (None at the start)."""
        out: dict[int, tuple[dict[Action, int], list[int | None]]] = {}
        for r, prog in llm.items():
            prev: list[int | None] = [None]
            for i, a in enumerate(prog):
                prev.append(i if a.stage == r else prev[-1])
            out[r] = ({a: i for i, a in enumerate(prog)}, prev)
        return out

    def _slot(self, schedule: Schedule, programs, rank_index, key: int, errors: list[str]):
        pp, (left, right) = self.entries[key]
        where = f"{_key(key)} at ({pp}, [{left}, {right}])"
        if not 0 <= pp < schedule.num_ranks:
            errors.append(f"{where}: rank {pp} does not exist (pipeline ranks 0..{schedule.num_ranks - 1})")
            return None
        prog = programs[pp]
        index, prev = rank_index[pp]
        refs = []
        for name, ref in (("left", left), ("right", right)):
            if ref == 0:
                refs.append(None)
                continue
            a = self._ref(schedule, pp, ref)
            if a not in index:
                errors.append(f"{where}: {name} {ref:+d} ({a}) is not an action of rank {pp}")
                return None
            refs.append(index[a])
        slot = len(prog) if refs[1] is None else refs[1]
        expected_left = prev[slot]
        if refs[0] != expected_left:
            want = 0 if expected_left is None else _signed(prog[expected_left])
            errors.append(
                f"{where}: left and right are not adjacent on rank {pp} (the action before "
                f"{'the end' if right == 0 else f'{right:+d}'} is {want:+d})"
            )
            return None
        return pp, slot

    def programs(self, schedule: Schedule) -> dict[int, list[Action]]:
        """Each rank's program: its LLM actions with the encoder actions inserted where the map says.

        Raises:
            DataFlowError: a position does not exist or is not adjacent.
        """
        llm = schedule.program_view
        errors: list[str] = []
        inserts: dict[int, dict[int, list[Action]]] = {r: {} for r in llm}
        rank_index = self._index(llm)
        for key in self.entries:
            got = self._slot(schedule, llm, rank_index, key, errors)
            if got is not None:
                pp, slot = got
                inserts[pp].setdefault(slot, []).append(Action(EF if key > 0 else EB, abs(key)))
        if errors:
            raise DataFlowError(errors)
        out: dict[int, list[Action]] = {}
        for r, prog in llm.items():
            merged: list[Action] = []
            for i in range(len(prog) + 1):
                merged.extend(inserts[r].get(i, ()))
                if i < len(prog):
                    merged.append(prog[i])
            out[r] = merged
        return out

    # -- validation ------------------------------------------------------------------------------------
    def validate(
        self, schedule: Schedule | None = None, encoder_inputs: Mapping[int, Sequence[int]] | None = None
    ) -> None:
        """Check the data flow against a schedule.

        Args:
            schedule: a valid LLM schedule; defaults to the flow's own ``schedule``.
            encoder_inputs: ``{k: [e, ...]}``; defaults to the flow's own ``encoder_inputs``.

        Raises:
            DataFlowError: lists every violated rule, naming the encoder action and its position: an encoder
                microbatch missing, placed twice or unknown; a position that does not exist on that rank; a
                backward on another rank than its forward; a forward that cannot finish before stage 0's
                forward of the LLM microbatch consuming it; a backward placed before stage 0's backward that
                produces its gradient; any remaining cyclic wait (deadlock).
            ValueError: no schedule given and the flow does not know its own.
        """
        if schedule is None:
            schedule = self.schedule
        if schedule is None:
            raise ValueError("DataFlow.validate: this flow does not know its schedule; pass it")
        enc = {
            int(k): list(v)
            for k, v in (encoder_inputs if encoder_inputs is not None else self.encoder_inputs).items()
        }
        errors: list[str] = []
        consumer: dict[int, int] = {}
        for k, es in enc.items():
            if not 1 <= k <= schedule.num_microbatches:
                errors.append(
                    f"encoder_inputs: LLM microbatch {k} does not exist (1..{schedule.num_microbatches})"
                )
            for e in es:
                if e in consumer:
                    errors.append(f"encoder microbatch {e} feeds LLM microbatches {consumer[e] + 1} and {k}")
                consumer[e] = k - 1
        for e in sorted(consumer):
            for key, what in ((e, "forward"), (-e, "backward")):
                if key not in self.entries:
                    errors.append(f"encoder microbatch {e}: {what} {_key(key)} missing from the data flow")
        for key in self.entries:
            if abs(key) not in consumer:
                errors.append(f"{_key(key)}: no LLM microbatch consumes encoder microbatch {abs(key)}")
        llm = schedule.program_view
        slots: dict[int, tuple[int, int]] = {}
        rank_index = self._index(llm)
        for key in self.entries:
            got = self._slot(schedule, llm, rank_index, key, errors)
            if got is not None:
                slots[key] = got
        for e in consumer:
            if e in slots and -e in slots and slots[e][0] != slots[-e][0]:
                errors.append(
                    f"-{e} runs on rank {slots[-e][0]} but its forward +{e} ran on rank {slots[e][0]}"
                )
        _, where, clock = schedule.analysis
        for key, (pp, slot) in slots.items():
            e = abs(key)
            if e not in consumer:
                continue
            i = consumer[e]
            prog = llm[pp]
            pos = f"{_key(key)} at ({pp}, [{self.entries[key][1][0]}, {self.entries[key][1][1]}])"
            if key > 0:
                need = Action(F, i, 0)
                if slot > 0 and happens_before(where, clock, need, prog[slot - 1]):
                    prev = prog[slot - 1]
                    why = (
                        f"placed after {need} itself"
                        if prev == need
                        else f"rank {pp} gets here only after {prev}, which runs after {need}"
                    )
                    errors.append(
                        f"{pos}: encoder forward cannot finish before stage 0's forward {need} of LLM microbatch "
                        f"{i + 1} that consumes it ({why})"
                    )
            else:
                grad = Action(B, i, 0)
                if slot < len(prog) and happens_before(where, clock, prog[slot], grad):
                    nxt = prog[slot]
                    why = (
                        f"placed before {grad} itself"
                        if nxt == grad
                        else f"rank {pp} must first run {nxt}, which {grad} waits on"
                    )
                    errors.append(
                        f"{pos}: encoder backward placed before stage 0's backward {grad} of LLM microbatch "
                        f"{i + 1} that produces its gradient ({why})"
                    )
        if not errors:
            programs = self.programs(schedule)
            try:
                execution_order(programs, llm_encoder_deps(schedule.num_stages, consumer))
            except Deadlock as exc:
                errors.append(f"cyclic wait between encoder and LLM actions: {exc}")
        if errors:
            raise DataFlowError(errors)


def _signed(a: Action) -> int:
    k = flow_index(a.microbatch)
    return k if a.kind == F else -k

"""Dependencies between compute actions of a pipeline, and a deadlock-finding execution order.

Every rank runs its program (ordered list of compute actions) in order; an action may start once the
actions it depends on (on any rank) have finished. :func:`execution_order` finds such an order or reports
the actions each stuck rank waits on (a deadlock: a cycle through program order and data dependencies).
:func:`vector_clocks` then answers "does ``a`` happen before ``b``" in O(1) per query.

LLM dependencies (1F1B and friends, Narayanan et al. 2021): ``sF i`` needs ``(s-1)F i``; ``sB i`` needs
``sF i`` and ``(s+1)B i`` (the last stage's backward needs only its forward). Encoder dependencies
(MegaScale-Omni, uniform encoder representation): stage 0's forward of the LLM microbatch that consumes
encoder microbatch ``e`` needs ``EF e``; ``EB e`` needs ``EF e`` and stage 0's backward of that microbatch.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping, Sequence

from omni_pipeline.actions import Action, ActionKind

__all__ = ["Deadlock", "execution_order", "happens_before", "llm_encoder_deps", "vector_clocks"]

Programs = Mapping[int, Sequence[Action]]
DepsFn = Callable[[Action], Sequence[Action]]


class Deadlock(Exception):
    """No rank can make progress; ``stuck`` maps rank -> (its next action, the dependency it waits on)."""

    def __init__(self, stuck: dict[int, tuple[Action, Action]]) -> None:
        self.stuck = stuck
        lines = [f"rank {r}: {a} waits for {d}" for r, (a, d) in sorted(stuck.items())]
        super().__init__("deadlock: " + "; ".join(lines))


def llm_encoder_deps(num_stages: int, encoder_consumer: Mapping[int, int]) -> DepsFn:
    """Dependency function for LLM + encoder compute actions.

    Args:
        num_stages: number of LLM stages (virtual stages included).
        encoder_consumer: encoder microbatch e -> torch index of the LLM microbatch that consumes it.
    """
    consumers: dict[int, list[int]] = {}
    for e, i in encoder_consumer.items():
        consumers.setdefault(i, []).append(e)
    F, B = ActionKind.FORWARD, ActionKind.BACKWARD
    EF, EB = ActionKind.ENCODER_FORWARD, ActionKind.ENCODER_BACKWARD

    mk = Action.unchecked
    last = num_stages - 1

    def deps(a: Action) -> Sequence[Action]:
        kind, mb, stage = a
        if kind is F:
            if stage == 0:
                return [mk(EF, e) for e in consumers.get(mb, ())]
            return (mk(F, mb, stage - 1),)
        if kind is B:
            if stage < last:
                return (mk(F, mb, stage), mk(B, mb, stage + 1))
            return (mk(F, mb, stage),)
        if kind is EF:
            return ()
        if kind is EB:
            if mb in encoder_consumer:
                return (mk(EF, mb), mk(B, encoder_consumer[mb], 0))
            return (mk(EF, mb),)
        raise ValueError(f"{a} is not a compute action")

    return deps


def execution_order(programs: Programs, deps: DepsFn) -> list[tuple[int, Action]]:
    """A global order in which every rank runs its program in order and every dependency comes first.

    Returns:
        ``[(rank, action), ...]`` in a valid execution order (a topological order).

    Raises:
        Deadlock: some ranks cannot progress; names each one's blocked action and what it waits for.
    """
    pos = {r: 0 for r in programs}
    done: set[Action] = set()
    waiting: dict[Action, list[int]] = {}
    blocked_on: dict[int, tuple[Action, Action]] = {}
    ready = deque(sorted(programs))
    order: list[tuple[int, Action]] = []
    while ready:
        r = ready.popleft()
        prog = programs[r]
        while pos[r] < len(prog):
            a = prog[pos[r]]
            missing = next((d for d in deps(a) if d not in done), None)
            if missing is not None:
                waiting.setdefault(missing, []).append(r)
                blocked_on[r] = (a, missing)
                break
            blocked_on.pop(r, None)
            done.add(a)
            order.append((r, a))
            pos[r] += 1
            for r2 in waiting.pop(a, ()):
                ready.append(r2)
    if any(pos[r] < len(programs[r]) for r in programs):
        raise Deadlock({r: blocked_on[r] for r in programs if pos[r] < len(programs[r])})
    return order


def vector_clocks(
    programs: Programs, deps: DepsFn, order: Sequence[tuple[int, Action]]
) -> tuple[dict[Action, tuple[int, int]], dict[Action, list[int]]]:
    """Vector clocks over an execution order from :func:`execution_order`.

    Returns:
        ``(where, clock)`` for ranks numbered ``0..R-1``: ``where[a] = (rank, position)``; ``clock[a][r]`` = how many of rank ``r``'s
        actions happen before or at ``a``. ``a`` happens before-or-at ``b`` iff
        ``where[a][1] < clock[b][where[a][0]]``.
    """
    num_ranks = len(programs)
    where = {a: (r, i) for r in programs for i, a in enumerate(programs[r])}
    clock: dict[Action, list[int]] = {}
    for r, a in order:
        _, i = where[a]
        c = list(clock[programs[r][i - 1]]) if i > 0 else [0] * num_ranks
        for d in deps(a):
            dc = clock[d]
            c = [x if x >= y else y for x, y in zip(c, dc)]
        c[r] = i + 1
        clock[a] = c
    return where, clock


def happens_before(
    where: Mapping[Action, tuple[int, int]], clock: Mapping[Action, list[int]], a: Action, b: Action
) -> bool:
    """``a`` happens before or at ``b`` (ranks numbered 0..R-1; see :func:`vector_clocks`)."""
    r, i = where[a]
    return i < clock[b][r]

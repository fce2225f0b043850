"""Multi-process test harness over real ``torch.distributed`` process groups.

``run_world`` starts ``world_size`` OS processes, each with the default process group initialised
(gloo on CPU by default), runs ``fn(rank, world_size, *args)`` in each and returns the per-rank results.
Rendezvous goes through a ``TCPStore`` that the *caller* opens on an OS-assigned loopback port, so two
worlds started back to back (or concurrently) never race for a port.

Children are started with the ``forkserver`` method and ``torch`` pre-imported in the fork server: a
fresh interpreter importing torch costs ~2.5 s of CPU, a fork of the server costs milliseconds. ``fn``
and ``args`` must be picklable (a module-level function; checked in the caller before any process
starts); test modules therefore need unique basenames. A rank that raises, dies without a result
(segfault, ``os._exit``) or returns something unpicklable is named in a :class:`WorldError`. A script
(not a test) that calls ``run_world`` needs the usual ``if __name__ == "__main__":`` guard, since the
children re-import the caller's main module.

``fake_world`` initialises torch's ``fake`` backend in the current process for topology tests at
64-1024 ranks: collectives return immediately without moving data. ``spy_collectives`` records the
``torch.distributed`` collectives a block of code issues (which, in what order, with what arguments).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import multiprocessing.connection
import multiprocessing.reduction
import os
import pickle
import signal
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "WorldError",
    "WorldTimeoutError",
    "fake_world",
    "graph_saved_bytes",
    "run_world",
    "spy_collectives",
]

# Pre-imported once in the fork server. DTensor, FSDP2 and DeviceMesh slicing pull in torch._dynamo,
# which costs 10-15 s of CPU per fresh interpreter; forked ranks inherit it for free.
_PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.nn",
    "torch._dynamo",
    "torch.distributed.tensor",
    "torch.distributed.fsdp",
    "torch.distributed.device_mesh",
    # where installed (the fork server skips a module it cannot import): the trainer's run outputs import
    # matplotlib's pyplot and tensorboard's writer on rank 0 of every run, about 1.5 s of CPU each time
    "matplotlib.pyplot",
    "torch.utils.tensorboard",
]


class WorldError(RuntimeError):
    """A rank of a :func:`run_world` world raised; the message names the rank and holds its traceback."""

    def __init__(self, rank: int, message: str, remote_traceback: str) -> None:
        super().__init__(
            f"rank {rank} failed: {message}\n--- traceback of rank {rank} ---\n{remote_traceback}"
        )
        self.rank = rank
        self.remote_traceback = remote_traceback


class WorldTimeoutError(TimeoutError):
    """Ranks of a :func:`run_world` world did not finish within ``timeout_s``; they were killed."""

    def __init__(self, ranks: list[int], timeout_s: float) -> None:
        names = ", ".join(f"rank {r}" for r in ranks)
        super().__init__(f"{names} did not finish within {timeout_s:.1f} s and were killed")
        self.ranks = ranks


def _worker(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    backend: str,
    store_port: int,
    timeout_s: float,
    args: tuple[Any, ...],
    conn: Any,
) -> None:
    try:
        # Each rank must see only its own slice of the machine: keep intra-op threads at one so four
        # ranks on two cores do not oversubscribe and slow every collective to a crawl.
        torch.set_num_threads(1)
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        os.environ["RANK"] = str(rank)
        os.environ["WORLD_SIZE"] = str(world_size)
        os.environ["LOCAL_RANK"] = str(rank)
        os.environ["LOCAL_WORLD_SIZE"] = str(world_size)
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(store_port)
        store = dist.TCPStore(
            "127.0.0.1", store_port, world_size, is_master=False, timeout=timedelta(seconds=timeout_s)
        )
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s)
        )
        try:
            result = fn(rank, world_size, *args)
        except BaseException as exc:
            # Report before tearing the group down: the teardown makes peers fail too, and the
            # caller must see the rank that failed first, not the ones that failed because of it.
            conn.send_bytes(
                pickle.dumps(("error", time.time(), f"{type(exc).__name__}: {exc}", traceback.format_exc()))
            )
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
            return
        # Plain pickle, not the connection's ForkingPickler: torch's reducers would share tensors by file
        # descriptor, and those die with this process before the caller reads them.
        try:
            payload = pickle.dumps(("ok", result))
        except Exception as exc:
            raise TypeError(
                f"the return value of fn ({type(result).__name__}) cannot be pickled back to the caller: {exc}"
            ) from exc
        conn.send_bytes(payload)
        # Tear down only once every rank is done, so a fast rank closing its sockets cannot break a peer
        # still in its last collective. The result is already sent: a hung peer leaves only itself unnamed.
        with contextlib.suppress(Exception):
            dist.barrier()
            dist.destroy_process_group()
    except BaseException as exc:
        conn.send_bytes(
            pickle.dumps(("error", time.time(), f"{type(exc).__name__}: {exc}", traceback.format_exc()))
        )
    finally:
        conn.close()


def run_world(
    fn: Callable[..., Any],
    world_size: int,
    *,
    backend: str = "gloo",
    timeout_s: float = 120.0,
    args: Sequence[Any] = (),
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes with a process group each.

    Args:
        fn: module-level (picklable) function; its return value must be picklable.
        world_size: number of ranks (processes), >= 1.
        backend: ``torch.distributed`` backend, ``"gloo"`` on CPU.
        timeout_s: wall-clock seconds for the whole world, also used as the process-group timeout.
        args: extra positional arguments passed to every rank.

    Returns:
        ``[result_rank0, result_rank1, ...]``.

    Raises:
        TypeError: ``world_size`` is not an int, or ``fn`` or an element of ``args`` cannot be pickled
            (e.g. a lambda or a nested function); raised in the caller before any process starts.
        ValueError: ``world_size < 1`` or ``timeout_s <= 0``.
        WorldError: a rank raised, its return value could not be pickled, or its process exited without a
            result (crash, ``os._exit``); the root rank is named with its traceback, the rest are killed.
            A rank that died without a result counts as the root over ranks that raised, since a dead
            peer makes the others' collectives fail.
        WorldTimeoutError: some ranks did not finish within ``timeout_s``; all are killed, exactly the
            unfinished ranks are named.
    """
    if not isinstance(world_size, int) or isinstance(world_size, bool):
        raise TypeError(f"world_size must be an int, got {type(world_size).__name__} {world_size!r}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0 seconds, got {timeout_s}")
    args = tuple(args)
    _check_picklable(fn, args)
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    # The caller hosts the rendezvous store on port 0 (the OS picks a free one): no port race.
    store = dist.TCPStore(
        "127.0.0.1",
        0,
        world_size,
        is_master=True,
        timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )
    procs: list[Any] = []
    conns: list[Any] = []
    try:
        for rank in range(world_size):
            parent_conn, child_conn = ctx.Pipe(duplex=False)
            p = ctx.Process(
                target=_worker,
                args=(fn, rank, world_size, backend, store.port, timeout_s, args, child_conn),
                name=f"omni-rank{rank}",
                daemon=True,
            )
            p.start()
            child_conn.close()
            procs.append(p)
            conns.append(parent_conn)

        results: dict[int, Any] = {}
        deadline = time.monotonic() + timeout_s
        pending = set(range(world_size))
        while pending:
            remaining = deadline - time.monotonic()
            # One last non-blocking look after the deadline, so a rank whose result is already in its
            # pipe is not named as unfinished.
            ready = multiprocessing.connection.wait(
                [conns[r] for r in sorted(pending)], timeout=min(max(remaining, 0.0), 0.5)
            )
            for conn in ready:
                rank = conns.index(conn)
                msg = _receive(conn, procs[rank])
                if msg[0] == "error":
                    raise _first_error(rank, msg, conns, procs, pending)
                results[rank] = msg[1]
                pending.discard(rank)
            if pending and remaining <= 0:
                raise WorldTimeoutError(sorted(pending), timeout_s)
        return [results[r] for r in range(world_size)]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=5.0)
        for c in conns:
            c.close()
        del store


def _check_picklable(fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    """Fail in the caller, naming the culprit, if ``fn`` or an argument cannot reach the rank processes.

    Raises:
        TypeError: ``fn`` or ``args[i]`` cannot be pickled by multiprocessing's pickler.
    """
    dumps = multiprocessing.reduction.ForkingPickler.dumps
    try:
        dumps(fn)
    except Exception as exc:
        raise TypeError(
            f"run_world: fn {fn!r} cannot be pickled into the rank processes ({type(exc).__name__}: {exc}); "
            "pass a module-level function, not a lambda, nested function or bound method of a local object"
        ) from exc
    for i, arg in enumerate(args):
        try:
            dumps(arg)
        except Exception as exc:
            raise TypeError(
                f"run_world: args[{i}] ({type(arg).__name__}) cannot be pickled into the rank processes "
                f"({type(exc).__name__}: {exc})"
            ) from exc


def _receive(conn: Any, proc: Any) -> tuple:
    """Read one rank's message: ``("ok", result)`` or ``("error", time_raised, message, traceback)``.

    A process that closed its pipe without a message (segfault, ``os._exit``, killed) becomes an error
    with time ``-inf``: it is the root cause when its peers then fail in their collectives.
    """
    try:
        return pickle.loads(conn.recv_bytes())
    except EOFError:
        proc.join(timeout=1.0)
        code = proc.exitcode
        how = f"exit code {code}"
        if code is not None and code < 0:
            with contextlib.suppress(ValueError):
                how = f"killed by signal {signal.Signals(-code).name}"
        message = f"process exited without a result ({how}); its own stderr output may say why"
        return ("error", float("-inf"), message, "")


def _first_error(rank: int, msg: tuple, conns: list[Any], procs: list[Any], pending: set[int]) -> WorldError:
    """Pick the root failure: errors from the other ranks arriving within a short grace period are
    compared by the time they were raised, since a failing rank makes its peers' collectives fail."""
    errors = {rank: msg}
    grace_end = time.monotonic() + 1.0
    others = [r for r in sorted(pending) if r != rank]
    while others and time.monotonic() < grace_end:
        ready = multiprocessing.connection.wait([conns[r] for r in others], timeout=0.1)
        for conn in ready:
            r = conns.index(conn)
            others.remove(r)
            m = _receive(conn, procs[r])
            if m[0] == "error":
                errors[r] = m
    first = min(errors, key=lambda r: (errors[r][1], r))
    _, _, message, tb = errors[first]
    return WorldError(first, message, tb)


@contextlib.contextmanager
def spy_collectives(
    record: Callable[[str, tuple, dict], Any], names: Sequence[str] = ("reduce_scatter_tensor", "all_reduce")
) -> Iterator[list[Any]]:
    """Within the block, every call of the ``torch.distributed`` functions ``names`` first appends
    ``record(name, args, kwargs)`` to the yielded list, then runs the real collective. The module
    attributes are restored on exit. Code that bound a collective by ``from torch.distributed import ...``
    before the block is not seen.

    Yields:
        The list of records, in call order (appended to while the block runs).

    Raises:
        AttributeError: a name that ``torch.distributed`` does not have.
    """
    saved = {name: getattr(dist, name) for name in names}
    calls: list[Any] = []

    def wrap(name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls.append(record(name, args, kwargs))
            return real(*args, **kwargs)

        return call

    try:
        for name, real in saved.items():
            setattr(dist, name, wrap(name, real))
        yield calls
    finally:
        for name, real in saved.items():
            setattr(dist, name, real)


@contextlib.contextmanager
def fake_world(world_size: int, rank: int = 0) -> Iterator[None]:
    """Initialise torch's ``fake`` backend as ``rank`` of a ``world_size`` world in this process.

    Collectives on the fake backend return at once without moving data, so device meshes and process
    groups for 64-1024 ranks can be built and inspected in one process. The default group is destroyed
    on exit, and ``sys.excepthook`` is restored (``init_process_group`` installs one that prefixes every
    later traceback of the process with ``[rankN]:``).

    Raises:
        RuntimeError: a default process group is already initialised in this process.
    """
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("fake_world: a default process group is already initialised in this process")
    hook = sys.excepthook
    try:
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
        try:
            yield
        finally:
            dist.destroy_process_group()
    finally:
        sys.excepthook = hook


def graph_saved_bytes(root: torch.Tensor, params: Sequence[torch.Tensor]) -> int:
    """Bytes of the distinct storages the autograd graph of ``root`` saved for backward (each storage
    once; the storages of ``params`` left out): the brute-force oracle of saved-activation peaks
    (:class:`omni_parallel.activation_memory.ActivationMemory`), read from the ``_saved_*`` attributes of
    every node reachable from ``root.grad_fn``."""
    skip = {p.untyped_storage().data_ptr() for p in params}
    seen: dict[int, int] = {}
    stack, visited = [root.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in visited:
            continue
        visited.add(node)
        for attr in dir(node):
            if not attr.startswith("_saved_"):
                continue
            value = getattr(node, attr)
            for t in value if isinstance(value, tuple | list) else (value,):
                if isinstance(t, torch.Tensor):
                    s = t.untyped_storage()
                    if s.data_ptr() not in skip:
                        seen[s.data_ptr()] = s.nbytes()
        stack.extend(fn for fn, _ in node.next_functions)
    return sum(seen.values())

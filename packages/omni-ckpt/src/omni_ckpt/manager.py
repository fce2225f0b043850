"""``CheckpointManager``: numbered steps under one root, a ``latest`` pointer, pruning, async saves.

Layout under ``root``::

    step-00000100/rank-00000.safetensors ... manifest.msgpack   # committed when the manifest exists
    latest                                                     # "step-00000100", replaced atomically

Order of a save of step S: every rank writes its data file; rank 0 gathers every rank's outcome and,
only if all succeeded, writes ``manifest.msgpack.tmp`` and renames it (S is now committed), then
replaces ``latest`` (tmp + rename), then prunes (each pruned step loses its manifest first, so a crash
mid-delete never leaves a step that looks committed but lacks data). A crash at any point leaves
:meth:`CheckpointManager.latest` on the previous committed step or on S, never on a partial one.

:meth:`CheckpointManager.latest` is the newest step whose manifest exists (a manifest is only renamed into
place after every rank wrote its data durably), not blindly what the ``latest`` file says: a crash between
S's manifest rename and the pointer move leaves the file one step behind, and a job resumed from there
would later fail to save S again ("already committed"). The ``latest`` file is kept for tools and people.

:meth:`CheckpointManager.roll_back` goes back to an older committed step (a newer one damaged, or steps to
redo): the newer step directories are renamed out of the ``step-<8 digits>`` pattern, kept whole, so later
saves of the same numbers and pruning never meet them.
"""

from __future__ import annotations

import contextlib
import operator
import re
from collections.abc import MutableMapping
from concurrent import futures
from typing import Any

import torch.distributed as dist

from omni_ckpt.layout import MANIFEST
from omni_ckpt.load import LoadResult, load, plan_from_manifest, read_manifest
from omni_ckpt.plan import PlanCache
from omni_ckpt.save import DEFAULT_HOST_BUDGET, DEFAULT_IO_THREADS, AsyncSaveHandle, async_save, save
from omni_ckpt.storage import CheckpointError, atomic_write, forget_listings, is_local, join, open_url

__all__ = ["CheckpointManager"]

_STEP = re.compile(r"^step-(\d+)$")
LATEST = "latest"


class CheckpointManager:
    """Saves numbered checkpoints under ``root`` and finds the newest committed one.

    Args:
        root: fsspec URL of the directory holding the steps.
        keep_last: committed steps to keep (>= 1); older ones, and uncommitted leftovers older than the
            newest committed step, are deleted by rank 0 after each commit. None keeps everything.
        async_save: ``save`` returns once ``state`` is staged to host memory (the caller may step the
            optimizer right away) and writes and commits in the background.
        process_group: ranks saving together. With ``torch.distributed`` initialised and None, the manager
            creates its own gloo group (collectively, on every rank), so background commit collectives
            never interleave with training collectives.
        host_budget_bytes: host staging budget of a save (bytes): all of an async save's copies, and a
            sync save's copies of device tensors, go through buffers of at most this many bytes in all.
        io_threads: reader and writer threads per rank.
        require_finite: refuse to save a step whose floating-point tensors hold a NaN or Inf
            (:func:`omni_ckpt.save`'s ``require_finite``): :meth:`save` raises on every rank and nothing is
            committed, so pruning never removes an older step for it.

    Raises:
        ValueError: ``keep_last < 1``, ``host_budget_bytes <= 0`` or ``io_threads < 1``.
    """

    def __init__(
        self,
        root: str,
        *,
        keep_last: int | None = 3,
        async_save: bool = True,
        process_group: dist.ProcessGroup | None = None,
        host_budget_bytes: int = DEFAULT_HOST_BUDGET,
        io_threads: int = DEFAULT_IO_THREADS,
        require_finite: bool = False,
    ) -> None:
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"keep_last must be >= 1 or None, got {keep_last}")
        if host_budget_bytes <= 0 or io_threads < 1:
            raise ValueError(
                f"host_budget_bytes and io_threads must be >= 1, got {host_budget_bytes}, {io_threads}"
            )
        self.io_threads = io_threads
        self.require_finite = require_finite
        self.root = root.rstrip("/")
        self.keep_last = keep_last
        self.async_save = async_save
        self.host_budget_bytes = host_budget_bytes
        self.fs, self.path = open_url(self.root)
        if process_group is None and dist.is_available() and dist.is_initialized():
            process_group = dist.new_group(backend="gloo")
        self.process_group = process_group
        self.rank = dist.get_rank(process_group) if process_group is not None else 0
        self.plan_cache = PlanCache()
        self._cache_checked = False
        self._pending: tuple[int, AsyncSaveHandle] | None = None

    def step_url(self, step: int) -> str:
        """URL of step ``step``'s directory.

        Raises:
            ValueError: ``step`` is not an int >= 0.
        """
        try:
            index = operator.index(step)
        except TypeError:
            index = -1
        if isinstance(step, bool) or index < 0:
            raise ValueError(f"checkpoint step must be an int >= 0, got {step!r}")
        return f"{self.root}/step-{index:08d}"

    def _finish_pending(self) -> None:
        if self._pending is None:
            return
        step, handle = self._pending
        self._pending = None
        try:
            handle.wait()
        except Exception as exc:
            raise CheckpointError(f"background save of step {step} failed: {exc}") from exc

    def wait(self) -> None:
        """Block until the in-flight async save (if any) is committed. Raises: its error."""
        self._finish_pending()

    def _publish(self, step: int) -> None:
        # Runs on rank 0 after step's manifest is in place: move the pointer, then prune.
        atomic_write(self.fs, join(self.path, LATEST), f"step-{step:08d}".encode())
        if self.keep_last is None:
            return
        committed = self.steps()
        keep = set(committed[-self.keep_last :])
        newest = committed[-1]
        for s, name in self._step_dirs():
            if s in keep or s >= newest:
                continue
            with contextlib.suppress(FileNotFoundError):
                manifest = join(join(self.path, name), MANIFEST)
                if self.fs.exists(manifest):
                    self.fs.rm(manifest)  # uncommit first: a crash mid-delete leaves no half step
                self.fs.rm(join(self.path, name), recursive=True)

    def save(
        self, step: int, state: MutableMapping[Any, Any], *, return_before_staged: bool = False
    ) -> AsyncSaveHandle | None:
        """Save ``state`` as step ``step`` (collective). Waits for the previous async save first.

        With ``async_save=True`` this returns once every tensor of ``state`` is copied to host memory
        (``handle.staged``), so the caller may change the saved tensors (the optimizer step) as soon as it
        returns; writing, checksums and the commit go on in the background. A staging error does not raise
        here: it surfaces from ``handle.wait()`` and at the manager's next call, like a write error.

        Args:
            step: the step number (int >= 0).
            state: nested mapping of tensors (plain, ``DTensor``, ``BoxShard``) and msgpack-able values.
            return_before_staged: the fast, opt-in way (``async_save=True`` only): return as soon as the
                save is planned, while the copies to host memory are still running. The caller must then
                wait on ``handle.staged`` before changing any saved tensor (before the optimizer step);
                work that leaves them alone (the next forward and backward) may overlap the copies.
                A tensor changed earlier can reach the checkpoint half old, half new.

        Returns:
            the async handle (``async_save=True``; ``handle.done`` says when the step is committed), else
            None once committed.

        Raises:
            CheckpointError: the previous background save failed, or this one failed (sync mode), or
                ``step`` is already committed.
            ValueError: ``step`` is not an int >= 0, or ``return_before_staged`` with ``async_save=False``.
        """
        url = self.step_url(step)
        if return_before_staged and not self.async_save:
            raise ValueError("return_before_staged=True needs a manager made with async_save=True")
        self._finish_pending()
        forget_listings(self.fs, self.path)  # "already committed?" must see other jobs' commits
        if not self._cache_checked:
            self._cache_checked = True
            latest = self.latest()
            if latest is not None:
                self.plan_cache.plan = plan_from_manifest(read_manifest(self.step_url(latest)))

        def on_commit() -> None:
            self._publish(step)

        options = {
            "process_group": self.process_group,
            "plan_cache": self.plan_cache,
            "on_commit": on_commit,
            "io_threads": self.io_threads,
            "host_budget_bytes": self.host_budget_bytes,
            "require_finite": self.require_finite,
        }
        if not self.async_save:
            save(state, url, **options)  # type: ignore[arg-type]
            return None
        handle = async_save(state, url, **options)  # type: ignore[arg-type]
        self._pending = (step, handle)
        if not return_before_staged:
            # Returning before the copies end let an optimizer step that followed at once leak new
            # weights into the checkpoint. A failed staging resolves the future too (with its error,
            # which surfaces from handle.wait() and the next call), so this never blocks forever.
            futures.wait([handle.staged])
        return handle

    def _step_dirs(self) -> list[tuple[int, str]]:
        forget_listings(self.fs, self.path)  # other ranks and jobs commit, prune and roll back too
        if not self.fs.exists(self.path):
            return []
        out = []
        for info in self.fs.ls(self.path, detail=False):
            name = info.rstrip("/").rsplit("/", 1)[-1]
            m = _STEP.match(name)
            if m:
                out.append((int(m.group(1)), name))
        return sorted(out)

    def steps(self) -> list[int]:
        """Committed steps (a manifest exists), oldest first."""
        return [s for s, name in self._step_dirs() if self.fs.exists(join(join(self.path, name), MANIFEST))]

    def latest(self) -> int | None:
        """The newest committed step (its manifest exists), or None when there is none.

        This is the step the ``latest`` file names, or one newer when a crash came between that step's
        commit and the pointer move (see the module docstring). Raises: a failed background save's error.
        """
        if self._pending is not None and self._pending[1].done.done():
            self._finish_pending()
        committed = self.steps()
        return committed[-1] if committed else None

    def roll_back(self, step: int) -> list[str]:
        """Make committed step ``step`` the latest again (collective over the manager's group): rank 0
        renames every newer step directory, committed or not, to ``<name>.rolled-back-to-<step>`` (a
        numbered suffix if that name is taken) and points ``latest`` at ``step``, then every rank gets the
        outcome. The set-aside directories keep their files, but :meth:`steps`, :meth:`latest`, later
        saves of those step numbers and pruning no longer see them. For resuming from an older step when
        a newer one is damaged, or to redo steps with other settings.

        Returns:
            the new names of the directories set aside, oldest step first (empty when ``step`` was
            already the newest).

        Raises:
            CheckpointError: ``step`` is not a committed step (the committed ones named), a rename
                failed (on every rank), or the in-flight async save failed.
            ValueError: ``step`` is not an int >= 0.
        """
        self.step_url(step)  # validates step
        self._finish_pending()
        outcome: list[Any] = [None]
        if self.rank == 0:
            try:
                outcome[0] = ("ok", self._set_aside_after(step))
            except Exception as exc:  # every rank raises it, not only rank 0
                outcome[0] = ("error", f"{type(exc).__name__}: {exc}")
        if self.process_group is not None and dist.get_world_size(self.process_group) > 1:
            dist.broadcast_object_list(
                outcome, src=dist.get_global_rank(self.process_group, 0), group=self.process_group
            )
        kind, value = outcome[0]
        if kind == "error":
            raise CheckpointError(f"{self.root}: roll back to step {step} failed: {value}")
        return value

    def _set_aside_after(self, step: int) -> list[str]:
        committed = self.steps()
        if step not in committed:
            raise CheckpointError(
                f"step {step} is not a committed checkpoint (committed: {committed or 'none'})"
            )
        moved = []
        names = {p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(self.path, detail=False)}
        for s, name in self._step_dirs():
            if s <= step:
                continue
            new, k = f"{name}.rolled-back-to-{step}", 1
            while new in names:
                k += 1
                new = f"{name}.rolled-back-to-{step}.{k}"
            self._move_aside(name, new)
            names.add(new)
            moved.append(new)
        atomic_write(self.fs, join(self.path, LATEST), f"step-{step:08d}".encode())
        return moved

    def _move_aside(self, name: str, new: str) -> None:
        src, dst = join(self.path, name), join(self.path, new)
        if is_local(self.fs):
            self.fs.mv(src, dst, recursive=True)  # a rename: atomic
            return
        # An object store moves by copy then delete: copy the whole step first, then uncommit the
        # original (its manifest goes first, as in pruning), so a crash midway never leaves a step that
        # looks committed and lacks data, and the copy is complete before anything is deleted.
        self.fs.copy(src, dst, recursive=True)
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(join(src, MANIFEST))
        self.fs.rm(src, recursive=True)

    def load(self, step: int, state: MutableMapping[Any, Any]) -> LoadResult:
        """Load step ``step`` into ``state`` in place (see :func:`omni_ckpt.load`); primes the plan cache."""
        self._finish_pending()
        url = self.step_url(step)
        forget_listings(self.fs, self.path)  # the step may be newer than this process's listings
        result = load(state, url, process_group=self.process_group, io_threads=self.io_threads)
        if not self._cache_checked:
            self._cache_checked = True
            self.plan_cache.plan = plan_from_manifest(read_manifest(url))
        return result

    def load_latest(self, state: MutableMapping[Any, Any]) -> int | None:
        """Load the latest committed step into ``state``; returns its number, or None if there is none."""
        self._finish_pending()
        step = self.latest()
        if step is None:
            return None
        self.load(step, state)
        return step

    def close(self) -> None:
        """Wait for the in-flight save. Raises: its error."""
        self._finish_pending()

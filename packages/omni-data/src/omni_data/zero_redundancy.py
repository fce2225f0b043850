"""Zero-redundancy loading (paper §5.2): each pipeline rank reads only the payloads it will encode.

Every rank of a pipeline holds the same step metadata (the same :class:`PackedLoader` state for its DP
rank). Encoder microbatches are a plain function of that metadata (:func:`split_encoder_microbatches`),
``consumes`` says which of them this pipeline rank runs (from the pipeline's data flow, passed as plain
data, or a function of each step's metadata when the flow is planned per step), and only those payloads
are read and decoded, and only by TP rank 0, which broadcasts them to its TP group (sizes come from
metadata, so receivers allocate exactly).

Resumability: the filter prefetches ``prefetch`` steps ahead; those pre-filtered steps (metadata only)
are the "DP0 buffer" of the paper and are saved in :meth:`ZeroRedundancyFilter.state_dict`. On load
they are restored and re-filtered, so the resumed run reads exactly the same split (a ``consumes``
function is called again on them: it must be a pure function of the step's metadata).

Background preparation (``background=True``): the next step's metadata (loader, packer, mixture, a
``consumes`` function such as a per-step placement planner) is prepared on a thread of its own while the
caller trains, instead of inside :meth:`ZeroRedundancyFilter.next`. Every method that reads or replaces
the state (``next``, ``state_dict``, ``reset``, ``load_resplit``, ``close``) first waits for it, so the
state and the steps are the same as without it. Collectives the loader runs (the DP token count of
token-unit mixture phases) then run on that thread: give the loader a process group no other thread uses.
The preparation starts when :meth:`ZeroRedundancyFilter.next` returns, or, with
``prepare_on_request=True``, when the caller calls :meth:`ZeroRedundancyFilter.prepare`: a caller that
builds its step's inputs in Python right after ``next`` starts it once that is done, so that the two do
not take turns at the GIL (a thread in pure Python holds it for up to ``sys.getswitchinterval()`` before
the other gets it back); without the call the next ``next`` prepares inline.

Parallel decode: payloads are read and decoded by a pool of ``decode_workers`` threads the filter owns
(torchdata.nodes ``ParallelMapper`` conventions: ``num_workers`` threads, results in order). PIL,
libsndfile (via cffi), soxr, PyAV (FFmpeg's ``avcodec_send_packet`` / ``avcodec_receive_frame``) and numpy
release the GIL while they decode, resize and resample, so threads scale (``benchmarks/loader.py``). Every sample's result goes back to its slot of the step, so the output
is the same for any worker count, resume stays exact, and nothing draws from a global RNG. For remote
stores one ``fs.cat_ranges`` call per step fetches every member first (:meth:`PayloadReader.fetch`).

Bad data: an image, video or audio whose header passed the metadata pass but whose body does not decode or
cannot be read (:class:`~omni_data.payload.SkippedPayloadError`) cannot leave its pack (every rank
planned the pack from metadata), so its payload is replaced by zeros of the metadata's shape with
``Payload.error`` set, counted in :attr:`ZeroRedundancyFilter.ledger` (scope ``"payload"``) with its key
and logged once per source and reason; the run goes on and resume stays exact (the same sample gets the
same placeholder). Any other :class:`PayloadError` (a setup problem: another tokenizer, a shard changed
under the run) is raised on every TP rank.

Loader-state snapshots prepared ahead (paper §7.4: saving loader states took 6-20 minutes on the slowest
rank under 512K-length workloads until an asynchronous snapshot prepared ahead of time cut it to about
800 ms): with ``snapshots`` (every step, or the steps a caller will save), the thread that moves the
loader also serialises its state (msgpack) right after moving it, and the step's pre-filtered buffer and
skip ledger are serialised once each, so :meth:`ZeroRedundancyFilter.snapshot` at save time hands over
bytes made earlier: it neither walks the buffers nor waits for a preparation in flight. A snapshot is the
newest complete state: after the preparation of the next step when that is done (then byte for byte
``msgpack.packb(state_dict())``), else the state right after the last :meth:`next` (the preparation in
flight is redone on resume, exactly as it would have run).
"""

from __future__ import annotations

import copy
import weakref
from collections import deque
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import msgpack
import torch
import torch.distributed as dist

from omni_data.loader import LoaderSnapshot, PackedLoader, StepBatch
from omni_data.node import StatefulNode
from omni_data.packing import Pack
from omni_data.payload import (
    Payload,
    PayloadError,
    PayloadReader,
    SkippedPayloadError,
)
from omni_data.sample import Modality, SampleMeta
from omni_data.skips import SkipLedger
from omni_parallel import karmarkar_karp

__all__ = [
    "ConsumesFn",
    "FilteredStep",
    "SampleIndex",
    "ZeroRedundancyFilter",
    "encoder_microbatch_id",
    "encoder_microbatch_ids",
    "split_encoder_microbatches",
]


SampleIndex = tuple[int, int]
"""``(pack index in the step, sample index in the pack)``."""

ConsumesFn = Callable[[int, list[Pack], dict[int, list[SampleIndex]]], Collection[int]]
"""``(step, packs, encoder microbatches {e: [(pack, sample)]}) -> encoder microbatch ids this rank runs``:
a per-step data flow's choice, a pure function of the step's metadata (the same on every rank)."""


def encoder_microbatch_id(k: int, j: int, slices: int) -> int:
    """The id of slice ``j`` (0-based) of LLM microbatch ``k`` (1-based): ``e = (k-1)*slices + j + 1``.

    The one numbering of encoder microbatches (DESIGN.md §Glossary) that the loader's split, the data
    flow's ``encoder_inputs`` and the trainer share; with ``slices`` = PP size, slice ``j`` is the one the
    paper's uniform on-demand insertion puts on pipeline rank ``j`` (§4.2).

    Raises:
        ValueError: ``k < 1``, ``slices < 1`` or ``j`` outside ``0 .. slices-1``.
    """
    if k < 1 or slices < 1 or not 0 <= j < slices:
        raise ValueError(
            f"encoder_microbatch_id: need k >= 1 and 0 <= j < slices, got k={k} j={j} slices={slices}"
        )
    return (k - 1) * slices + j + 1


def encoder_microbatch_ids(microbatches: int, slices: int) -> dict[int, list[int]]:
    """``{k: [e, ...]}`` for LLM microbatches ``k = 1..microbatches``: the encoder microbatches each
    consumes (:func:`encoder_microbatch_id` for ``j = 0..slices-1``), the data flow's ``encoder_inputs``."""
    return {
        k: [encoder_microbatch_id(k, j, slices) for j in range(slices)] for k in range(1, microbatches + 1)
    }


def split_encoder_microbatches(
    packs: list[Pack], microbatches: int, slices: int, *, balance: bool = True
) -> dict[int, list[SampleIndex]]:
    """Encoder microbatches of one step: the media samples of LLM microbatch ``k`` split into ``slices``.

    LLM microbatch ``k`` (1-based, DESIGN.md §Glossary) holds packs ``[(k-1)*B, k*B)`` with
    ``B = len(packs) // microbatches``. Its media samples (image and audio, in pack order) are split into
    ``slices`` parts; part ``j`` is encoder microbatch ``e = (k-1)*slices + j + 1``. With ``slices`` = PP
    size this is the uniform split of the paper's on-demand insertion (§4.2). Text-only and generation
    samples have no encoder work and appear in none.

    Args:
        packs: the step's packs (metadata only).
        microbatches: LLM microbatches per step.
        slices: encoder microbatches per LLM microbatch (usually the PP size).
        balance: ``True``: parts of near-equal encoder FLOPs (Karmarkar-Karp largest differencing,
            ``omni_parallel.karmarkar_karp``; the grouped reordering of §5.3 inside the pipeline group).
            ``False``: the unbalanced baseline (``--reorder off``): the media samples, in pack order,
            are cut into ``slices`` contiguous runs whose sizes (in samples) differ by at most one, the
            longer runs first; part ``j`` keeps the pack order.

    Returns:
        ``{e: [(pack, sample)]}`` for every ``e`` in ``1 .. microbatches*slices`` (possibly empty lists).

    Raises:
        ValueError: ``len(packs)`` not divisible by ``microbatches``, or ``microbatches`` or ``slices`` < 1.
    """
    if microbatches < 1 or slices < 1 or len(packs) % microbatches:
        raise ValueError(f"{len(packs)} packs cannot form {microbatches} microbatches x {slices} slices")
    per = len(packs) // microbatches
    out: dict[int, list[SampleIndex]] = {}
    for k in range(microbatches):
        media = [
            (p, i)
            for p in range(k * per, (k + 1) * per)
            for i, s in enumerate(packs[p].samples)
            if s.modality.encoded  # text and generation samples have no encoder work
        ]
        if balance:
            parts = karmarkar_karp([packs[p].samples[i].encoder_flops for p, i in media], slices)
            for j, part in enumerate(parts):
                out[encoder_microbatch_id(k + 1, j, slices)] = [media[g] for g in part]
        else:
            base, extra = divmod(len(media), slices)
            at = 0
            for j in range(slices):
                n = base + (1 if j < extra else 0)
                out[encoder_microbatch_id(k + 1, j, slices)] = media[at : at + n]
                at += n
    return out


@dataclass(slots=True)
class FilteredStep:
    """A step: every pack's metadata, plus decoded payloads of the encoder microbatches this rank runs.

    Attributes:
        step: the training step.
        packs: all packs of the step (metadata of every sample, on every rank).
        microbatches: ``{e: [(pack, sample)]}`` for all encoder microbatches of the step.
        payloads: ``{e: [Payload]}`` only for ``e`` in ``consumes``, aligned with ``microbatches[e]``.
        text_ids: with ``read_text``: ``text_ids[p][i]`` = ``[text_tokens]`` int64 ids of sample ``i`` of
            pack ``p`` (``None`` without text); else empty.
        consumes: the encoder microbatch ids this rank runs in this step (the filter's ``consumes``, or
            what its ``consumes`` function returned for this step).
        text_errors: with ``read_text``: ``{(pack, sample): why}`` of the generation samples whose image did
            not decode (their ``text_ids`` are zeros of their token count: a placeholder that keeps the
            pack layout; mask their targets, as for a ``Payload.error``).
    """

    step: int
    packs: list[Pack]
    microbatches: dict[int, list[SampleIndex]]
    payloads: dict[int, list[Payload]]
    text_ids: list[list[torch.Tensor | None]]
    consumes: frozenset[int] = frozenset()
    text_errors: dict[SampleIndex, str] = field(default_factory=dict)


class ZeroRedundancyFilter(StatefulNode[FilteredStep]):
    """Reads only the payloads of the encoder microbatches in ``consumes``; TP rank 0 reads, then broadcasts.

    Args:
        loader: the step stream (same state on every pipeline and TP rank of a DP rank).
        consumes: encoder microbatch ids this pipeline rank runs (plain data, e.g. from a data flow), or a
            :data:`ConsumesFn` called once per step with its metadata (a data flow planned per step).
        microbatches: LLM microbatches per step.
        slices: encoder microbatches per LLM microbatch (usually the PP size).
        balance: passed to :func:`split_encoder_microbatches`: ``True`` (default) balances each LLM
            microbatch's encoder FLOPs over its slices; ``False`` cuts its media samples in pack order
            into contiguous runs of near-equal count (the ``--reorder off`` baseline). A resumed run
            must use the same value as the saved one to read the same split.
        reader: decodes payloads (needs a tokenizer for text ids).
        tp_group: this rank's TP group; only its rank 0 reads. ``None``: no TP, this rank reads.
        prefetch: steps of metadata pulled ahead; their payloads are read in the background.
        background: prepare the prefetched steps' metadata on a thread of the filter's own (see the
            module docstring); ``False``: inside :meth:`next`.
        prepare_on_request: with ``background``, start that preparation at :meth:`prepare`, not when
            :meth:`next` returns.
        decode_workers: threads that read and decode payloads (>= 1).
        read_text: this rank builds LLM inputs or labels (the first stage, and the last stage for its
            labels): also read the token ids of every sample of the step (``FilteredStep.text_ids``);
            only ``txt`` members are read for that (and a generation sample's image, turned into code
            tokens in the decode workers: :class:`~omni_data.payload.PayloadReader` ``image_codes``). A
            generation sample whose image is refused or does not decode keeps its place as zeros
            (``FilteredStep.text_errors``), and is counted in :attr:`ledger` when ``count_text_skips``.
        count_text_skips: count those generation samples in :attr:`ledger` on this rank (give it to one
            of the ranks that read the same text, e.g. the last stage, so each is counted once).
        max_skipped_keys: how many placeholder sample keys to keep by name (counts are always complete).
        share: narrows every encoder microbatch to the samples *this rank* encodes, when several ranks of
            one pipeline rank split its encoder microbatches (context-parallel ranks each encoding part
            of the media): ``share(packs, {e: [(pack, sample)]}) -> {e: [(pack, sample)]}``, a pure
            function of the metadata (every rank must compute the same split). ``FilteredStep.microbatches``
            and ``payloads`` then hold this rank's part; ``None``: the whole encoder microbatch.
        text_share: with ``read_text``, the ``(pack, sample)`` whose text ids this rank reads (the samples
            whose tokens it holds: hybrid DP/CP); ``text_ids`` is ``None`` for the others. ``None``: all.
        snapshots: prepare :meth:`snapshot` ahead: ``True`` for every step, a function ``next_step ->
            bool`` for the steps whose state will be saved (a checkpoint's ``due``: the state after
            :meth:`next` handed out step ``next_step - 1``), ``False`` (default): none, :meth:`snapshot`
            takes the state when called. Also settable later as the attribute ``snapshots``.

    Counters: :attr:`ledger` (:class:`~omni_data.skips.SkipLedger`, scope ``"payload"``: per source,
    reason and key, samples whose payload was replaced by a placeholder), on the rank that read them (TP
    rank 0); part of the state. :attr:`skipped` / :attr:`skipped_keys` are its flat views.
    :attr:`image_code_encodes` (not part of the state: a running count of this filter): the generation
    samples whose image this rank's reader turned into code tokens in the steps :meth:`next` handed out
    (with ``read_text``, on the rank that reads: the first and the last pipeline stage each encode the
    samples whose ids they read, as each tokenizes their captions; read-ahead counts in its own step).
    :func:`omni_data.skips.skip_report` on the filter gathers these and every upstream node's skips.

    Owns its decode threads: :meth:`close` (or leaving a ``with`` block) stops them; ``reset`` /
    ``load_state_dict`` cancel reads in flight and wait for running ones before the new state reads.

    Raises:
        ValueError: ``microbatches`` or ``slices`` < 1, a ``consumes`` id outside
            ``1 .. microbatches * slices`` (from ``next`` when a ``consumes`` function returns one),
            ``decode_workers`` < 1, or ``read_text`` with a reader that has no tokenizer.
        PayloadError: (from ``next``) a payload failed for a reason other than undecodable media.
        RuntimeError: (from ``next`` and ``prepare``) the filter was closed.
    """

    def __init__(
        self,
        loader: PackedLoader,
        consumes: Collection[int] | ConsumesFn,
        *,
        microbatches: int,
        slices: int,
        reader: PayloadReader,
        tp_group: Any = None,
        prefetch: int = 1,
        background: bool = False,
        prepare_on_request: bool = False,
        read_text: bool = False,
        max_skipped_keys: int = 1000,
        balance: bool = True,
        decode_workers: int = 1,
        share: Callable[[list[Pack], dict[int, list[SampleIndex]]], dict[int, list[SampleIndex]]]
        | None = None,
        text_share: Callable[[list[Pack]], Collection[SampleIndex]] | None = None,
        snapshots: bool | Callable[[int], bool] = False,
        count_text_skips: bool = True,
    ) -> None:
        super().__init__()
        if microbatches < 1 or slices < 1:
            raise ValueError(
                f"ZeroRedundancyFilter: microbatches ({microbatches}) and slices ({slices}) must be >= 1"
            )
        self.microbatches, self.slices = microbatches, slices
        self.consumes_fn: ConsumesFn | None = consumes if callable(consumes) else None
        self.consumes = frozenset() if callable(consumes) else self._checked(consumes, None)
        if decode_workers < 1:
            raise ValueError(f"ZeroRedundancyFilter: decode_workers must be >= 1, got {decode_workers}")
        if read_text and reader.tokenizer is None:
            raise ValueError("ZeroRedundancyFilter: read_text=True needs a PayloadReader with a tokenizer")
        self.loader = loader
        self.balance = balance
        self.reader = reader
        self.tp_group = tp_group
        self.prefetch = max(0, prefetch)
        self.read_text = read_text
        self.count_text_skips = count_text_skips
        self.share, self.text_share = share, text_share
        self.decode_workers = decode_workers
        self._pending: deque[_Pending] = deque()
        self._pool = ThreadPoolExecutor(max_workers=decode_workers, thread_name_prefix="omni-data-decode")
        # one thread: refills run one at a time and in order
        self._prep = (
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="omni-data-prepare") if background else None
        )
        self._refilling: Future[None] | None = None
        self.prepare_on_request = prepare_on_request
        self._closed = False
        # the pools' threads stop even if the filter is dropped without close()
        self._finalizer = weakref.finalize(self, _shutdown, self._pool, self._prep)
        self.samples_read = 0
        self.image_code_encodes = 0
        self.ledger = SkipLedger("ZeroRedundancyFilter", scope="payload", max_keys=max_skipped_keys)
        self.snapshots = snapshots
        # Snapshot bookkeeping. ``_epoch`` changes only on the caller's thread (next, reset, load_resplit);
        # a preparation runs wholly inside one epoch (every one of those settles it first), so a snapshot
        # of the current epoch is a state the caller could have taken with state_dict().
        self._epoch = 0
        self._next_step: int | None = None
        self._pulls = 0  # calls of next(self.loader): each one may change the loader's state
        self._loader_blob: tuple[int, bytes] | None = None  # (_pulls when taken, msgpack of its state)
        self._ledger_blob: bytes | None = None
        self._prepared: _Prepared | None = None

    @property
    def skipped(self) -> dict[str, int]:
        """Reason -> placeholder count, over all sources."""
        out: dict[str, int] = {}
        for by_reason in self.ledger.counts.values():
            for reason, n in by_reason.items():
                out[reason] = out.get(reason, 0) + n
        return out

    @property
    def skipped_keys(self) -> list[tuple[str, str]]:
        """``(uid, reason)`` of the first placeholders."""
        return [(k, r) for _, k, r in self.ledger.keys]

    def children(self) -> list[Any]:
        return [self.loader]

    def _checked(self, consumes: Collection[int], step: int | None) -> frozenset[int]:
        ids = frozenset(int(e) for e in consumes)
        bad = sorted(e for e in ids if not 1 <= e <= self.microbatches * self.slices)
        if bad:
            at = "" if step is None else f" (returned by the consumes function for step {step})"
            raise ValueError(
                f"ZeroRedundancyFilter: consumes {bad}{at} outside the encoder microbatches "
                f"1..{self.microbatches * self.slices} ({self.microbatches} microbatches x {self.slices} "
                "slices, numbered from 1)"
            )
        return ids

    def _settle(self, *, raise_error: bool = True) -> None:
        """Wait for a background refill; its error (e.g. a bad shard found while packing) is raised here,
        unless the state is being replaced (``raise_error=False``)."""
        refilling, self._refilling = self._refilling, None
        if refilling is None:
            return
        error = refilling.exception()  # waits for it
        if error is not None and raise_error:
            raise error

    def wait_prepared(self) -> None:
        """Wait until the next step's background preparation is done (no-op without ``background``), so
        that what it skipped is in the skip counts: a caller that reports skips per step calls this first
        and counts each skip in the same step as without background preparation.

        Raises:
            Exception: the preparation's error (as :meth:`next` would).
        """
        self._settle()

    def _drain(self) -> None:
        """Cancel the reads in flight and wait for the running ones (after any background refill)."""
        try:
            self._settle(raise_error=False)
        finally:
            for item in self._pending:
                if item.reads is not None:
                    item.reads.cancel()
            for item in self._pending:
                if item.reads is not None:
                    item.reads.wait()
            self._pending.clear()

    def close(self) -> None:
        """Stop the decode (and preparation) threads: pending reads are cancelled, running ones are waited
        for. Afterwards :meth:`next` and :meth:`prepare` raise. Also called on leaving a ``with`` block."""
        self._closed = True
        try:
            self._drain()
        finally:
            _shutdown(self._pool, self._prep, wait=True)
            self._finalizer.detach()

    def __enter__(self) -> ZeroRedundancyFilter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def _reads(self) -> bool:
        return self.tp_group is None or dist.get_rank(self.tp_group) == 0

    def select(self, packs: list[Pack]) -> dict[int, list[SampleIndex]]:
        """All encoder microbatches of a step (:func:`split_encoder_microbatches` with ``balance``), each
        narrowed to this rank's part by ``share`` when one is given."""
        mbs = split_encoder_microbatches(packs, self.microbatches, self.slices, balance=self.balance)
        return mbs if self.share is None else self.share(packs, mbs)

    def _texted(self, packs: list[Pack]) -> list[SampleIndex]:
        """The ``(pack, sample)`` whose text ids this rank reads, in pack order (with ``read_text``)."""
        if not self.read_text:
            return []
        every = [(p, i) for p, pack in enumerate(packs) for i in range(len(pack.samples))]
        if self.text_share is None:
            return every
        wanted = set(self.text_share(packs))
        return [x for x in every if x in wanted]

    def _mine(
        self, batch: StepBatch, mbs: dict[int, list[SampleIndex]], consumes: frozenset[int]
    ) -> list[SampleMeta]:
        return [batch.packs[p].samples[i] for e in sorted(consumes & set(mbs)) for p, i in mbs[e]]

    def _enqueue(self, batch: StepBatch) -> None:
        mbs = self.select(batch.packs)
        consumes = self.consumes
        if self.consumes_fn is not None:
            consumes = self._checked(self.consumes_fn(batch.step, batch.packs, mbs), batch.step)
        reads = None
        if self._reads:
            metas = self._mine(batch, mbs, consumes)
            texted = set(self._texted(batch.packs))
            texts = [batch.packs[p].samples[i] for p, i in sorted(texted)]
            refs = [r for m in metas for r in self.reader.refs(m)] + [
                r for s in texts for r in self.reader.refs(s, media=False)
            ]
            fetched = None
            # per shard, not by the first ref's: a step mixes plain shards with gzip ones, which are never
            # read by byte range (their members are read through a handle, outside the batch)
            refs = [r for r in refs if self.reader.uses_batches(r.url)]
            if refs:
                fetched = self._pool.submit(self.reader.fetch, refs)  # FIFO: runs before the decodes
            reads = _Reads(
                [self._pool.submit(self._read_one, m, fetched) for m in metas],
                [
                    self._pool.submit(
                        self._read_text, p.samples, [(k, i) in texted for i in range(len(p.samples))], fetched
                    )
                    for k, p in enumerate(batch.packs)
                ]
                if self.read_text
                else [],
                fetched,
            )
        self._pending.append(_Pending(batch, mbs, consumes, reads))

    def _read_one(self, meta: SampleMeta, fetched: Future[_Fetched] | None) -> Payload:
        data = None if fetched is None else fetched.result()
        try:
            return self.reader.read(meta, data)
        except SkippedPayloadError as e:
            # the ledger counts under the text before the first ':' (e.g. "non-finite audio samples")
            p = Payload.placeholder(meta, f"{e.skip_reason(meta.modality)}: {e}")
            p.text_ids = self.reader.read_text_ids(meta, data) if meta.text_tokens else None
            return p

    def _read_text(
        self, samples: list[SampleMeta], wanted: list[bool], fetched: Future[_Fetched] | None
    ) -> tuple[list[Any], dict[int, str]]:
        data = None if fetched is None else fetched.result()
        ids: list[Any] = []
        errors: dict[int, str] = {}
        for i, (s, w) in enumerate(zip(samples, wanted)):
            try:
                ids.append(self.reader.read_text_ids(s, data) if w else None)
            except SkippedPayloadError as e:  # a generation sample's image: bad data, not a bad setup
                if s.modality is not Modality.GENERATION:
                    raise
                ids.append(torch.zeros(s.text_tokens, dtype=torch.int64))
                errors[i] = f"{e.skip_reason(Modality.IMAGE)}: {e}"
        return ids, errors

    def _skip(self, p: Payload) -> None:
        self.ledger.add(p.meta.source, p.meta.uid, (p.error or "").split(":", 1)[0])
        self._ledger_blob = None

    def _due(self, next_step: int | None) -> bool:
        if next_step is None:
            return False
        due = self.snapshots
        return bool(due(next_step)) if callable(due) else bool(due)

    def _loader_part(self) -> bytes:
        """The loader's state as msgpack, taken once per change of the loader (on the thread moving it)."""
        cached = self._loader_blob
        if cached is not None and cached[0] == self._pulls:
            return cached[1]
        blob = msgpack.packb(self.loader.state_dict(), use_bin_type=True)
        self._loader_blob = (self._pulls, blob)
        return blob

    def _compose(self, epoch: int, next_step: int, *, joined: bool) -> _Prepared:
        """The current state in msgpack pieces, laid out as ``packb(get_state())`` lays out the dict."""
        pk = msgpack.Packer(use_bin_type=True)
        if self._ledger_blob is None:
            self._ledger_blob = pk.pack(self.ledger.state_dict())
        pending = []
        for item in self._pending:
            if item.blob is None:
                item.blob = pk.pack(item.batch.to_dict())
            pending.append(item.blob)
        parts = (
            pk.pack_map_header(3),
            pk.pack("loader"),
            self._loader_part(),
            pk.pack("pending"),
            pk.pack_array_header(len(pending)),
            *pending,
            pk.pack("ledger"),
            self._ledger_blob,
        )
        return _Prepared(epoch, next_step, parts, b"".join(parts) if joined else None)

    def snapshot(self, *, prepared: bool = True) -> LoaderSnapshot:
        """This filter's state as an immutable msgpack value, for a checkpoint (what
        ``load_state_dict(snap.state())`` resumes from exactly).

        With ``prepared`` and a snapshot prepared for the current step (``snapshots`` said this step is
        saved), returns it without walking the pipeline and without waiting for a preparation in
        flight: the state after that preparation when it is done (the same bytes as
        ``msgpack.packb(state_dict())``), else the state right after the last :meth:`next`. Otherwise
        (``prepared=False``, the synchronous path, or nothing prepared) it is taken now:
        :meth:`state_dict` (which waits for a preparation in flight), deep-copied and msgpack-encoded
        on the calling thread.

        Both kinds resume exactly at the same DP size. A resume under another DP size
        (:meth:`load_resplit`) needs the old ranks' states at the same point: all taken after
        :meth:`wait_prepared` (as omni-train's trainer does before every save), or all before the
        preparation; a mix is refused with :class:`~omni_data.LayoutMismatchError` (different steps).

        Raises:
            Exception: (synchronous path) a background preparation's error, as :meth:`state_dict`.
        """
        snap = self._prepared
        if prepared and snap is not None and snap.epoch == self._epoch:
            return LoaderSnapshot(
                snap.next_step, snap.blob if snap.blob is not None else b"".join(snap.parts)
            )
        state = copy.deepcopy(self.state_dict())
        step = self._pending[0].batch.step if self._pending else self.loader.step
        return LoaderSnapshot(step, msgpack.packb(state, use_bin_type=True))

    def _forget_snapshots(self, *, state_replaced: bool) -> None:
        """A new epoch: the prepared snapshot no longer describes the state. ``state_replaced`` (reset,
        load_resplit): the cached pieces neither (the loader's is otherwise kept while it is still)."""
        self._epoch += 1
        self._next_step = None
        self._prepared = None
        if state_replaced:
            self._loader_blob = None
            self._ledger_blob = None

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self._drain()  # a refill or read already running finishes before the new state reads
        self._forget_snapshots(state_replaced=True)
        self.loader.reset(None if initial_state is None else initial_state["loader"])
        st = initial_state or {}
        self.ledger.load_state_dict(st.get("ledger"))
        if initial_state is not None:
            for d in initial_state["pending"]:  # the pre-filtered buffer: re-filter exactly as before
                self._enqueue(StepBatch.from_dict(d))

    def load_resplit(
        self,
        states: Sequence[dict[str, Any]],
        rank: int,
        world_size: int,
        *,
        skips: Sequence[dict[str, Any]] | None = None,
    ) -> None:
        """Resume as DP rank ``rank`` of ``world_size`` from the states of *every* old DP rank (at any one
        pipeline / TP / CP / Ulysses position of the old layout: their metadata is the same at every
        position, only the payload skip counts differ, so the old layout's position sizes may differ from
        this one's). The pre-filtered steps of all old ranks are broken back into samples and
        redistributed with the packers' buffers (:meth:`PackedLoader.load_resplit`), and the next step is
        the first of them (the step the old ranks would have trained next); payload skip counts go to new
        rank 0.

        Args:
            skips: the old states whose payload skip counts this position's new rank 0 takes over
                (default ``states``); under another position layout, those of the old positions this
                position stands for, so that the counts summed over the new world equal the old world's.

        Raises:
            LayoutMismatchError: the states cannot be re-split exactly; nothing is read.
        """
        states = list(states)
        self._drain()
        self._forget_snapshots(state_replaced=True)
        pending = [StepBatch.from_dict(d) for st in states for d in st["pending"]]
        orphans = [s for b in pending for p in b.packs for s in p.samples]
        self.loader.load_resplit([st["loader"] for st in states], rank, world_size, orphans=orphans)
        if pending:  # the pre-filtered steps were never trained: the loader makes them again, from the first
            self.loader.step = min(b.step for b in pending)
        super().reset(None)
        self.ledger.load_state_dict(None)
        if rank == 0:
            for st in states if skips is None else skips:
                self.ledger.merge(st["ledger"])

    def get_state(self) -> dict[str, Any]:
        self._settle()
        return {
            "loader": self.loader.state_dict(),
            "pending": [item.batch.to_dict() for item in self._pending],
            "ledger": self.ledger.state_dict(),
        }

    def _refill(self, depth: int) -> None:
        """Pull steps from the loader until ``depth`` are pending (fewer when it ends)."""
        while len(self._pending) < depth:
            self._pulls += 1
            try:
                self._enqueue(next(self.loader))
            except StopIteration:
                break

    def _refill_ahead(self, depth: int, epoch: int, next_step: int | None) -> None:
        """The background preparation: :meth:`_refill`, then, on this same thread while the loader is
        still, the snapshot of the resulting state (or only the loader's part, which the next step's
        snapshot of the state right after :meth:`next` reuses)."""
        self._refill(depth)
        if next_step is None:  # prepare() before any next(): no step to snapshot yet
            return
        if self._due(next_step):
            self._prepared = self._compose(epoch, next_step, joined=True)
        elif self._due(next_step + 1):
            self._loader_part()

    def next(self) -> FilteredStep:
        self._check_open()
        self._settle()
        self._forget_snapshots(state_replaced=False)
        # in the foreground only what this call returns (with background preparation the next steps were
        # made while the caller trained); without it, the prefetched steps' reads start before this one
        self._refill(1 if self._prep is not None else self.prefetch + 1)
        if not self._pending:
            raise StopIteration
        item = self._pending.popleft()
        batch, mbs, consumes = item.batch, item.mbs, item.consumes
        metas = self._mine(batch, mbs, consumes)
        payloads, text_ids, text_errors = self._broadcast(batch, metas, item.reads)
        if self._reads:
            self.samples_read += len(metas)
            self.image_code_encodes += sum(
                1
                for k, row in enumerate(text_ids)
                for i, ids in enumerate(row)
                if ids is not None
                and batch.packs[k].samples[i].modality is Modality.GENERATION
                and (k, i) not in text_errors
            )
            for p in payloads:
                if p.error is not None:
                    self._skip(p)
            if self.count_text_skips:
                for (k, i), why in sorted(text_errors.items()):
                    self._skip(Payload(batch.packs[k].samples[i], error=why))
        out: dict[int, list[Payload]] = {}
        at = 0
        for e in sorted(consumes & set(mbs)):
            out[e] = payloads[at : at + len(mbs[e])]
            at += len(mbs[e])
        self._next_step = batch.step + 1
        # refill the prefetch window now, so the next step's reads overlap the caller's compute
        if self._prep is None:
            self._refill(self.prefetch)
            if self._due(self._next_step):  # no thread to make it on: made here, before the save
                self._prepared = self._compose(self._epoch, self._next_step, joined=True)
        else:
            if self._due(self._next_step):  # cheap (the loader's part was made by the thread): pieces only
                self._prepared = self._compose(self._epoch, self._next_step, joined=False)
            if not self.prepare_on_request:
                self.prepare()
        return FilteredStep(batch.step, batch.packs, mbs, out, text_ids, consumes, text_errors)

    def prepare(self) -> None:
        """Start preparing the next steps on the background thread (with ``background``; a no-op when
        it is running already or there is no background thread). :meth:`next` calls it itself unless
        ``prepare_on_request``.

        Raises:
            RuntimeError: the filter was closed.
        """
        self._check_open()
        if self._prep is not None and self._refilling is None:
            self._refilling = self._prep.submit(
                self._refill_ahead, self.prefetch, self._epoch, self._next_step
            )

    def _check_open(self) -> None:
        if self._closed:  # its threads are stopped: their pool would only say it cannot schedule
            raise RuntimeError("ZeroRedundancyFilter: closed (close() was called); it cannot step or prepare")

    def _broadcast(
        self, batch: StepBatch, metas: list[SampleMeta], reads: _Reads | None
    ) -> tuple[list[Payload], list[list[torch.Tensor | None]], dict[SampleIndex, str]]:
        error = ""
        payloads: list[Payload] = []
        text: list[list[torch.Tensor | None]] = []
        text_errors: dict[SampleIndex, str] = {}
        if reads is not None:
            try:
                payloads, text, text_errors = reads.result()
            except PayloadError as e:
                error = str(e)
        if self.tp_group is None:
            if error:
                raise PayloadError(error)
            return payloads, text, text_errors
        src = dist.get_global_rank(self.tp_group, 0)
        status: list[Any] = [
            error,
            {i: p.error for i, p in enumerate(payloads) if p.error is not None},
            sorted(text_errors.items()),
        ]
        dist.broadcast_object_list(status, src=src, group=self.tp_group)
        if status[0]:
            raise PayloadError(f"TP rank 0 failed to read: {status[0]}")
        errors: dict[int, str] = status[1]
        text_errors = {(int(k[0]), int(k[1])): str(why) for k, why in status[2]}
        texted = self._texted(batch.packs)
        all_samples = [batch.packs[p].samples[i] for p, i in texted]
        # buffer sizes follow from metadata alone, so every TP rank allocates the same
        nf = sum(_float_numel(m) for m in metas)
        ni = sum(2 + m.text_tokens for m in metas) + sum(1 + s.text_tokens for s in all_samples)
        fbuf = torch.zeros(nf, dtype=torch.float32)
        ibuf = torch.zeros(ni, dtype=torch.int64)
        if self._reads:
            fa = ia = 0
            for m, p in zip(metas, payloads):
                x = next((t for t in (p.pixels, p.frames, p.waveform) if t is not None), None)
                if x is not None:
                    fbuf[fa : fa + x.numel()] = x.reshape(-1)
                    fa += x.numel()
                ibuf[ia] = p.sample_rate or 0
                ia = _put_ids(ibuf, ia + 1, p.text_ids, m.text_tokens)
            for s, (p, i) in zip(all_samples, texted):
                ia = _put_ids(ibuf, ia, text[p][i], s.text_tokens)
        dist.broadcast(fbuf, src=src, group=self.tp_group)
        dist.broadcast(ibuf, src=src, group=self.tp_group)
        if self._reads:
            return payloads, text, text_errors
        out, fa, ia = [], 0, 0
        for j, m in enumerate(metas):
            p = Payload(m, error=errors.get(j))
            n = _float_numel(m)
            if m.modality is Modality.IMAGE:
                p.pixels = fbuf[fa : fa + n].view(m.shape)
            elif m.modality is Modality.VIDEO:
                p.frames = fbuf[fa : fa + n].view(m.shape)
            elif m.modality is Modality.AUDIO:
                p.waveform = fbuf[fa : fa + n].view(m.shape)
            fa += n
            p.sample_rate = int(ibuf[ia]) or None
            p.text_ids, ia = _get_ids(ibuf, ia + 1, m.text_tokens)
            out.append(p)
        text = [[None] * len(p.samples) for p in batch.packs] if self.read_text else []
        for s, (p, i) in zip(all_samples, texted):
            text[p][i], ia = _get_ids(ibuf, ia, s.text_tokens)
        return out, text, text_errors


_Fetched = dict[tuple[str, int], bytes]


def _shutdown(pool: ThreadPoolExecutor, prep: ThreadPoolExecutor | None, wait: bool = False) -> None:
    if prep is not None:
        prep.shutdown(wait=wait, cancel_futures=True)
    pool.shutdown(wait=wait, cancel_futures=True)


@dataclass(slots=True)
class _Pending:
    """A pre-filtered step: its metadata, encoder microbatches, what this rank runs, its reads in flight."""

    batch: StepBatch
    mbs: dict[int, list[SampleIndex]]
    consumes: frozenset[int]
    reads: _Reads | None
    blob: bytes | None = None  # msgpack of ``batch.to_dict()``, once a snapshot needed it


@dataclass(frozen=True, slots=True)
class _Prepared:
    """A snapshot made ahead: msgpack pieces of the state (``blob``: joined already, or ``None``)."""

    epoch: int
    next_step: int
    parts: tuple[bytes, ...]
    blob: bytes | None


@dataclass(slots=True)
class _Reads:
    """The decode pool's futures of one step: one per payload, one per pack's text ids."""

    payloads: list[Future[Payload]]
    text: list[Future[tuple[list[torch.Tensor | None], dict[int, str]]]]
    fetched: Future[_Fetched] | None

    def _all(self) -> list[Future[Any]]:
        return ([self.fetched] if self.fetched is not None else []) + self.payloads + self.text

    def cancel(self) -> None:
        for f in self._all():
            f.cancel()

    def wait(self) -> None:
        for f in self._all():
            if not f.cancelled():
                f.exception()

    def result(
        self,
    ) -> tuple[list[Payload], list[list[torch.Tensor | None]], dict[SampleIndex, str]]:
        """Results in order (and the generation samples whose image did not decode, by ``(pack,
        sample)``); the first error (in order) is raised after every read finished."""
        self.wait()
        payloads = [f.result() for f in self.payloads]
        text: list[list[torch.Tensor | None]] = []
        errors: dict[SampleIndex, str] = {}
        for k, f in enumerate(self.text):
            ids, errs = f.result()
            text.append(ids)
            errors.update({(k, i): why for i, why in errs.items()})
        return payloads, text, errors


def _put_ids(buf: torch.Tensor, at: int, ids: torch.Tensor | None, n: int) -> int:
    buf[at] = 0 if ids is None else 1
    if ids is not None:
        buf[at + 1 : at + 1 + n] = ids
    return at + 1 + n


def _get_ids(buf: torch.Tensor, at: int, n: int) -> tuple[torch.Tensor | None, int]:
    ids = buf[at + 1 : at + 1 + n].clone() if int(buf[at]) else None
    return ids, at + 1 + n


def _float_numel(m: SampleMeta) -> int:
    if not m.modality.encoded:
        return 0
    n = 1
    for d in m.shape:
        n *= d
    return n

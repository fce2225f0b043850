"""The trainer: every package wired into one training loop, run by each worker process.

Per rank (DESIGN.md, apps/omni-train; MegaScale-Omni §3-§5):

* ``ParallelState`` (omni-parallel) gives the pipeline, data- and tensor-parallel groups. With ``tp > 1``
  each LLM block's attention and SwiGLU are sharded Megatron-style over the TP group
  (``omni_parallel.tensor_parallel``: DTensor parameters, replicated block inputs/outputs); the encoders
  run replicated on every TP rank, both TP ranks of a stage get the same data (the loader reads on TP
  rank 0 and broadcasts), and stage ``s`` TP rank ``t`` talks to stage ``s + 1`` TP rank ``t``.
* Ulysses sequence parallelism (``parallel.ulysses = sp > 1``): each SP rank of a stage holds a
  contiguous ``1/sp`` chunk of every pack (padded to a multiple of ``sp`` with a padding document that has
  no targets), its global RoPE positions and the whole pack's ``cu_seqlens``; attention is
  :func:`omni_parallel.ulysses.ulysses_attention`. The SP ranks read the same packs (the loader reads on
  SP rank 0 and broadcasts, as for TP), every SP rank of stage 0 runs the encoders on the same data and
  scatters exactly the media embeddings that fall into its chunk. Each SP rank's loss is its local CE sum
  over the step's global target count; LLM gradients are summed over the SP group (each rank saw part of
  the sequence), encoder gradients too. Stage ``s`` SP rank ``u`` talks to stage ``s + 1`` SP rank ``u``.
* The LLM stage of this pipeline rank (:class:`~omni_train.models.LLMStage`) and a full copy of the encoders
  (encoder data parallelism spans every rank).
* The data pipeline (:mod:`omni_train.data_pipeline`): every rank of a pipeline builds the same packs from
  metadata; this rank decodes only the payloads of the encoder microbatches the data flow places on it.
* omni-pipeline: a 1F1B schedule, a data flow from the placement policy (``uniform_on_demand`` by default),
  an :class:`EncoderAnchor` holding the encoders, and the :class:`PipelineExecutor` running each step over
  real point-to-point transfers.
* Bad data: a sample whose image/audio body did not decode (omni-data's zero placeholder,
  ``Payload.error``) keeps its place in its pack; its targets are masked and it is counted per step
  (``skipped_payloads``). The decoding rank shares which samples over the pipeline group.
* AdamW (:mod:`omni_train.optim`), and omni-ckpt's :class:`CheckpointManager` with async saves holding the
  model, the optimizer (by parameter name), the loader state and the step.

Determinism: one intra-op thread per process, parameters initialised from seeded private generators, no
dropout, data order from seeded shard shuffles and the deterministic mixture; a resumed run therefore
reproduces the uninterrupted run's losses step for step on CPU.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import msgpack
import torch
import torch.distributed as dist
from tokenizers import Tokenizer
from torch import nn
from torch.distributed.tensor import DTensor

from omni_ckpt import CheckpointManager, load_optimizer_state_dict, optimizer_state_dict
from omni_data import Modality, Pack, snapshot_async, split_encoder_microbatches
from omni_parallel import ParallelConfig, ParallelState
from omni_parallel.tensor_parallel import apply_tensor_parallel, llama_tp_plan
from omni_pipeline.anchor import EncoderAnchor, EncoderDataConfig, EncoderParallelConfig
from omni_pipeline.cost import CostModel
from omni_pipeline.executor import PipelineExecutor, PipelineGroups, StepFunctions, StepPlan
from omni_pipeline.placement import place
from omni_pipeline.schedules import Schedule1F1B
from omni_pipeline.trace import plot_timeline, write_chrome_trace
from omni_train.batch import (
    MODALITIES,
    LLMMicrobatch,
    build_llm_microbatch,
    step_targets,
    ulysses_chunk,
    ulysses_layout,
)
from omni_train.config import RunConfig, bundled_data_dir
from omni_train.data_pipeline import build_step_stream, encoder_imbalance, encoder_load, undecodable_samples
from omni_train.encoders import Encoders
from omni_train.flops import attention_flops, matmul_params, measure_peak_flops, model_flops
from omni_train.loss import microbatch_loss
from omni_train.metrics import MetricsLogger, plot_loss, read_metrics
from omni_train.models.llm import LLMStage
from omni_train.optim import build_optimizer, clip_grad_norm_, lr_at

__all__ = ["Trainer", "worker_main"]


class Trainer:
    """One worker's training run (the default process group must be initialised).

    Args:
        cfg: the validated run config.
        out_dir: the run directory (shared by all ranks).
        resume: continue from the last committed checkpoint under ``out_dir/checkpoints`` (if any).
    """

    def __init__(self, cfg: RunConfig, out_dir: Path, *, resume: bool) -> None:
        self.cfg, self.out, self.resume = cfg, out_dir, resume
        self.out.mkdir(parents=True, exist_ok=True)
        self._enc_positions: dict[int, torch.Tensor] = {}
        par = cfg.parallel
        self.ps = ParallelState.build(
            ParallelConfig(tp=par.tp, pp=par.pp, cp=par.cp, ulysses=par.ulysses, dp=par.dp)
        )
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.pp_rank, self.pp = self.ps.local_rank("pp"), self.ps.size("pp")
        self.dp_rank, self.dp = self.ps.local_rank("dp"), self.ps.size("dp")
        self.tp_rank, self.tp = self.ps.local_rank("tp"), self.ps.size("tp")
        self.sp_rank, self.sp = self.ps.local_rank("ulysses"), self.ps.size("ulysses")
        self.sp_group = self.ps.group("ulysses") if self.sp > 1 else None
        self.is_first, self.is_last = self.pp_rank == 0, self.pp_rank == self.pp - 1
        cuda = torch.cuda.is_available() and "nccl" in str(dist.get_backend())
        self.device = (
            torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
        )
        torch.manual_seed(cfg.train.seed)

        tok_path = Path(cfg.data.tokenizer)
        self.tokenizer = Tokenizer.from_file(
            str(tok_path if tok_path.is_absolute() else bundled_data_dir() / tok_path)
        )
        self.placeholders = {
            Modality.IMAGE: self._special("<|image|>"),
            Modality.AUDIO: self._special("<|audio|>"),
        }
        m = cfg.model
        self.llm_cfg = m.llm_config(self.tokenizer.get_vocab_size())
        self.dtype = getattr(torch, str(cfg.train.dtype))
        self.stage = LLMStage(self.llm_cfg, self.pp_rank, self.pp, seed=m.seed, sp_group=self.sp_group).to(
            self.device, self.dtype
        )
        self.llm_matmul = matmul_params(self.stage)  # before TP: global parameter counts
        if self.tp > 1:
            # Megatron layout per block (column-parallel Q/K/V, gate/up; row-parallel wo, w2): block
            # inputs and outputs stay replicated over TP, so the pipeline sends plain tensors, stage s
            # TP rank t to stage s+1 TP rank t (the pp group of this TP rank).
            tp_mesh = self.ps.device_mesh("tp")
            plan = llama_tp_plan(attention="attn", mlp="mlp")
            for block in self.stage.layers.values():
                apply_tensor_parallel(block, tp_mesh, plan)
        self.encoders = Encoders(m.vit, m.audio, self.llm_cfg.dim, seed=m.seed).to(self.device, self.dtype)
        self.model = nn.ModuleDict({"llm": self.stage, "encoders": self.encoders})
        self.optimizer = build_optimizer([self.stage, self.encoders], cfg.optim)

        self.M = cfg.data.microbatches
        self.schedule = Schedule1F1B(self.pp, self.M)
        self.encoder_inputs = {
            k: [(k - 1) * self.pp + j + 1 for j in range(self.pp)] for k in range(1, self.M + 1)
        }
        # Equal estimated costs per encoder microbatch: the loader's split already balances them
        # (Karmarkar-Karp). fixed_ranks pins encoder microbatch (k-1)*pp + j + 1 to pipeline rank j for
        # the whole run, which the zero-redundancy loader needs before any payload is read. The ratio
        # sets how early encoder forwards are placed.
        enc_share = 0.3
        self.flow = place(
            par.placement,
            self.schedule,
            self.encoder_inputs,
            CostModel(encoder_forward_s={e: enc_share for es in self.encoder_inputs.values() for e in es}),
            fixed_ranks=True,
        )
        self.owner = {e: self.flow.encoder_rank(e) for es in self.encoder_inputs.values() for e in es}
        consumes = set(self.flow.encoders_on(self.pp_rank))
        self.stream = build_step_stream(
            cfg,
            self.tokenizer,
            dp_rank=self.dp_rank,
            dp_size=self.dp,
            dp_group=self.ps.group("dp") if self.dp > 1 else None,
            consumes=consumes,
            read_text=self.is_first or self.is_last,
            # TP and Ulysses peers need identical packs: their rank 0 reads, the others get a broadcast
            # (validation refuses tp > 1 with ulysses > 1).
            tp_group=self.ps.group("tp") if self.tp > 1 else self.sp_group,
        )
        vit = m.vit
        anchor = EncoderAnchor(
            dict(self.encoders.towers.items()),
            EncoderParallelConfig(zero_stage=0),
            EncoderDataConfig(patch_size=vit.patch if vit else 14, max_seq_len=cfg.data.max_seq_len * self.M),
        )
        self._mbs: dict[int, LLMMicrobatch] = {}
        self._packs: list[Pack] = []
        self._masked: set[tuple[int, int]] = set()
        self._targets = 1
        self._loss_scale = 1.0
        functions = StepFunctions(
            first_stage_input=self._first_stage_input,
            loss=self._loss,
            encoder=self._encode,
            stage_kwargs=self._stage_kwargs,
        )
        self.executor = PipelineExecutor(
            {self.pp_rank: self.stage},
            anchor,
            functions,
            PipelineGroups(
                pp=self.ps.group("pp") if self.pp > 1 else None,
                encoder_dp=dist.group.WORLD if self.world > 1 else None,
                # With TP the LLM gradients are DTensors: the trainer averages their local shards.
                llm_dp=self.ps.group("dp") if self.dp > 1 and self.tp == 1 else None,
            ),
            device=self.device,
        )
        self.ckpt = CheckpointManager(
            str(self.out / "checkpoints"),
            keep_last=cfg.checkpoint.keep_last,
            async_save=cfg.checkpoint.async_save,
        )
        self.enc_matmul = {k: matmul_params(t) for k, t in self.encoders.towers.items()}
        self.peak_flops = measure_peak_flops(self.device)

    def _special(self, token: str) -> int:
        i = self.tokenizer.token_to_id(token)
        if i is None:
            raise ValueError(f"tokenizer {self.cfg.data.tokenizer}: special token {token} is missing")
        return i

    # -- the executor's callables -------------------------------------------------------------------------
    def _first_stage_input(self, k: int, outs: dict[int, torch.Tensor]) -> tuple:
        mb = self._mbs[k]
        es = self.encoder_inputs[k]
        embeds = [outs[e] for e in es if e in outs]
        positions = [self._enc_positions[e] for e in es if e in outs]
        media = torch.cat(embeds) if embeds else None
        pos = torch.cat(positions).to(self.device) if positions else None
        if self.sp > 1 and pos is not None:
            # Every SP rank computed all of this pack's media embeddings: keep those in its chunk.
            lo = self.sp_rank * mb.num_tokens
            mine = (pos >= lo) & (pos < lo + mb.num_tokens)
            media, pos = media[mine], pos[mine] - lo
        return (
            mb.input_ids.to(self.device),
            mb.position_ids.to(self.device),
            mb.cu_seqlens.to(self.device),
            media,
            pos,
        )

    def _stage_kwargs(self, stage: int, k: int) -> dict[str, Any]:
        if stage == 0:
            return {}
        pack = self._packs[k - 1]
        cu = torch.zeros(len(pack.samples) + 1, dtype=torch.int64)
        cu[1:] = torch.cumsum(torch.tensor(pack.seqlens, dtype=torch.int64), 0)
        pos = pack.position_ids
        if self.sp > 1:
            pos, cu, _, _ = ulysses_layout(pos, cu, self.sp, self.sp_rank)
        return {"position_ids": pos.to(self.device), "cu_seqlens": cu.to(self.device)}

    def _loss(self, k: int, logits: torch.Tensor):
        mb = self._mbs[k]
        loss, stats = microbatch_loss(logits, _to(mb, self.device), self._targets)
        metrics = {}
        for i, mod in enumerate(MODALITIES):
            metrics[f"ce_{mod}"] = float(stats[i, 0])
            metrics[f"n_{mod}"] = float(stats[i, 1])
        return loss * self._loss_scale, metrics

    def _encode(self, e: int, payloads) -> torch.Tensor:
        return self.encoders(payloads).to(self.dtype)

    # -- one step -------------------------------------------------------------------------------------------
    def _undecodable(self, fs) -> set[tuple[int, int]]:
        """``(pack, sample)`` whose payload failed to decode on any rank of this pipeline: only the rank
        that ran the sample's encoder microbatch knows, the last stage needs it (labels), every stage
        needs the count (the step's targets)."""
        offsets = [0]
        for p in fs.packs:
            offsets.append(offsets[-1] + len(p.samples))
        flags = torch.zeros(offsets[-1], dtype=torch.int32)
        for p, i in undecodable_samples(fs):
            flags[offsets[p] + i] = 1
        if self.pp > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.ps.group("pp"))
        return {
            (p, i)
            for p in range(len(fs.packs))
            for i in range(len(fs.packs[p].samples))
            if flags[offsets[p] + i]
        }

    def _prepare(self, fs) -> StepPlan:
        packs = fs.packs
        self._packs = packs
        masked = self._undecodable(fs)
        self._masked = masked
        if self.is_first or self.is_last:
            self._mbs = {}
            for k, (pack, row) in enumerate(zip(packs, fs.text_ids), start=1):
                ids = {s.uid: t for s, t in zip(pack.samples, row) if t is not None}
                drop = {i for p, i in masked if p == k - 1}
                self._mbs[k] = build_llm_microbatch(pack, ids, self.placeholders, drop)
                if self.sp > 1:
                    self._mbs[k] = ulysses_chunk(self._mbs[k], self.sp, self.sp_rank)
        self._enc_positions = {}
        enc_shapes = {}
        for e, items in fs.microbatches.items():
            pos = [
                torch.arange(sp.start, sp.start + sp.length)
                for p, i in items
                for sp in packs[p].spans
                if sp.sample == i
            ]
            self._enc_positions[e] = torch.cat(pos) if pos else torch.zeros(0, dtype=torch.int64)
            enc_shapes[e] = (int(self._enc_positions[e].numel()), self.llm_cfg.dim)
        llm_shapes = {
            k: (-(-p.num_tokens // self.sp), self.llm_cfg.dim) for k, p in enumerate(packs, start=1)
        }
        targets = torch.tensor([step_targets(packs, masked)], dtype=torch.int64)
        if self.dp > 1:
            dist.all_reduce(targets, group=self.ps.group("dp"))
        self._targets = max(1, int(targets))
        # The executor averages LLM gradients over DP; scaling by DP makes the sum over all DP ranks of
        # (CE sum / global targets) the objective, i.e. the mean over every target token of the step.
        self._loss_scale = float(self.dp)
        return StepPlan(self.schedule, self.flow, llm_shapes, enc_shapes, dtype=self.dtype)

    def _step_flops(self, packs: list[Pack]) -> float:
        """Model FLOPs of this pipeline's step (all stages, encoders included), training (3x forward)."""
        llm = self.llm_cfg
        total = 0.0
        for p in packs:
            # LLM matmul params of the whole model: this stage's share is summed over stages below.
            total += model_flops(0, 0, attention_flops(p.seqlens, llm.dim, llm.n_layers, causal=True))
            for s in p.samples:
                if s.modality is Modality.TEXT or s.modality.value not in self.enc_matmul:
                    continue
                ec = self.cfg.model.vit if s.modality is Modality.IMAGE else self.cfg.model.audio
                seq = s.media_tokens * (ec.merge**2 if s.modality is Modality.IMAGE else 1)
                total += model_flops(
                    self.enc_matmul[s.modality.value],
                    seq,
                    attention_flops([seq], ec.dim, ec.n_layers, causal=False),
                )
        return total

    def run(self) -> dict[str, Any]:
        cfg = self.cfg
        total = cfg.train.steps
        start = self._restore() if self.resume else 0
        if not self.resume:
            self.stream.reset()
        logger = MetricsLogger(self.out, total, start, enabled=self.rank == 0)
        if self.rank == 0:
            (self.out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
            (self.out / "dataflow.json").write_text(self.flow.to_json())
        llm_matmul_all = torch.tensor([float(self.llm_matmul)], dtype=torch.float64)
        if self.pp > 1:
            dist.all_reduce(llm_matmul_all, group=self.ps.group("pp"))
        llm_matmul_all = float(llm_matmul_all)
        t_run = time.perf_counter()
        last_result = None
        for step in range(start, total):
            t0 = time.perf_counter()
            fs = next(self.stream)
            if fs.step != step:
                raise RuntimeError(
                    f"rank {self.rank}: the loader is at step {fs.step}, the trainer at {step}"
                )
            plan = self._prepare(fs)
            lr = lr_at(step, total, cfg.optim)
            for g in self.optimizer.param_groups:
                g["lr"] = lr
            self.optimizer.zero_grad(set_to_none=True)
            want_timeline = step == total - 1
            # The executor leaves a zero .grad on every parameter that got none (an encoder whose
            # modality is absent), so AdamW advances the same way whatever the layout.
            result = self.executor.step(plan, fs.payloads, gather_timelines=want_timeline)
            if self.tp > 1 and self.dp > 1:
                self._average_llm_gradients_over_dp()
            if self.sp > 1:
                self._sum_gradients_over_sp()
            grad_norm = clip_grad_norm_(
                list(self.stage.parameters()),
                list(self.encoders.parameters()),
                cfg.optim.grad_clip,
                self.ps.group("pp") if self.pp > 1 else None,
                tp_group=self.ps.group("tp") if self.tp > 1 else None,
            )
            self.optimizer.step()
            wall = time.perf_counter() - t0
            busy = sum(ev.end_s - ev.start_s for ev in result.timeline)
            row = self._reduce_step(fs.packs, result, wall, busy)
            if want_timeline:
                last_result = result
            if self.rank == 0:
                row.update(self._metrics_row(fs.packs, row, wall, lr, grad_norm, llm_matmul_all))
                logger.log(step, row["log"])
            if self._should_save(step + 1):
                self._save(step + 1)
        self.ckpt.close()
        logger.close()
        elapsed = time.perf_counter() - t_run
        summary: dict[str, Any] = {}
        if self.rank == 0:
            summary = self._finish(last_result, elapsed, start)
        dist.barrier()
        return summary

    def _average_llm_gradients_over_dp(self) -> None:
        """Average this stage's gradients over DP on their local TP shards (same shard on every DP rank)."""
        group = self.ps.group("dp")
        for p in self.stage.parameters():
            if p.grad is None:
                continue
            g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            dist.all_reduce(g, op=dist.ReduceOp.SUM, group=group)
            g.div_(self.dp)

    def _sum_gradients_over_sp(self) -> None:
        """Each SP rank's gradients come from its chunk of every pack: the LLM's are summed over the SP
        group. The executor summed encoder gradients over the world and divided by ``world / pp``
        (``dp * sp`` here), which counts the SP partial sums as replicas: multiply by ``sp``."""
        for p in self.stage.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, op=dist.ReduceOp.SUM, group=self.sp_group)
        for p in self.encoders.parameters():
            if p.grad is not None:
                p.grad.mul_(self.sp)

    def _reduce_step(self, packs: list[Pack], result, wall: float, busy: float) -> dict[str, Any]:
        """One all-reduce over the world: per-rank wall/busy seconds, and (from pipeline rank 0 of each
        DP replica, which holds the broadcast losses) loss and per-modality sums, tokens, samples."""
        n = self.world
        vec = torch.zeros(2 * n + 1 + 2 * len(MODALITIES) + 3, dtype=torch.float64)
        vec[self.rank] = wall
        vec[n + self.rank] = busy
        # TP ranks hold the same losses: count one. SP ranks hold the sums over their chunks: add them.
        if self.pp_rank == 0 and self.tp_rank == 0:
            vec[2 * n] = result.loss / self.dp
            for i, mod in enumerate(MODALITIES):
                vec[2 * n + 1 + i] = sum(m[f"ce_{mod}"] for m in result.metrics.values())
                vec[2 * n + 1 + len(MODALITIES) + i] = sum(m[f"n_{mod}"] for m in result.metrics.values())
        if self.pp_rank == 0 and self.tp_rank == 0 and self.sp_rank == 0:
            vec[-3] = sum(p.num_tokens for p in packs)
            vec[-2] = sum(len(p.samples) for p in packs)
            vec[-1] = len(self._masked)
        dist.all_reduce(vec)
        v = vec.tolist()
        return {
            "wall": v[:n],
            "busy": v[n : 2 * n],
            "loss": v[2 * n],
            "ce": v[2 * n + 1 : 2 * n + 1 + len(MODALITIES)],
            "count": v[2 * n + 1 + len(MODALITIES) : 2 * n + 1 + 2 * len(MODALITIES)],
            "tokens": v[-3],
            "samples": v[-2],
            "skipped_payloads": int(v[-1]),
        }

    def _metrics_row(self, packs, row, wall, lr, grad_norm, llm_matmul_all) -> dict[str, Any]:
        step_s = max(row["wall"])
        mbs_kk = split_encoder_microbatches(packs, self.M, self.pp)
        mbs_in_order = split_encoder_microbatches(packs, self.M, self.pp, balance=False)
        before = encoder_imbalance(encoder_load(packs, mbs_in_order, self.owner, self.pp))
        after = encoder_imbalance(encoder_load(packs, mbs_kk, self.owner, self.pp))
        flops = self._step_flops(packs) + model_flops(llm_matmul_all, sum(p.num_tokens for p in packs), 0.0)
        flops *= self.dp  # every DP replica runs the same amount of work (estimate from this replica)
        log = {
            "loss": row["loss"],
            "loss_per_modality": {
                str(m): row["ce"][i] / row["count"][i]
                for i, m in enumerate(MODALITIES)
                if row["count"][i] > 0
            },
            "targets_per_modality": {str(m): int(row["count"][i]) for i, m in enumerate(MODALITIES)},
            "tokens": row["tokens"],
            "tokens_per_s": row["tokens"] / step_s,
            "samples_per_s": row["samples"] / step_s,
            "skipped_payloads": row["skipped_payloads"],
            "packing_fill": sum(p.num_tokens for p in packs) / (len(packs) * self.cfg.data.max_seq_len),
            "encoder_imbalance_before_reorder": before,
            "encoder_imbalance_after_reorder": after,
            "mfu": flops / step_s / (self.peak_flops * self.world),
            "step_time_s": step_s,
            "idle_s_per_rank": [w - b for w, b in zip(row["wall"], row["busy"])],
            "lr": lr,
            "grad_norm": grad_norm,
        }
        return {"log": log}

    # -- checkpoints ------------------------------------------------------------------------------------------
    def _should_save(self, next_step: int) -> bool:
        every = self.cfg.checkpoint.every
        return next_step == self.cfg.train.steps or (every > 0 and next_step % every == 0)

    def _state(self, loader: bytes) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "optim": optimizer_state_dict(self.model, self.optimizer),
            "loader": loader,
            "step": 0,
        }

    def _save(self, next_step: int) -> None:
        loader = snapshot_async(self.stream).result()
        state = self._state(loader)
        state["step"] = next_step
        handle = self.ckpt.save(next_step, state)
        if handle is not None:
            handle.staged.result()  # weights may change once staged; the write continues in the background

    def _restore(self) -> int:
        """Load the latest committed step; return the step to continue from.

        Step 0 holds initial weights only (``omni-train import-hf`` writes it; the trainer's own saves
        start at step 1): its model is loaded, the optimizer and the loader start fresh.
        """
        latest = self.ckpt.latest()
        if latest is None or latest == 0:
            if latest == 0:
                self.ckpt.load(0, {"model": self.model.state_dict()})
            self.stream.reset()
            return 0
        state = self._state(b"")
        self.ckpt.load(latest, state)
        load_optimizer_state_dict(self.model, self.optimizer, state["optim"])
        self.stream.reset(msgpack.unpackb(state["loader"], strict_map_key=False))
        if int(state["step"]) != latest:
            raise RuntimeError(f"checkpoint step-{latest:08d} holds step {state['step']}")
        return latest

    # -- end of run -------------------------------------------------------------------------------------------
    def _finish(self, result, elapsed: float, start: int) -> dict[str, Any]:
        metrics = read_metrics(self.out / "metrics.jsonl")
        if metrics:
            plot_loss(metrics, self.out / "loss.png")
        if result is not None:
            plot_timeline(
                result.timelines,
                self.out / "timeline.png",
                title=f"{self.cfg.name}: last step, {self.cfg.parallel.placement}",
            )
            write_chrome_trace(result.timelines, self.out / "timeline.json")
        losses = [m["loss"] for m in metrics]
        n = min(20, len(losses) // 2) or 1
        summary = {
            "config": self.cfg.name,
            "steps": len(losses),
            "resumed_from": start,
            "wall_s_this_process": elapsed,
            "first_mean_loss": sum(losses[:n]) / n if losses else None,
            "last_mean_loss": sum(losses[-n:]) / n if losses else None,
            "window": n,
            "mean_tokens_per_s": sum(m["tokens_per_s"] for m in metrics) / len(metrics) if metrics else None,
            "skipped_payloads": sum(m.get("skipped_payloads", 0) for m in metrics),
            "checkpoints": self.ckpt.steps(),
        }
        (self.out / "summary.json").write_text(json.dumps(summary, indent=2))
        return summary


def _to(mb: LLMMicrobatch, device: torch.device) -> LLMMicrobatch:
    if device.type == "cpu":
        return mb
    return LLMMicrobatch(
        mb.input_ids.to(device),
        mb.position_ids.to(device),
        mb.cu_seqlens.to(device),
        mb.labels.to(device),
        mb.label_modality.to(device),
        mb.spans,
        mb.samples,
    )


def worker_main(cfg: RunConfig, out_dir: str, resume: bool) -> dict[str, Any]:
    """Entry point of one worker process (started by the elastic launcher or ``torchrun``).

    A worker restarted by the elastic agent (``TORCHELASTIC_RESTART_COUNT > 0``) resumes from the last
    committed checkpoint.
    """
    torch.set_num_threads(1)
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    if not dist.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            # NCCL for the CUDA tensors (activations, gradients); the trainer's and loaders' bookkeeping
            # collectives (metrics, target counts, loader state) are on CPU tensors and need gloo.
            dist.init_process_group("cpu:gloo,cuda:nccl")
        else:
            dist.init_process_group("gloo")
    try:
        return Trainer(cfg, Path(out_dir), resume=resume or restarted).run()
    finally:
        dist.destroy_process_group()

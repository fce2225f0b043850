"""Per-step FLOPs of a recipe by module, measured with ``torch.utils.flop_counter.FlopCounterMode`` on the
real models and real bundled samples (decoded images and audio, tokenized text).

For each mixture phase of the config (and the paper's reference mixture image:audio:text = 4:4:2), the
config's data pipeline draws ``--steps`` steps with that phase's weights held constant; every pack runs
once through the whole model in one process, the pipeline's way: the encoders' outputs become autograd
leaves, the LLM (embedding, every layer, LM head, loss) runs forward and backward, and the leaves'
gradients then run the encoders' backward. Each module's forward and backward run under its own
``FlopCounterMode``, so the counts are what the executed kernels do (attention per packed document included),
not a formula. Also printed: CPU seconds per module (forward + backward) on one thread (this
thread's CPU time, so other load on the machine matters little; indicative, the FLOP counts are exact).

MegaScale-Omni §1/§2.2's triple-modality example: ViT : audio encoder : LLM = 14.7 : 4.54 : 29.0 TFLOPs
at image:audio:text 4:4:2, i.e. shares 30.4 % : 9.4 % : 60.2 %.

Run: ``uv run python benchmarks/recipe_flops.py --config omni-heavy [--steps 8] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

from omni_data import Modality
from omni_pipeline import build_llm_microbatch, microbatch_loss, step_targets
from omni_train.binder import load_config
from omni_train.config import MixturePhase
from omni_train.data_files import load_tokenizer
from omni_train.data_pipeline import build_step_stream
from omni_train.encoders import Encoders
from omni_train.models.llm import LLMStage

PAPER = {"image": 14.7, "audio": 4.54, "llm": 29.0}
MODULES = ("image", "audio", "llm")


def _counted(flops: dict[str, float], name: str, fn):
    mode = FlopCounterMode(display=False)
    with mode:
        out = fn()
    flops[name] += float(mode.get_total_flops())
    return out


def _timed(secs: dict[str, float], name: str, fn):
    # CPU seconds of this thread: the work, whatever else the machine runs (the loader decodes payloads
    # on its own thread)
    t0 = time.thread_time()
    out = fn()
    secs[name] += time.thread_time() - t0
    return out


def _run_pack(enc, llm, mb, media_inputs, targets, wrap) -> None:
    """Encoders forward (outputs as leaves), LLM forward + loss + backward, encoders backward; each
    module's part runs inside ``wrap(name, fn)``."""
    leaves, positions = [], []
    for kind, payloads, pos in media_inputs:
        out = wrap(kind, lambda payloads=payloads: enc(payloads))
        leaves.append((kind, out, out.detach().requires_grad_(True)))
        positions.append(pos)
    media = torch.cat([leaf for _, _, leaf in leaves]) if leaves else None
    mpos = torch.cat(positions) if positions else None

    def llm_step():
        logits = llm(mb.input_ids, mb.position_ids, mb.cu_seqlens, media, mpos)
        loss, _ = microbatch_loss(logits, mb, targets)
        loss.backward()

    wrap("llm", llm_step)
    for kind, out, leaf in leaves:
        wrap(kind, lambda out=out, leaf=leaf: out.backward(leaf.grad))


def measure_phase(cfg, weights: dict[str, float], steps: int) -> dict:
    """Mean per-step training FLOPs and seconds per module over ``steps`` steps at constant ``weights``."""
    data = dataclasses.replace(cfg.data, mixture=[MixturePhase(weights=dict(weights))])
    cfg = dataclasses.replace(cfg, data=data)
    tok = load_tokenizer(cfg.data)
    m = cfg.model
    llm_cfg = m.llm_config(tok.get_vocab_size())
    llm = LLMStage(llm_cfg, 0, 1, seed=m.seed)
    enc = Encoders(m.vit, m.audio, llm_cfg.dim, seed=m.seed)
    placeholders = {
        Modality.IMAGE: tok.token_to_id("<|image|>"),
        Modality.AUDIO: tok.token_to_id("<|audio|>"),
    }
    slices = cfg.parallel.pp
    every_e = set(range(1, cfg.data.microbatches * slices + 1))
    stream = build_step_stream(
        cfg, tok, dp_rank=0, dp_size=1, dp_group=None, consumes=every_e, read_text=True
    )
    flops = dict.fromkeys(MODULES, 0.0)
    secs = dict.fromkeys(MODULES, 0.0)
    tokens = {"llm": 0, "image_samples": 0, "audio_samples": 0, "text_samples": 0}
    with stream:
        stream.reset()
        for _ in range(steps):
            fs = next(stream)
            targets = max(1, step_targets(fs.packs))
            for p, pack in enumerate(fs.packs):
                ids = {s.uid: t for s, t in zip(pack.samples, fs.text_ids[p]) if t is not None}
                mb = build_llm_microbatch(pack, ids, placeholders)
                tokens["llm"] += mb.num_tokens
                for s in pack.samples:
                    tokens[f"{s.modality}_samples"] += 1
                media_inputs = []
                for kind in ("image", "audio"):
                    payloads, pos = [], []
                    for e, items in fs.microbatches.items():
                        for (pk, i), pl in zip(items, fs.payloads[e]):
                            if pk == p and str(pl.meta.modality) == kind:
                                payloads.append(pl)
                                span = next(sp for sp in pack.spans if sp.sample == i)
                                pos.append(torch.arange(span.start, span.start + span.length))
                    if payloads:
                        media_inputs.append((kind, payloads, torch.cat(pos)))
                # FlopCounterMode slows every op down: count in one pass, time in another
                _run_pack(enc, llm, mb, media_inputs, targets, lambda k, fn: _counted(flops, k, fn))
                _run_pack(enc, llm, mb, media_inputs, targets, lambda k, fn: _timed(secs, k, fn))
    n = steps
    total = sum(flops.values())
    return {
        "weights": dict(weights),
        "steps": n,
        "gflops_per_step": {k: v / n / 1e9 for k, v in flops.items()},
        "share": {k: v / total for k, v in flops.items()},
        "ratio_llm_29": {k: 29.0 * v / flops["llm"] for k, v in flops.items()},
        "seconds_per_step_single_thread": {k: v / n for k, v in secs.items()},
        "llm_tokens_per_step": tokens["llm"] / n,
        "samples_per_step": {k: tokens[f"{k}_samples"] / n for k in ("image", "audio", "text")},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="omni-heavy")
    ap.add_argument("--steps", type=int, default=8, help="steps measured per mixture phase")
    ap.add_argument("--json", default=None, help="write the rows here")
    ap.add_argument(
        "--rows",
        default=None,
        help="comma-separated rows to measure: 0 = the 4:4:2 reference, i + 1 = phase i",
    )
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = load_config(args.config)
    names = {s.modality: s.name for s in cfg.data.sources}
    phases = [("reference 4:4:2", {names["image"]: 4.0, names["audio"]: 4.0, names["text"]: 2.0})]
    for i, ph in enumerate(cfg.data.mixture):
        until = f"until step {ph.until_step}" if ph.until_step is not None else "to the end"
        phases.append((f"phase {i} ({until})", {n: ph.weights.get(n, 0.0) for n in names.values()}))
    if args.rows is not None:
        phases = [phases[int(i)] for i in args.rows.split(",")]
    print(
        f"{cfg.name}: per-step training FLOPs (forward + backward) by module, FlopCounterMode, "
        f"{args.steps} steps per row"
    )
    print(
        f"{'mixture':<24}{'img:aud:txt':>14}{'ViT GF':>9}{'audio GF':>9}{'LLM GF':>9}"
        f"{'ViT:aud:LLM (LLM=29)':>23}{'shares %':>18}{'CPU s':>11}"
    )
    rows = []
    for label, w in phases:
        r = measure_phase(cfg, w, args.steps)
        r["label"] = label
        rows.append(r)
        g, q, s = r["gflops_per_step"], r["ratio_llm_29"], r["share"]
        mix = ":".join(f"{w[names[m]]:g}" for m in ("image", "audio", "text"))
        print(
            f"{label:<24}{mix:>14}{g['image']:>9.2f}{g['audio']:>9.2f}{g['llm']:>9.2f}"
            f"{q['image']:>9.1f} :{q['audio']:>5.1f} :{q['llm']:>5.0f}"
            f"{100 * s['image']:>7.1f}/{100 * s['audio']:>4.1f}/{100 * s['llm']:>4.1f}"
            f"{sum(r['seconds_per_step_single_thread'].values()):>11.2f}"
        )
        sec, n = r["seconds_per_step_single_thread"], r["samples_per_step"]
        print(
            f"{'':<24}per step: {r['llm_tokens_per_step']:.0f} LLM tokens, samples img/aud/txt "
            f"{n['image']:.1f}/{n['audio']:.1f}/{n['text']:.1f}; CPU s ViT {sec['image']:.2f}, "
            f"audio {sec['audio']:.2f}, LLM {sec['llm']:.2f}"
        )
    print(f"paper (§2.2): ViT : audio : LLM = {PAPER['image']} : {PAPER['audio']} : {PAPER['llm']} at 4:4:2")
    if args.json:
        Path(args.json).write_text(json.dumps({"config": cfg.name, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

"""``omni-train import-hf`` / ``export-hf``: Hugging Face folders <-> a run directory's omni-ckpt checkpoints.

Import builds the run's whole model exactly as the trainer does (one pipeline stage holding every layer,
``nn.ModuleDict({"llm": stage, "encoders": encoders})``, seeded initialisation), overwrites what the
Hugging Face folders provide, and saves it as step 0 of ``RUN_DIR/checkpoints`` with one writer
(:func:`omni_ckpt.save_ranks`): ``{"model": state_dict, "step": 0, "hf_import": {family: folder}}``.
A trainer with any pipeline split and TP degree loads it by box intersection (each stage reads its
layers, each TP rank its slice). Step 0 holds weights only: ``omni-train run --resume`` of such a
directory starts at step 0 with a fresh optimizer and a fresh loader (the trainer never saves step 0;
see :meth:`omni_train.checkpointing.TrainCheckpoint.restore`).

Export reads the model tensors of a committed step (the latest by default) back whole, whatever layout
wrote them, and writes one Hugging Face folder per family that the config can express exactly:
``OUT/llm`` (``LlamaForCausalLM`` or ``Qwen2ForCausalLM``, with the run's ``tokenizer.json``),
``OUT/vision`` (Qwen2-VL's vision tower), ``OUT/audio`` (``WhisperEncoder``). A family the config cannot
express is skipped with the reasons named; tensors without a Hugging Face counterpart (the audio
projector) are listed, never silently dropped.

Both sides hold the whole model in host memory (one process), as ``from_pretrained`` does.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from omni_ckpt import save_ranks
from omni_train.checkpointing import checkpoints_root, committed_step_url, read_model_tensors, run_config
from omni_train.config import ConfigError, RunConfig
from omni_train.data_files import load_tokenizer, tokenizer_path
from omni_train.encoders import Encoders
from omni_train.hf.adapter import StateDictAdapter
from omni_train.hf.audio import WhisperEncoderAdapter, audio_config_from_hf, whisper_encoder_problems
from omni_train.hf.folder import DEFAULT_SHARD_BYTES, HFFolderError, read_config, read_weights, write_folder
from omni_train.hf.llm import LlamaAdapter, llm_config_from_hf
from omni_train.hf.vision import Qwen2VLVisionAdapter, qwen2vl_vision_problems, vit_config_from_hf
from omni_train.models.llm import LLMStage

__all__ = ["FAMILIES", "ExportReport", "ImportReport", "build_model", "export_hf", "import_hf", "read_family"]

# family -> where its module sits in the trainer's model state dict
FAMILIES = {"llm": "llm.", "vision": "encoders.towers.image.", "audio": "encoders.towers.audio.encoder."}
_FAMILY_OF = {
    **dict.fromkeys(LlamaAdapter.accepted_model_types, "llm"),
    **dict.fromkeys(Qwen2VLVisionAdapter.accepted_model_types, "vision"),
    **dict.fromkeys(WhisperEncoderAdapter.accepted_model_types, "audio"),
}


@dataclass
class ImportReport:
    """What :func:`import_hf` did.

    Attributes:
        checkpoint: the step-0 checkpoint directory written.
        folders: family -> the Hugging Face folder it came from.
        ignored: family -> tensors of its folder that the model does not use (a Whisper decoder, the
            LLM of a full Qwen2-VL checkpoint, a tied ``lm_head``...).
        kept_init: parts of the model no folder provided (seeded initialisation, as a fresh run).
        untied: the LLM folder ties its head to its embedding and the config does not: our LM head
            starts as a copy of the embedding and trains on its own.
    """

    checkpoint: Path
    folders: dict[str, Path]
    ignored: dict[str, list[str]] = field(default_factory=dict)
    kept_init: list[str] = field(default_factory=list)
    untied: bool = False


@dataclass
class ExportReport:
    """What :func:`export_hf` did: folders written (family -> path), the step exported, families skipped
    with the reasons (config fields), and model tensors that have no Hugging Face counterpart."""

    step: int
    folders: dict[str, Path]
    skipped: dict[str, list[str]] = field(default_factory=dict)
    not_exported: list[str] = field(default_factory=list)


def _vocab_size(cfg: RunConfig) -> int:
    from omni_train.data_pipeline import llm_vocab_size  # + boi, eoi and the codes of an image tokenizer

    return llm_vocab_size(cfg, load_tokenizer(cfg.data).get_vocab_size())


def build_model(cfg: RunConfig, vocab_size: int) -> nn.ModuleDict:
    """The trainer's model on one stage, float32, seeded as the trainer seeds it."""
    stage = LLMStage(cfg.model.llm_config(vocab_size), 0, 1, seed=cfg.model.seed)
    encoders = Encoders(cfg.model.vit, cfg.model.audio, cfg.model.llm.dim, seed=cfg.model.seed)
    return nn.ModuleDict({"llm": stage, "encoders": encoders})


def _folders(dirs: list[str | Path]) -> dict[str, tuple[Path, dict[str, Any]]]:
    """family -> (folder, its config.json): each dir is a model folder, or holds llm/ vision/ audio/."""
    found: dict[str, tuple[Path, dict[str, Any]]] = {}
    for d in map(Path, dirs):
        subs = (
            [d]
            if (d / "config.json").is_file()
            else [d / f for f in FAMILIES if (d / f / "config.json").is_file()]
        )
        if not subs:
            raise HFFolderError(f"{d}: no config.json, and no llm/, vision/ or audio/ folder holding one")
        for folder in subs:
            config = read_config(folder)
            family = _FAMILY_OF.get(config.get("model_type"))
            if family is None:
                raise HFFolderError(
                    f"{folder}: model_type {config.get('model_type')!r} is none of {sorted(_FAMILY_OF)}"
                )
            if family in found:
                raise HFFolderError(f"{folder}: a second {family} folder (the first is {found[family][0]})")
            found[family] = (folder, config)
    return found


def _differences(section: str, ours: Any, theirs: Any, folder: Path) -> list[str]:
    return [
        f"model.{section}.{f.name}: the config has {getattr(ours, f.name)!s}, {folder} needs "
        f"{getattr(theirs, f.name)!s}"
        for f in dataclasses.fields(ours)
        if getattr(ours, f.name) != getattr(theirs, f.name)
    ]


def _adapters(cfg: RunConfig, vocab: int, found: dict[str, tuple[Path, dict[str, Any]]]) -> tuple[dict, bool]:
    """family -> adapter for the config, after checking each folder matches it (ConfigError otherwise)."""
    m, problems, adapters, untied = cfg.model, [], {}, False
    if "llm" in found:
        folder, hf = found["llm"]
        theirs = llm_config_from_hf(hf, vocab, str(folder))
        ours = m.llm_config(vocab)
        untied = theirs.tie_embeddings and not ours.tie_embeddings
        # A tied head loads into either (untied: the head starts as a copy); an untied one needs untied.
        tie = ours.tie_embeddings if theirs.tie_embeddings else False
        problems += _differences("llm", ours, dataclasses.replace(theirs, tie_embeddings=tie), folder)
        adapters["llm"] = LlamaAdapter(ours, hf_tied=theirs.tie_embeddings)
    if "vision" in found:
        folder, hf = found["vision"]
        if m.vit is None:
            problems.append(f"model.vit: {folder} is a vision tower but the config has no [model.vit]")
        else:
            theirs, llm_dim = vit_config_from_hf(hf, m.vit, str(folder))
            problems += _differences("vit", m.vit, theirs, folder)
            if llm_dim != m.llm.dim:
                problems.append(f"model.llm.dim: the config has {m.llm.dim}, {folder} projects to {llm_dim}")
            sub = hf.get("vision_config", hf) if hf.get("model_type") == "qwen2_vl" else hf
            adapters["vision"] = Qwen2VLVisionAdapter(
                m.vit, m.llm.dim, temporal_patch_size=sub.get("temporal_patch_size", 2)
            )
    if "audio" in found:
        folder, hf = found["audio"]
        if m.audio is None:
            problems.append(f"model.audio: {folder} is an audio encoder but the config has no [model.audio]")
        else:
            problems += _differences("audio", m.audio, audio_config_from_hf(hf, m.audio, str(folder)), folder)
            adapters["audio"] = WhisperEncoderAdapter(m.audio)
    if problems:
        raise ConfigError("; ".join(problems))
    return adapters, untied


def read_family(adapter: StateDictAdapter, folder: str | Path) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Our module's tensors from a Hugging Face folder, and the folder's tensor names it does not use.

    The family's tensors are those under the first of ``adapter.prefixes`` holding ``adapter.anchor``
    (a bare model, or the tower inside a full checkpoint: ``model.visual.``, ``model.encoder.``).

    Raises:
        HFFolderError: the anchor is under no prefix, or a tensor is missing (folder and name given).
    """
    weights = read_weights(folder)
    prefix = next((p for p in adapter.prefixes if p + adapter.anchor in weights), None)
    if prefix is None:
        raise HFFolderError(
            f"{folder}: no tensor {adapter.anchor!r} under any of the prefixes {adapter.prefixes}"
        )
    ours = adapter.from_hf({k[len(prefix) :]: v for k, v in weights.items() if k.startswith(prefix)})
    used = {prefix + k for k in adapter.to_hf(ours)}
    return ours, sorted(set(weights) - used)


def _load_family(
    sd: dict[str, torch.Tensor], family: str, adapter: StateDictAdapter, folder: Path
) -> list[str]:
    """Copy the folder's tensors into the model state dict ``sd``; return the folder's unused tensor names."""
    ours, ignored = read_family(adapter, folder)
    for name, t in ours.items():
        target = sd[FAMILIES[family] + name]
        if tuple(target.shape) != tuple(t.shape):
            raise HFFolderError(
                f"{folder}: the tensor for our {FAMILIES[family]}{name} has shape {tuple(t.shape)}, the model "
                f"needs {tuple(target.shape)}"
            )
        with torch.no_grad():
            target.copy_(t)
    return ignored


def import_hf(dirs: list[str | Path], cfg: RunConfig, out: str | Path) -> ImportReport:
    """Write ``out/checkpoints/step-00000000`` (and ``out/config.json``) from Hugging Face folders.

    Args:
        dirs: model folders (dispatched by their ``model_type``: ``llama``/``qwen2`` -> the LLM,
            ``qwen2_vl_vision``/``qwen2_vl`` -> the image tower, ``whisper`` -> the audio encoder), or
            folders holding ``llm/``, ``vision/``, ``audio/`` (what :func:`export_hf` writes).
        cfg: the run config the checkpoint is for; its model section must describe the folders exactly.
        out: the run directory.

    Raises:
        ConfigError: the config does not match a folder (every differing field named), or ``out`` already
            holds checkpoints.
        HFFolderError: a malformed folder, a missing tensor or a wrong shape (folder and tensor named).
    """
    out = Path(out)
    root = out / "checkpoints"
    if root.is_dir() and any(root.glob("step-*")):
        raise ConfigError(f"--out: {out} already holds checkpoints; import into a new run directory")
    vocab = _vocab_size(cfg)
    found = _folders(dirs)
    adapters, untied = _adapters(cfg, vocab, found)
    model = build_model(cfg, vocab)
    sd = model.state_dict()
    ignored = {f: _load_family(sd, f, adapters[f], found[f][0]) for f in adapters}
    kept = sorted({n.rsplit(".", 1)[0] for n in sd if not any(n.startswith(FAMILIES[f]) for f in adapters)})
    state = {"model": sd, "step": 0, "hf_import": {f: str(found[f][0]) for f in adapters}}
    url = str(root / "step-00000000")
    save_ranks([state], url)
    (root / "latest").write_text("step-00000000")
    (out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
    return ImportReport(Path(url), {f: found[f][0] for f in adapters}, ignored, kept, untied)


def export_hf(
    run_dir: str | Path,
    out: str | Path,
    *,
    step: int | None = None,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> ExportReport:
    """Write Hugging Face folders under ``out`` from a committed checkpoint of ``run_dir``.

    Args:
        run_dir: a run directory (its ``config.json`` and ``checkpoints/``), saved with any layout.
        out: the folder to write ``llm/``, ``vision/``, ``audio/`` into.
        step: the step to export (default: the latest committed one).
        max_shard_bytes: weight files above this size are split into indexed shards.

    Raises:
        ConfigError: no readable ``config.json`` or no committed step (or ``step`` is not one).
        omni_ckpt.CheckpointError: the step fails omni-ckpt's checks (checkpoint, tensor and fault named);
            raised by ``read_manifest`` before any tensor is allocated from the manifest.
    """
    run_dir, out = Path(run_dir), Path(out)
    cfg = run_config(run_dir, "export-hf")
    step, url = committed_step_url(checkpoints_root(cfg, run_dir), step, "export-hf")
    tensors = read_model_tensors(url)
    llm = {k.removeprefix("llm."): v for k, v in tensors.items() if k.startswith("llm.")}
    llm_cfg = cfg.model.llm_config(int(llm["tok_embeddings.weight"].shape[0]))
    tok_file = tokenizer_path(cfg.data)
    tok = load_tokenizer(cfg.data)
    parts: dict[str, tuple[StateDictAdapter, list[str]]] = {
        "llm": (
            LlamaAdapter(
                llm_cfg,
                max_position_embeddings=cfg.data.max_seq_len,
                bos_token_id=tok.token_to_id("<|bos|>"),
                eos_token_id=tok.token_to_id("<|eos|>"),
            ),
            [],
        )
    }
    if cfg.model.vit is not None:
        parts["vision"] = (
            Qwen2VLVisionAdapter(cfg.model.vit, llm_cfg.dim),
            qwen2vl_vision_problems(cfg.model.vit),
        )
    if cfg.model.audio is not None:
        parts["audio"] = (WhisperEncoderAdapter(cfg.model.audio), whisper_encoder_problems(cfg.model.audio))
    report = ExportReport(step, {})
    for family, (adapter, problems) in parts.items():
        if problems:
            report.skipped[family] = problems
            continue
        prefix = FAMILIES[family]
        ours = {k.removeprefix(prefix): v for k, v in tensors.items() if k.startswith(prefix)}
        write_folder(out / family, adapter.hf_config(), adapter.to_hf(ours), max_shard_bytes=max_shard_bytes)
        report.folders[family] = out / family
    if "llm" in report.folders:
        shutil.copyfile(tok_file, out / "llm" / "tokenizer.json")
    exported = [FAMILIES[f] for f in report.folders]
    report.not_exported = sorted(n for n in tensors if not any(n.startswith(p) for p in exported))
    return report

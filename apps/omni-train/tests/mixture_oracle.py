"""What the mixture-fidelity tests share: three synthetic sources, a run config over them, the trainer's
own loader stream built from it, and the oracle of the config's weights at a position (phase table and
linear interpolation written out here, not through the trainer's ``mixture_schedule``)."""

from __future__ import annotations

from omni_data.testing import SyntheticSource
from omni_train.binder import config_from_dict
from omni_train.config import RunConfig
from omni_train.data_pipeline import build_step_stream

TOKENS = {"img": ("image", (64, 1500)), "aud": ("audio", (20, 300)), "txt": ("text", (10, 800))}


def fidelity_config(name: str, mixture, *, interpolate: bool = False, buffer_size: int = 256) -> RunConfig:
    """A pp=2 run over ``TOKENS``'s sources with ``mixture`` phases (8 packs of 4,096 tokens per step)."""
    return config_from_dict(
        {
            "name": name,
            "model": {"vit": {}, "audio": {}},
            "data": {
                "sources": [{"name": n, "modality": m, "urls": f"{n}-*.tar"} for n, (m, _) in TOKENS.items()],
                "mixture": mixture,
                "max_seq_len": 4096,
                "microbatches": 8,
                "buffer_size": buffer_size,
                "mixture_interpolate": interpolate,
            },
            "parallel": {"pp": 2},
        }
    )


def scheduled_weights(cfg: RunConfig, position: float, boundary: str) -> dict[str, float]:
    """The config's normalised weights at ``position`` (a step or a token count, as ``boundary`` names the
    phases' end field: ``"until_step"`` or ``"until_tokens"``)."""
    phases = cfg.data.mixture
    starts = [0] + [getattr(p, boundary) for p in phases[:-1]]
    i = max(j for j, s in enumerate(starts) if s <= position)

    def norm(ph):
        total = sum(ph.weights.values())
        return {n: ph.weights.get(n, 0.0) / total for n in TOKENS}

    w = norm(phases[i])
    if cfg.data.mixture_interpolate and i + 1 < len(phases):
        t = (position - starts[i]) / (starts[i + 1] - starts[i])
        w = {n: (1 - t) * w[n] + t * norm(phases[i + 1])[n] for n in TOKENS}
    return w


def synthetic_stream(cfg: RunConfig):
    """The trainer's loader stream (``build_step_stream``) over ``TOKENS``'s synthetic sources, reset."""
    sources = {n: SyntheticSource(n, m, tok, seed=i + 1) for i, (n, (m, tok)) in enumerate(TOKENS.items())}
    stream = build_step_stream(
        cfg, None, dp_rank=0, dp_size=1, dp_group=None, consumes=set(), read_text=False, sources=sources
    )
    stream.reset()
    return stream

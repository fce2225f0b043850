"""Bad inputs to omni-pipeline's public specs and factories raise a ``ValueError`` naming the field and
the value (not a ``TypeError`` or ``AttributeError`` deep inside, and not later, at the first step)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from omni_data import Modality
from omni_parallel import GroupSpec, ParallelConfig, ParallelState
from omni_parallel.testing import run_world
from omni_pipeline import ModelScale, build_schedule
from omni_pipeline.cp_delivery import CPSpec, build_cp_sharding
from omni_pipeline.decoder_stage import DecoderStage
from omni_pipeline.step_inputs import StepSpec
from omni_pipeline.step_plan import PlannerSpec

SCALE = ModelScale(1e6, 64, 2, {"image": 1e5}, {"image": 32}, {"image": 2})


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: build_schedule("zigzag", 2, 4), r"'zigzag' is not a valid ScheduleKind .*'gpipe'"),
        (lambda: build_schedule("gpipe", 2, 0), "num_microbatches and virtual must be >= 1, got 2, 0, 1"),
        (lambda: StepSpec({}, "8"), "StepSpec.llm_dim must be an int, got '8'"),
        (lambda: StepSpec({}, 8, builds_text="no"), "StepSpec.builds_text must be a bool, got 'no'"),
        (lambda: StepSpec({"pictures": 3}, 8), "StepSpec.placeholders: 'pictures' is not a media modality"),
        (lambda: StepSpec({Modality.TEXT: 3}, 8), "StepSpec.placeholders: <Modality.TEXT: 'text'> is not a"),
        (
            lambda: StepSpec({Modality.IMAGE: -1}, 8),
            r"StepSpec.placeholders\[<Modality.IMAGE: 'image'>\] must",
        ),
        (lambda: PlannerSpec(None), "PlannerSpec.scale must be an omni_pipeline.ModelScale"),
        (lambda: ModelScale(0, 64, 2, {}, {}, {}), "ModelScale.llm_params must be a number > 0, got 0"),
        (
            lambda: ModelScale(1e6, 64, 2, {"image": 1e5}, {"image": 32}, {"image": -2}),
            r"ModelScale.encoder_layers\['image'\] must be a number > 0, got -2",
        ),
        (lambda: ModelScale(1e6, 64, 2, {}, {}, {}, image_merge=1.5), "image_merge must be a whole number"),
        (
            lambda: CPSpec(method="zigzag"),
            r"CPSpec.method must be one of \['allgather', 'ring'\], got 'zigzag'",
        ),
        (lambda: CPSpec(max_tokens=-5), "CPSpec.max_tokens must be >= 0, got -5"),
        (lambda: CPSpec(slices=2.0), "CPSpec.slices must be an int, got 2.0"),
        (lambda: CPSpec(hybrid="yes", max_tokens=8), "CPSpec.hybrid must be a bool, got 'yes'"),
        (lambda: CPSpec(hybrid=True, max_tokens=8, encoder_sp=2), "CPSpec.encoder_sp must be 1 under hybrid"),
        (
            lambda: DecoderStage.from_causal_lm(nn.Linear(2, 2), range(0, 1)),
            "DecoderStage.from_causal_lm: Linear has no model.embed_tokens, model.layers, model.norm, "
            "model.rotary_emb, lm_head",
        ),
    ],
)
def test_bad_input_is_refused_naming_the_field(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_a_model_scale_that_makes_sense_is_kept():
    assert PlannerSpec(SCALE).scale is SCALE
    assert StepSpec({Modality.IMAGE: 5, "audio": 6}, 8, torch.float64).placeholders[Modality.AUDIO] == 6


def test_from_causal_lm_names_the_one_attribute_missing():
    lm = nn.Module()
    lm.model = nn.Module()
    lm.model.embed_tokens, lm.model.norm = nn.Embedding(4, 2), nn.Identity()
    lm.model.layers = nn.ModuleList([nn.Identity()])
    lm.lm_head = nn.Linear(2, 4)
    with pytest.raises(ValueError, match=r"Module has no model.rotary_emb \(expects"):
        DecoderStage.from_causal_lm(lm, range(0, 1))


def _one_rank_hybrid(rank, world_size):
    ps = ParallelState.build(ParallelConfig(), groups=GroupSpec(hybrid_cp=True))
    try:
        build_cp_sharding(ps, CPSpec(hybrid=True, max_tokens=8))
    except ValueError as exc:
        return str(exc)
    return None


def test_hybrid_cp_over_one_rank_is_refused():
    (error,) = run_world(_one_rank_hybrid, 1, timeout_s=120)
    assert error == "hybrid DP/CP needs dp * cp >= 2 ranks per stage to share packs, got dp 1 x cp 1"

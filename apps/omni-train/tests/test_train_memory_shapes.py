"""``omni-train memory`` under encoder ZeRO 2/3 computes each rank's encoder shards from the towers' shapes
(``omni_parallel.memory.planned_fsdp_bytes``) instead of building them FSDP2-sharded over every fake rank
(which took 40-80 s per planned rank at 4,096 ranks). The plan must equal, byte for byte and rank for rank,
the plan of the sharded build (``shard_encoders=True``, the trainer's own ``apply_encoder_zero``) at world
sizes that are odd and that leave the last ranks' shards short or empty (ViT dim 64 over 40 ranks:
chunks of 2 rows, ranks 32-39 empty), with the audio tower, LLM ZeRO beside it and several pipeline ranks.
Bundled tiny configs on the meta device, one process.
"""

from __future__ import annotations

import pytest
from train_reference import with_parallel

from omni_train.binder import load_config
from omni_train.memory_plan import memory_plan

CASES = {  # name: (config, gpus, [parallel])
    "omni-6-pp2-ez2-zero2": ("omni-tiny", 6, {"pp": 2, "encoder_zero": 2, "llm_zero": 2}),
    "vlm-7-ez3-zero3": ("vlm-tiny", 7, {"pp": 1, "encoder_zero": 3, "llm_zero": 3}),
    "vlm-40-pp2-ez2": ("vlm-tiny", 40, {"pp": 2, "encoder_zero": 2}),
}


@pytest.mark.parametrize("name", CASES)
def test_encoder_shards_from_shapes_equal_the_sharded_build(name):
    config, gpus, par = CASES[name]
    cfg = with_parallel(load_config(config), **par)
    shapes = memory_plan(cfg, gpus, vocab=512)
    built = memory_plan(cfg, gpus, vocab=512, shard_encoders=True)
    assert shapes == built
    enc = [r["encoders"] for r in shapes["ranks"]]
    # not vacuous: the encoders are sharded, the last rank's shards short (at 40 ranks empty), every
    # rank's storage padded to the first's
    assert enc[-1]["gradients"] < enc[0]["gradients"] and enc[-1]["parameters"] == enc[0]["parameters"]
    assert (enc[-1]["gradients"] == 0) == (gpus == 40)
    in_step = shapes["ranks"][0]["in_step"]["encoders"]
    assert in_step["gradients"] > 0 and (in_step["gathered"] > 0) == (par["encoder_zero"] == 3)


def test_paper_scale_keeps_an_absent_tower_absent():
    """``--scale paper`` of a config without an audio tower (vlm-tiny) sizes its ViT and leaves audio out
    (it raised ``TypeError: replace() should be called on dataclass instances``)."""
    from omni_pipeline.step_costs import MODEL_SHAPES
    from omni_train.memory_plan import paper_config

    cfg = paper_config(load_config("vlm-tiny"))
    assert cfg.model.audio is None and cfg.model.vit.dim == MODEL_SHAPES["vit-1b"].dim

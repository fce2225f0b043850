"""The checkpoint's loader state is prepared ahead (paper §7.4: loader-state saves were 6-20 minute
stragglers until an asynchronous snapshot prepared ahead of time cut them to about 800 ms): a save does not
wait for the loader's preparation of the next step, however slow, and the run resumes from it exactly (the
oracle: the uninterrupted stream's next steps and the saved weights)."""

import torch
from torch import nn

from omni_data import PayloadReader, ZeroRedundancyFilter
from omni_data.testing import GatedLoader, SyntheticSource, packed_loader
from omni_train.checkpointing import TrainCheckpoint
from omni_train.config import CheckpointConfig


def _stream():
    sources = {
        "img": SyntheticSource("img", "image", (20, 90), seed=1),
        "txt": SyntheticSource("txt", "text", (10, 120), seed=2),
    }
    loader = packed_loader(
        sources, {"img": 0.5, "txt": 0.5}, 128, 32, 4, max_open_packs=2, loader=GatedLoader
    )
    # the trainer's preparation mode (omni_train.wiring.step_stream); metadata only: nothing consumed
    return ZeroRedundancyFilter(
        loader,
        consumes=[],
        microbatches=2,
        slices=2,
        reader=PayloadReader(),
        background=True,
        prepare_on_request=True,
    )


def _model():
    model = nn.Linear(4, 3)
    return model, torch.optim.AdamW(model.parameters(), lr=0.1)


def _step(stream, expected):
    fs = next(stream)
    assert fs.step == expected
    stream.prepare()
    return [k for p in fs.packs for k in p.keys]


def test_checkpoint_save_does_not_wait_for_the_loaders_preparation_and_resumes_exactly(tmp_path):
    torch.manual_seed(0)
    model, opt = _model()
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    stream = _stream()
    cfg = CheckpointConfig(every=4, keep_last=2, async_save=True)
    ckpt = TrainCheckpoint(tmp_path / "checkpoints", cfg, 100, model, opt, stream)
    stream.reset()
    with stream:
        for step in range(3):
            _step(stream, step)
            stream.wait_prepared()
        # step 3 handed out; the preparation of step 4 is held inside the loader while state 4 is saved
        fs = next(stream)
        assert fs.step == 3 and ckpt.due(4)
        _, held = stream.loader.while_held(stream, lambda: ckpt.save(4))
        later = [_step(stream, s) for s in (4, 5, 6)]
        ckpt.close()
    assert held, "TrainCheckpoint.save waited for the loader's preparation of the next step"
    saved = {k: v.clone() for k, v in model.state_dict().items()}

    model2, opt2 = _model()
    stream2 = _stream()
    ckpt2 = TrainCheckpoint(tmp_path / "checkpoints", cfg, 100, model2, opt2, stream2)
    with stream2:
        assert ckpt2.restore() == 4
        assert [_step(stream2, s) for s in (4, 5, 6)] == later
        ckpt2.close()
    for k, v in model2.state_dict().items():
        assert torch.equal(v, saved[k]), k

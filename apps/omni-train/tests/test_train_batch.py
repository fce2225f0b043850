"""The in-order encoder split's imbalance (``encoder_load``, ``encoder_imbalance``) and the config's mixture
phases as schedule points. Labels, targets, masking and the loss normalisation are tested in omni-pipeline's
``test_pipeline_step_inputs.py``."""

from omni_data import Modality, Pack, SampleMeta, split_encoder_microbatches
from omni_train.data_pipeline import encoder_imbalance, encoder_load, mixture_schedule


def _meta(key, modality, media, text, flops=0.0):
    shape = (3, 28, 28) if modality is Modality.IMAGE else (1600,) if modality is Modality.AUDIO else (text,)
    return SampleMeta(key, str(modality), modality, media, text, flops, shape)


def _pack():
    return Pack(
        [
            _meta("a", Modality.IMAGE, 3, 2, 5.0),
            _meta("b", Modality.TEXT, 0, 4),
            _meta("c", Modality.AUDIO, 2, 3, 1.0),
            _meta("d", Modality.TEXT, 0, 1),
        ],
        32,
    )


def test_in_order_split_and_imbalance():
    packs = [_pack(), _pack()]
    mbs = split_encoder_microbatches(packs, 2, 2, balance=False)
    assert mbs == {1: [(0, 0)], 2: [(0, 2)], 3: [(1, 0)], 4: [(1, 2)]}
    load = encoder_load(packs, mbs, {1: 0, 2: 1, 3: 0, 4: 1}, 2)
    assert load == {1: [5.0, 1.0], 2: [5.0, 1.0]}
    assert abs(encoder_imbalance(load) - 5.0 / 3.0) < 1e-12
    assert encoder_imbalance({1: [0.0, 0.0]}) is None
    assert encoder_imbalance({1: [0.0, 0.0], 2: [0.0, 4.0]}) == 2.0


def test_mixture_phases_become_schedule_points(tmp_path):
    from train_fixtures import make_dataset, write_config

    from omni_train.binder import load_config

    d = make_dataset(tmp_path, n_image=2, n_audio=2, n_text=2)
    sched = mixture_schedule(load_config(str(write_config(tmp_path / "c.toml", d))).data)
    assert sched.positions == [0, 3]
    assert sched.weights(2) == {"image": 0.5, "audio": 0.2, "text": 0.3}
    assert sched.weights(3) == {"image": 0.3, "audio": 0.4, "text": 0.3}

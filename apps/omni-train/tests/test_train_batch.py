"""The config's mixture phases as schedule points. The in-order encoder split's imbalance is tested in
omni-pipeline's ``test_pipeline_step_metrics.py``; labels, targets, masking and the loss normalisation in
its ``test_pipeline_step_inputs.py``."""

from omni_train.data_pipeline import mixture_schedule


def test_mixture_phases_become_schedule_points(tmp_path):
    from train_fixtures import make_dataset, write_config

    from omni_train.binder import load_config

    d = make_dataset(tmp_path, n_image=2, n_audio=2, n_text=2)
    sched = mixture_schedule(load_config(str(write_config(tmp_path / "c.toml", d))).data)
    assert sched.positions == [0, 3]
    assert sched.weights(2) == {"image": 0.5, "audio": 0.2, "text": 0.3}
    assert sched.weights(3) == {"image": 0.3, "audio": 0.4, "text": 0.3}

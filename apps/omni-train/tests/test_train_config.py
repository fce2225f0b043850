"""Config loading and validation: every error names its field, and fails before any process starts."""

import dataclasses
import shutil

import pytest
from train_fixtures import make_dataset, write_config

from omni_pipeline import PlacementPolicy as Placement
from omni_train.binder import config_path, load_config
from omni_train.cli import build_parser, main, resolve_run
from omni_train.config import ConfigError
from omni_train.data_files import bundled_data_dir, tokenizer_candidates
from omni_train.preflight import validate


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_dataset(tmp_path_factory.mktemp("data"), n_image=4, n_audio=2, n_text=4)


def test_bundled_configs_parse():
    for name in ("omni-tiny", "vlm-tiny"):
        cfg = load_config(name)
        assert cfg.name == name
        assert cfg.parallel.pp == 2 and cfg.parallel.placement is Placement.UNIFORM_ON_DEMAND
        assert len(cfg.data.mixture) >= 2
    assert load_config("omni-tiny").model.audio is not None
    assert load_config("vlm-tiny").model.audio is None
    longtail = load_config("omni-longtail")  # the encoder_balance benchmark's long-tailed image sizes
    validate(longtail, 2)
    assert {s.name: s.max_pixels for s in longtail.data.sources}["large"] > longtail.model.vit.max_pixels


def test_tiny_config_validates(tmp_path, data):
    cfg = load_config(str(write_config(tmp_path / "c.toml", data)))
    validate(cfg, 2)


def _bad(cfg, nproc=2, **changes):
    for path, value in changes.items():
        section, _, key = path.partition("__")
        sub = getattr(cfg, section)
        if "__" in key:
            inner, _, key = key.partition("__")
            sub2 = dataclasses.replace(getattr(sub, inner), **{key: value})
            sub = dataclasses.replace(sub, **{inner: sub2})
        else:
            sub = dataclasses.replace(sub, **{key: value})
        cfg = dataclasses.replace(cfg, **{section: sub})
    with pytest.raises(ConfigError) as exc:
        validate(cfg, nproc)
    return str(exc.value)


def test_each_validation_error_names_its_field(tmp_path, data):
    cfg = load_config(str(write_config(tmp_path / "c.toml", data)))
    assert "does not match the process count 3" in _bad(cfg, nproc=3)
    assert _bad(cfg, parallel__pp=0).startswith("parallel.pp")
    assert _bad(cfg, model__llm__n_kv_heads=3).startswith("model.llm.n_heads")
    assert _bad(cfg, model__llm__n_heads=5).startswith("model.llm.dim")
    assert _bad(cfg, model__llm__n_layers=1).startswith("model.llm.n_layers")
    assert _bad(cfg, data__microbatches=1).startswith("data.microbatches")
    assert _bad(cfg, nproc=4, parallel__tp=2, parallel__pp=2, model__llm__n_kv_heads=1).startswith(
        "model.llm.n_kv_heads"
    )
    assert _bad(
        cfg, nproc=2, parallel__tp=2, parallel__pp=1, model__llm__n_heads=1, model__llm__n_kv_heads=1
    ).startswith("model.llm.n_heads")
    validate(dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, cp=2)), 4)  # CP is wired
    # 4-D layouts: TP with CP (plain and hybrid) and with Ulysses are wired
    for par in ({"cp": 2}, {"cp": 2, "hybrid_cp": True}, {"ulysses": 2}):
        validate(dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, tp=2, **par)), 8)
    assert _bad(cfg, nproc=8, parallel__cp=2, parallel__ulysses=2).startswith("parallel.cp: choose one")
    # Megatron SP with CP or Ulysses: at pp = 1, and with CP at tp = 2 (a CP rank's tokens are even)
    for par in ({"cp": 2}, {"ulysses": 2}):
        sp = dataclasses.replace(cfg.parallel, pp=1, tp=2, sequence_parallel=True, **par)
        validate(dataclasses.replace(cfg, parallel=sp), 4)
    sp = {"parallel__tp": 2, "parallel__sequence_parallel": True}
    assert _bad(cfg, nproc=8, parallel__ulysses=2, **sp).startswith(
        "parallel.sequence_parallel: not combined with parallel.cp 1 / hybrid_cp False / ulysses 2 at "
        "parallel.pp 2"
    )
    assert _bad(cfg, nproc=4, parallel__pp=1, parallel__cp=2, parallel__hybrid_cp=True, **sp).startswith(
        "parallel.sequence_parallel: not combined"
    )
    assert _bad(
        cfg,
        nproc=8,
        model__llm__n_kv_heads=4,
        parallel__pp=1,
        parallel__cp=2,
        parallel__tp=4,
        parallel__sequence_parallel=True,
    ).startswith("parallel.sequence_parallel: with parallel.cp 2 needs parallel.tp = 2 (got 4)")
    assert _bad(
        cfg, nproc=2, parallel__cp=2, parallel__hybrid_cp=True, parallel__pp=1, train__compile=True
    ).startswith("train.compile: not supported with parallel.hybrid_cp")
    assert _bad(cfg, parallel__hybrid_cp=True).startswith("parallel.hybrid_cp: needs dp * cp >= 2")
    assert _bad(cfg, nproc=8, parallel__dp=2, parallel__ulysses=2, parallel__hybrid_cp=True).startswith(
        "parallel.hybrid_cp: not with parallel.ulysses 2"
    )
    # encoder SP shares the LLM's sequence group: Ulysses, or plain CP (hybrid DP/CP's blocks change per pack)
    cp2 = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, cp=2, encoder_sp=2))
    validate(cp2, 4)
    assert _bad(cfg, nproc=4, parallel__cp=2, parallel__encoder_sp=4).startswith(
        "parallel.encoder_sp: 4 must be 1 or the LLM's sequence-parallel size"
    )
    assert _bad(cfg, nproc=4, parallel__cp=2, parallel__hybrid_cp=True, parallel__encoder_sp=2).startswith(
        "parallel.encoder_sp: 2 must be 1 or the LLM's sequence-parallel size"
    )
    assert _bad(
        cfg, nproc=8, parallel__cp=2, parallel__dp=2, parallel__encoder_sp=2, data__reorder_group_size=2
    ).startswith("data.reorder_group_size: 2 with context parallelism")
    joined = [
        dataclasses.replace(s, join_tokens=64 if s.modality == "image" else 0) for s in cfg.data.sources
    ]
    assert _bad(cfg, data__sources=joined).startswith("data.sources[0].join_tokens")
    srcs = [dataclasses.replace(s) for s in cfg.data.sources]
    srcs[1] = dataclasses.replace(srcs[1], urls=str(tmp_path / "nothing-*.tar"))
    msg = _bad(cfg, data__sources=srcs)
    assert msg.startswith("data.sources[1].urls") and "nothing-*.tar" in msg
    mix = [dataclasses.replace(m) for m in cfg.data.mixture]
    mix[0] = dataclasses.replace(mix[0], weights={"imagez": 1.0})
    assert _bad(cfg, data__mixture=mix).startswith("data.mixture[0].weights")
    assert _bad(cfg, data__tokenizer=str(tmp_path / "none.json")).startswith("data.tokenizer")
    assert _bad(cfg, model__llm__tie_embeddings=True).startswith(
        "model.llm.tie_embeddings: needs parallel.pp = 1"
    )
    assert _bad(cfg, model__audio__stem="whisper").startswith("model.audio.subsample: the whisper stem")
    assert _bad(cfg, parallel__encoder_zero=1).startswith("parallel.encoder_zero: 1 is not one of")
    assert _bad(cfg, parallel__encoder_sp=2).startswith("parallel.encoder_sp: 2 must be 1 or the LLM")
    assert _bad(cfg, parallel__long_threshold=0).startswith("parallel.long_threshold")
    assert _bad(cfg, nproc=3, parallel__pp=1, parallel__dp=3, data__reorder_group_size=2).startswith(
        "data.reorder_group_size: 2 must be >= 1 and divide parallel.dp 3"
    )
    srcs = [dataclasses.replace(s) for s in cfg.data.sources]
    srcs[2] = dataclasses.replace(srcs[2], max_pixels=4096)
    assert _bad(cfg, data__sources=srcs).startswith("data.sources[2].min_pixels: resize bounds are for image")
    srcs[2] = cfg.data.sources[2]
    srcs[0] = dataclasses.replace(srcs[0], min_pixels=5000, max_pixels=4000)
    assert _bad(cfg, data__sources=srcs).startswith("data.sources[0].max_pixels: need 0 < min_pixels (5000)")


def test_toml_errors_name_the_key(tmp_path, data):
    p = write_config(tmp_path / "c.toml", data, extra="bogus = 1")
    with pytest.raises(ConfigError, match=r"^train\.bogus: unknown key"):
        load_config(str(p))
    p = write_config(tmp_path / "d.toml", data)
    p.write_text(p.read_text().replace("pp = 2", 'pp = "two"'))
    with pytest.raises(ConfigError, match=r"^parallel\.pp: expected int"):
        load_config(str(p))
    p.write_text(p.read_text().replace('pp = "two"', 'pp = 2\nplacement = "everywhere"'))
    with pytest.raises(ConfigError, match=r"^parallel\.placement: 'everywhere' is not one of"):
        load_config(str(p))
    with pytest.raises(ConfigError, match="no bundled config named 'nope'"):
        load_config("nope")
    p = write_config(tmp_path / "e.toml", data, model={"vit": 'act = "relu"', "audio": 'mel_scale = "htk"'})
    with pytest.raises(ConfigError, match=r"^model\.vit\.act: 'relu' is not one of \['gelu', 'quick_gelu'"):
        load_config(str(p))


def test_cli_overrides_and_exit_status(tmp_path, data, capsys):
    p = write_config(tmp_path / "c.toml", data)
    args = build_parser().parse_args(
        [
            "run",
            "--config",
            str(p),
            "--placement",
            "prepend_first_stage",
            "--reorder",
            "off",
            "--max-steps",
            "3",
            "--out",
            str(tmp_path / "run"),
        ]
    )
    cfg, nproc, out = resolve_run(args)
    assert (cfg.parallel.placement, cfg.parallel.reorder, cfg.train.steps, nproc) == (
        Placement.PREPEND_FIRST_STAGE,
        False,
        3,
        2,
    )
    assert out == tmp_path / "run"
    # A bad process count fails before any process starts: exit status 2 and the field named.
    assert main(["run", "--config", str(p), "--nproc", "3", "--out", str(tmp_path / "x")]) == 2
    assert "does not match the process count 3" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
    assert main(["run", "--config", str(p), "--resume", "--out", str(tmp_path / "none")]) == 2
    assert "holds no checkpoints" in capsys.readouterr().err
    # a run directory with checkpoints is not trained into again from step 0 (its first save would collide)
    (tmp_path / "old" / "checkpoints" / "step-00000002").mkdir(parents=True)
    assert main(["run", "--config", str(p), "--out", str(tmp_path / "old")]) == 2
    assert "--out: " in capsys.readouterr().err
    resolve_run(
        build_parser().parse_args(["run", "--config", str(p), "--out", str(tmp_path / "old"), "--resume"])
    )


def test_cli_dispatches_prepare_data(tmp_path, capsys):
    # an invalid --limit is refused by omni_train.prepare.main before anything is built
    assert main(["prepare-data", "--limit", "0", "--out", str(tmp_path / "o")]) == 2
    assert "--limit" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_tokenizer_resolves_against_the_config_folder_first(tmp_path):
    """``data.tokenizer`` as ``urls``: relative to the config file's folder first, then the bundled data
    (bundled names keep working); a missing one names every place it was looked for."""
    bundled = bundled_data_dir()
    text = (
        config_path("omni-tiny")
        .read_text()
        .replace('urls = "shards/', f'urls = "{bundled.as_posix()}/shards/')
    )
    mine = tmp_path / "run.toml"
    mine.write_text(text)
    cfg = load_config(str(mine))  # no tokenizer beside it: the bundled one of that name
    assert cfg.data.tokenizer == "tokenizer.json"
    assert tokenizer_candidates(cfg) == [tmp_path / "tokenizer.json", bundled / "tokenizer.json"]
    validate(cfg, cfg.parallel.world_size)
    shutil.copy(bundled / "tokenizer.json", tmp_path / "tokenizer.json")  # one beside the config wins
    assert load_config(str(mine)).data.tokenizer == str((tmp_path / "tokenizer.json").resolve())
    mine.write_text(text.replace('tokenizer = "tokenizer.json"', 'tokenizer = "mine.json"'))
    with pytest.raises(ConfigError) as err:
        validate(load_config(str(mine)), 2)
    msg = str(err.value)
    assert msg.startswith("data.tokenizer: 'mine.json' not found; looked in ")
    assert str(tmp_path / "mine.json") in msg and str(bundled / "mine.json") in msg

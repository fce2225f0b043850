"""The data part of a run config: relative ``urls`` resolve against the config file's folder (bundled
configs against the bundled data), a source that names no shard says where it looked, the loader's
options reach omni-data (audio sources get the encoder's sample rate), and ``make-shards`` prints paste-
ready source lines."""

import dataclasses
import os
import shutil
import tomllib
from collections import Counter
from pathlib import Path

import pytest
from tokenizers import Tokenizer
from train_fixtures import make_dataset, write_config

from omni_data.write import WriteReport
from omni_train.binder import load_config
from omni_train.cli import main
from omni_train.config import ConfigError
from omni_train.data_files import bundled_data_dir, data_root
from omni_train.data_pipeline import build_sources, build_step_stream
from omni_train.make_shards import data_toml
from omni_train.preflight import validate


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_dataset(tmp_path_factory.mktemp("data"), n_image=4, n_audio=2, n_text=4)


def _relative_config(tmp_path, data) -> Path:
    """A config in ``tmp_path/exp`` whose urls name ``exp/shards/...`` relative to it."""
    shards = tmp_path / "exp" / "shards"
    shards.mkdir(parents=True)
    for tar in Path(data["root"]).glob("*.tar"):
        shutil.copy(tar, shards / tar.name)
    rel = {**data, **{m: f"shards/{m}-*.tar" for m in ("image", "audio", "text")}}
    return write_config(tmp_path / "exp" / "c.toml", rel)


def test_relative_urls_resolve_against_the_config_folder(tmp_path, data, monkeypatch):
    cfg = load_config(str(_relative_config(tmp_path, data)))
    monkeypatch.chdir(tmp_path)  # not the config's folder: the working directory does not matter
    assert data_root(cfg) == (tmp_path / "exp").resolve()
    validate(cfg, 2)
    sources = build_sources(cfg, Tokenizer.from_file(data["tokenizer"]), dp_rank=0, dp_size=1)
    assert sources["image"].urls == sorted(
        str(p) for p in (tmp_path / "exp" / "shards").resolve().glob("image-*")
    )
    assert sources["audio"].sample_rate == cfg.model.audio.sample_rate == 16000
    assert sources["image"].sample_rate is None
    # bundled configs keep resolving against the bundled data
    tiny = load_config("omni-tiny")
    assert data_root(tiny) == bundled_data_dir()
    validate(tiny, 2)


def test_no_shards_error_says_where_it_looked(tmp_path, data):
    cfg = load_config(str(_relative_config(tmp_path, data)))
    where = (tmp_path / "exp").resolve()
    srcs = [dataclasses.replace(s) for s in cfg.data.sources]
    srcs[1] = dataclasses.replace(srcs[1], urls="shard/audio-*.tar")  # a typo
    bad = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, sources=srcs))
    with pytest.raises(ConfigError) as exc:
        validate(bad, 2)
    msg = str(exc.value)
    assert msg.startswith("data.sources[1].urls: no shards match 'shard/audio-*.tar'")
    assert f"looked for {where}/shard/audio-*.tar" in msg and f"resolve against {where}" in msg
    srcs[1] = dataclasses.replace(srcs[1], urls="shards/audio-{000..002}.tar")  # 002 does not exist
    bad = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, sources=srcs))
    with pytest.raises(ConfigError, match=r"1 shards of .* do not exist \(first: .*/shards/audio-002\.tar"):
        validate(bad, 2)
    for folder in ("shards", ""):  # a folder, or the config's own folder, is not a shard
        srcs[1] = dataclasses.replace(srcs[1], urls=folder)
        bad = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, sources=srcs))
        with pytest.raises(ConfigError, match=r"data.sources\[1\].urls: no shards match"):
            validate(bad, 2)
    mix = [dataclasses.replace(m) for m in cfg.data.mixture]
    for w in (float("nan"), float("inf")):
        mix[0] = dataclasses.replace(mix[0], weights={**mix[0].weights, "text": w})
        bad = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, mixture=mix))
        with pytest.raises(ConfigError, match=r"data.mixture\[0\].weights: weights must be finite"):
            validate(bad, 2)


def test_loader_options_reach_omni_data(tmp_path, data):
    cfg = load_config(str(write_config(tmp_path / "c.toml", data)))
    assert (cfg.data.max_pack_age, cfg.data.decode_workers, cfg.data.mixture_interpolate) == (1, 1, False)
    d = dataclasses.replace(cfg.data, max_pack_age=3, decode_workers=2, mixture_interpolate=True)
    cfg = dataclasses.replace(cfg, data=d)
    stream = build_step_stream(
        cfg,
        Tokenizer.from_file(data["tokenizer"]),
        dp_rank=0,
        dp_size=1,
        dp_group=None,
        consumes=set(),
        read_text=False,
    )
    with stream:
        assert stream.decode_workers == 2 and stream.loader.packer.max_pack_age == 3
        assert stream.loader.mixture.schedule.interpolate
    for field, value in (("decode_workers", 0), ("max_pack_age", -1)):
        bad = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, **{field: value}))
        with pytest.raises(ConfigError, match=rf"^data\.{field}: must be >= "):
            validate(bad, 2)


def test_make_shards_prints_source_lines_and_names_bad_input(tmp_path, capsys):
    folder = tmp_path / "texts"
    folder.mkdir()
    for i in range(3):
        (folder / f"line{i}.txt").write_text(f"line number {i} of a small corpus")
    out = tmp_path / "shards"
    assert main(["make-shards", str(folder), str(out)]) == 0
    printed = capsys.readouterr().out
    (source,) = tomllib.loads(printed)["data"]["sources"]
    assert source == {"name": "text", "modality": "text", "urls": f"{out.resolve()}/text-*.tar"}
    assert [os.path.basename(p) for p in sorted(out.glob("*.tar"))] == ["text-000000.tar"]
    assert main(["make-shards", str(tmp_path / "none"), str(out)]) == 2
    err = capsys.readouterr().err
    assert "configuration error: make-shards: " in err and f"{tmp_path / 'none'} is not a folder" in err


def test_make_shards_weights_keep_a_small_modality():
    report = WriteReport(
        shards={"audio": ["s/audio-000000.tar"], "image": ["s/image-000000.tar"]},
        samples=Counter(audio=2999, image=1),
    )
    data = tomllib.loads(data_toml(report, "/data/s"))
    (phase,) = data["data"]["mixture"]
    # the weights are the sample shares (3,000 samples: the one image is drawn as often as any clip)
    assert phase["weights"] == pytest.approx({"audio": 2999 / 3000, "image": 1 / 3000}, rel=1e-3)
    assert [s["urls"] for s in data["data"]["sources"]] == ["/data/s/audio-*.tar", "/data/s/image-*.tar"]


@pytest.mark.parametrize("folder", ['/data/my "best" shards', "C:\\data\\shards", "/data/tab\there"])
def test_make_shards_toml_escapes_the_path(folder):
    """A shard folder with a quote, a backslash or a control character still gives valid TOML that reads
    back as the same path."""
    report = WriteReport(shards={"image": [f"{folder}/image-000000.tar"]}, samples=Counter(image=3))
    data = tomllib.loads(data_toml(report, f"memory://{folder}"))
    assert [s["urls"] for s in data["data"]["sources"]] == [f"memory://{folder}/image-*.tar"]

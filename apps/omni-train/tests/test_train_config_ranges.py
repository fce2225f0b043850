"""Hostile or mistyped configs refused before any process starts, each with one line naming the field or
the file, exit status 2: the numeric values issue 29 found getting through (``model.llm.dim -128``,
``optim.lr nan``, ...), every numeric field just outside its range (the fields enumerated from the
schema by ``binder.field_paths``, not from the range table, so a field added without a range fails
here), malformed TOML (deeply nested, non-UTF-8, empty, missing tables, oversized), and a read-only
``--out``."""

import contextlib
import dataclasses
import math
import os
import re
import shutil
import tempfile
from pathlib import Path

import pytest
from train_fixtures import make_dataset, write_config

from omni_train.binder import config_from_dict, field_paths, load_config
from omni_train.cli import main
from omni_train.config import FIELD_BOUNDS, ConfigError, check_bounds
from omni_train.preflight import validate


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_dataset(tmp_path_factory.mktemp("data"), n_image=4, n_audio=2, n_text=4)


@pytest.fixture(scope="module")
def config(data, tmp_path_factory):
    return write_config(tmp_path_factory.mktemp("cfg") / "c.toml", data)


def _one_line_error(err: str) -> str:
    """The single line ``omni-train: configuration error: ...`` of ``err`` (and nothing else)."""
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    prefix = "omni-train: configuration error: "
    assert lines[0].startswith(prefix), err
    return lines[0].removeprefix(prefix)


# issue 29: "Config validation lets through" these (1e10 and 1e12 written as integers: as an override
# "1e10" is not an integer and was already refused as such)
LISTED = [
    ("model.llm.dim", "-128"),
    ("model.llm.dim", "0"),
    ("data.max_seq_len", "10000000000"),
    ("data.microbatches", "1000000000000"),
    ("optim.lr", "nan"),
    ("optim.lr", "inf"),
    ("optim.lr", "-1"),
    ("optim.grad_clip", "nan"),
    ("optim.beta1", "2.0"),
    ("data.decode_workers", "1000000"),
    ("model.vit.max_pixels", "10000000000"),
    ("model.vit.patch", "0"),
    ("model.audio.sample_rate", "0"),
]


@pytest.mark.parametrize(("field", "value"), LISTED)
def test_the_values_issue_29_found_are_refused_naming_the_field(tmp_path, config, capsys, field, value):
    out = tmp_path / "run"
    # --print-config: everything `run` checks, then print instead of training (a value that gets
    # through prints the config and exits 0)
    assert (
        main(["run", "--config", str(config), "--out", str(out), "--print-config", f"--{field}", value]) == 2
    )
    message = _one_line_error(capsys.readouterr().err)
    assert message.startswith(f"{field}: must be "), message
    assert not out.exists()


def test_a_refused_value_starts_no_worker(tmp_path, config, capsys):
    """The real command, no --print-config: one line on stderr, exit 2, no run directory (before the
    range checks this run trained on a NaN learning rate and exited 0)."""
    out = tmp_path / "run"
    assert main(["run", "--config", str(config), "--out", str(out), "--optim.lr", "nan"]) == 2
    assert _one_line_error(capsys.readouterr().err) == "optim.lr: must be finite, got nan"
    assert not out.exists()


# -- every numeric field --------------------------------------------------------------------------------

# list items that are numbers (field_paths describes the list, not its items)
_NUMERIC_ITEMS = {"parallel.stage_layers[i]": "an integer"}


def _numeric_fields() -> dict[str, str]:
    """Every int and float field of the schema, ``path -> "an integer" | "a number"``."""
    out = dict(_NUMERIC_ITEMS)
    for path, kind in field_paths():
        if kind.startswith(("an integer", "a number")):
            out[path] = "an integer" if kind.startswith("an integer") else "a number"
    return out


NUMERIC = _numeric_fields()


def test_every_numeric_field_has_a_range_and_every_range_a_field():
    assert sorted(set(NUMERIC) - set(FIELD_BOUNDS)) == [], "numeric fields without a range in FIELD_BOUNDS"
    assert sorted(set(FIELD_BOUNDS) - set(NUMERIC)) == [], "ranges of fields the schema does not have"
    assert len(NUMERIC) >= 60  # the schema, not an empty enumeration


def _concrete(pattern: str) -> str:
    """A field path of the test config for a pattern: item 0 of a list, the image weight of a mixture."""
    return pattern.replace("[i]", "[0]").replace(".KEY", ".image")


def _set(obj, parts: list, value):
    """``obj`` with the field at ``parts`` (names and list indices) set to ``value`` (frozen sections
    replaced, not mutated)."""
    if not parts:
        return value
    head, rest = parts[0], parts[1:]
    if isinstance(head, int):
        items = list(obj) if isinstance(obj, list) else [2, 2]  # parallel.stage_layers unset: 2 stages
        items[head] = _set(items[head], rest, value)
        return items
    if isinstance(obj, dict):
        return {**obj, head: _set(obj.get(head), rest, value)}
    return dataclasses.replace(obj, **{head: _set(getattr(obj, head), rest, value)})


def _with(cfg, path: str, value):
    parts: list = []
    for piece in path.split("."):
        name, *idx = re.split(r"\[(\d+)\]", piece)
        parts.append(name)
        parts += [int(i) for i in idx if i]
    return _set(cfg, parts, value)


def _outside(pattern: str) -> list:
    b, kind = FIELD_BOUNDS[pattern], NUMERIC[pattern]
    if kind == "an integer":
        lo = int(b.lo) if b.lo_open else math.ceil(b.lo) - 1
        hi = int(b.hi) if b.hi_open else math.floor(b.hi) + 1
        return [lo, hi]
    lo = b.lo if b.lo_open else math.nextafter(b.lo, -math.inf)
    hi = b.hi if b.hi_open else math.nextafter(b.hi, math.inf)
    return [lo, hi, math.nan, math.inf, -math.inf]


def _inside(pattern: str) -> list:
    b, kind = FIELD_BOUNDS[pattern], NUMERIC[pattern]
    if kind == "an integer":
        return [
            int(b.lo) + 1 if b.lo_open else math.ceil(b.lo),
            int(b.hi) - 1 if b.hi_open else math.floor(b.hi),
        ]
    return [
        math.nextafter(b.lo, math.inf) if b.lo_open else float(b.lo),
        math.nextafter(b.hi, -math.inf) if b.hi_open else float(b.hi),
    ]


@pytest.fixture(scope="module")
def base(config):
    cfg = load_config(str(config))
    # [model.llm] moe is optional, unset in the test config: set here, so its fields' ranges are exercised
    from omni_train.models.llm import MoESpec

    llm = dataclasses.replace(cfg.model.llm, moe=MoESpec())
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, llm=llm))


@pytest.mark.parametrize("pattern", sorted(NUMERIC))
def test_a_value_just_outside_a_fields_range_is_refused_naming_it(base, pattern):
    field = _concrete(pattern)
    # an entry of a table (mixture weights) is named by its table: "data.mixture[0].weights: weights ..."
    table = field.rpartition(".")[0]
    said = f"{table}: {table.rpartition('.')[2]}" if pattern.endswith(".KEY") else f"{field}:"
    # an entry of a list named per entry ("parallel.stage_layers[0]: stage 0 must hold >= 1")
    bounds = FIELD_BOUNDS[pattern]
    if bounds.item:
        said += f" {bounds.item} {field.rpartition('[')[2].rstrip(']')}"
    must = f"must {bounds.verb} "
    for value in _outside(pattern):
        cfg = _with(base, field, value)
        with pytest.raises(ConfigError, match=rf"^{re.escape(said)} {must}") as refused:
            validate(cfg, 2)
        # a run directory's saved config.json is read through the same check
        with pytest.raises(ConfigError, match=rf"^{re.escape(said)} {must}"):
            config_from_dict(cfg.to_dict())
        assert "\n" not in str(refused.value)
    for value in _inside(pattern):
        check_bounds(_with(base, field, value))


def test_the_range_edges_that_matter_to_torch(base):
    """Hand-written edges (not read from the table): AdamW's betas in [0, 1), a grad clip of 0 measures
    only, a learning rate of 0 is a frozen run."""
    for field, value in [
        ("optim.beta1", 1.0),
        ("optim.beta2", 1.0),
        ("optim.lr", -1e-9),
        ("model.llm.dim", 0),
    ]:
        with pytest.raises(ConfigError, match=rf"^{re.escape(field)}: must be "):
            check_bounds(_with(base, field, value))
    for field, value in [
        ("optim.beta1", 0.0),
        ("optim.beta2", 0.999),
        ("optim.grad_clip", 0.0),
        ("optim.lr", 0.0),
    ]:
        check_bounds(_with(base, field, value))
    check_bounds(base)


def test_a_hang_timeout_not_below_the_collective_timeout_is_refused(tmp_path, config, capsys):
    """A stopped rank blocks the others in a collective: with ``hang_timeout_s >= collective_timeout_s``
    gloo's timeout would end the run before the watchdog names the rank, so the pair is refused."""
    out = tmp_path / "run"
    pair = ["--train.hang_timeout_s", "5", "--train.collective_timeout_s", "3"]
    assert main(["run", "--config", str(config), "--out", str(out), "--print-config", *pair]) == 2
    assert _one_line_error(capsys.readouterr().err).startswith(
        "train.hang_timeout_s: 5 s must be below train.collective_timeout_s 3 s"
    )
    assert not out.exists()
    ok = ["--train.hang_timeout_s", "0", "--train.collective_timeout_s", "3"]  # 0: no watchdog
    assert main(["run", "--config", str(config), "--out", str(out), "--print-config", *ok]) == 0


# -- malformed TOML -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("case", "expect"),
    [
        ("nested_arrays", r"arrays or inline tables nested too deeply"),
        ("nested_tables", r"arrays or inline tables nested too deeply"),
        ("dotted_key", r"line 3: a key of 2000 dotted parts; keys of a run config nest at most 64 deep"),
        ("not_utf8", r"not UTF-8 text \(byte 0xff at offset \d+\); TOML files are UTF-8"),
        ("empty", r"is empty; a run config needs at least the \[model\] and \[data\] tables"),
        ("huge_integer", r"Exceeds the limit \(4300 digits\)"),
        ("oversized", r"is \d+ bytes; a run config is at most 1048576"),
    ],
)
def test_malformed_toml_is_one_line_naming_the_file(tmp_path, config, capsys, case, expect):
    good = config.read_bytes()
    content = {
        "nested_arrays": good + b"\n[extra]\nx = " + b"[" * 5000 + b"]" * 5000 + b"\n",
        "nested_tables": good + b"\n[extra]\nx = " + b"{a=" * 5000 + b"1" + b"}" * 5000 + b"\n",
        "dotted_key": b"# a comment\n\n" + b".".join([b"a"] * 2000) + b" = 1\n" + good,
        "not_utf8": good.replace(b"[model.llm]", b"[model.llm]\n# caf\xff\n"),
        "empty": b"",
        "huge_integer": good.replace(b"steps = 6", b"steps = " + b"9" * 5000),
        "oversized": good + b"\n# " + b"x" * (1 << 20) + b"\n",
    }[case]
    path = tmp_path / f"{case}.toml"
    path.write_bytes(content)
    out = tmp_path / "run"
    assert main(["run", "--config", str(path), "--out", str(out)]) == 2
    message = _one_line_error(capsys.readouterr().err)
    assert message.startswith(f"config: {path}") and re.search(expect, message), message
    assert len(message) < 400, message  # the 2000-part key is not repeated back
    assert not out.exists()


@pytest.mark.parametrize(
    ("cut", "expect"),
    [
        ("[data]", "data: missing (required tables: data)"),
        ('urls = "', "data.sources[0].urls: missing (required keys: urls)"),
    ],
)
def test_a_missing_table_or_key_is_named(tmp_path, config, capsys, cut, expect):
    text = config.read_text()
    if cut == "[data]":  # no [data] table and none of its arrays of tables
        text = text[: text.index("[data]")] + text[text.index("[parallel]") :]
    else:  # the first source without its urls
        start = text.index(cut)
        text = text[:start] + text[text.index("\n", start) + 1 :]
    path = tmp_path / "c.toml"
    path.write_text(text)
    assert main(["run", "--config", str(path), "--out", str(tmp_path / "run")]) == 2
    assert _one_line_error(capsys.readouterr().err) == expect


# -- --out ----------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _unprivileged():
    """Run as a user the file modes apply to: root writes into a read-only folder regardless."""
    if os.geteuid() != 0:
        yield
        return
    os.setegid(65534)
    os.seteuid(65534)  # nobody; the real uid stays root, so the test can switch back
    try:
        yield
    finally:
        os.seteuid(0)
        os.setegid(0)


@pytest.mark.parametrize("where", ["inside", "itself"])
def test_a_read_only_out_is_one_line(tmp_path, capsys, where):
    # the bundled config and data (readable by everyone): the unprivileged user reads them
    ro = Path(tempfile.mkdtemp(prefix="omni-ro-"))
    try:
        ro.chmod(0o555)
        out = ro / "run" if where == "inside" else ro
        # as root first, printing only: what `run` imports on the way is loaded while the interpreter's
        # own files (often under /root) are still readable
        assert main(["run", "--config", "omni-tiny", "--out", str(out), "--print-config"]) == 0
        import importlib.readers  # noqa: F401  (importlib.resources' reader of the bundled config)

        import omni_train.launch
        import omni_train.run_lock  # noqa: F401

        capsys.readouterr()
        with _unprivileged():
            code = main(["run", "--config", "omni-tiny", "--out", str(out), "--max-steps", "2"])
        assert code == 2
        message = _one_line_error(capsys.readouterr().err)
        if where == "inside":
            assert message == f"--out: cannot create the run directory {out} (Permission denied)"
        else:
            assert message.startswith(f"--out: {out} is not writable: cannot create .run.lock."), message
            assert message.endswith("there (Permission denied)"), message
        assert list(ro.iterdir()) == []
    finally:
        ro.chmod(0o755)
        shutil.rmtree(ro)


def test_an_out_on_a_file_is_one_line(tmp_path, config, capsys):
    """(Refused before issue 29 already; kept.)"""
    blocker = tmp_path / "file"
    blocker.write_text("x")
    for out in (blocker, blocker / "run"):
        assert main(["run", "--config", str(config), "--out", str(out)]) == 2
        assert _one_line_error(capsys.readouterr().err) == (
            f"--out: {blocker} is a file, not a directory; name a run directory"
        )

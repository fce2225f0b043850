"""The binder: a run config from TOML, command-line overrides or its saved plain form, type-checked
field by field into :mod:`omni_train.config`'s dataclasses, and back to TOML; what a resume may change.

A config names its TOML file (``omni-tiny`` -> ``omni_train/configs/omni-tiny.toml``) or a path. An
unknown key, a wrong type or a bad override raises :class:`~omni_train.config.ConfigError` whose message
starts with the dotted field name; the checks across fields and against the file system are
:func:`omni_train.preflight.validate`'s.
"""

from __future__ import annotations

import dataclasses
import os
import re
import tomllib
import types
import typing
from collections.abc import Sequence
from enum import StrEnum
from importlib import resources
from pathlib import Path
from typing import Any

from omni_train.config import ConfigError, RunConfig, check_bounds
from omni_train.data_files import tokenizer_candidates

__all__ = [
    "RESUME_MAY_CHANGE",
    "apply_overrides",
    "config_from_dict",
    "config_path",
    "field_paths",
    "load_config",
    "read_toml",
    "resume_differences",
    "to_toml",
]


def config_path(name_or_path: str) -> Path:
    """Resolve ``omni-tiny`` to the bundled TOML, or return an existing path.

    Raises:
        ConfigError: neither a bundled config name nor an existing file.
    """
    p = Path(name_or_path)
    if p.suffix == ".toml" or os.sep in name_or_path:
        if not p.is_file():
            raise ConfigError(f"config: file {name_or_path} does not exist")
        return p
    bundled = Path(str(resources.files("omni_train") / "configs" / f"{name_or_path}.toml"))
    if not bundled.is_file():
        names = sorted(f.stem for f in bundled.parent.glob("*.toml"))
        raise ConfigError(f"config: no bundled config named {name_or_path!r} (have {names})")
    return bundled


def _build(tp: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        if isinstance(value, str) and str in args:  # e.g. parallel.stage_layers = "auto"
            return value
        return _build(args[0], value, where)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a table, got {type(value).__name__}")
        hints = typing.get_type_hints(tp)
        names = {f.name for f in dataclasses.fields(tp) if f.init}
        unknown = sorted(set(value) - names)
        if unknown:
            raise ConfigError(f"{where}.{unknown[0]}: unknown key (allowed: {sorted(names)})".lstrip("."))
        kwargs = {k: _build(hints[k], v, f"{where}.{k}".lstrip(".")) for k, v in value.items()}
        required = [
            f.name
            for f in dataclasses.fields(tp)
            if f.init and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        ]
        missing = [name for name in required if name not in value]
        if missing:
            what = "tables" if all(dataclasses.is_dataclass(hints[n]) for n in missing) else "keys"
            raise ConfigError(
                f"{where}.{missing[0]}: missing (required {what}: {', '.join(missing)})".lstrip(".")
            )
        try:
            return tp(**kwargs)
        except TypeError as exc:
            raise ConfigError(f"{where or 'config'}: {exc}") from None
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list, got {type(value).__name__}")
        (item,) = typing.get_args(tp)
        return [_build(item, v, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a table, got {type(value).__name__}")
        _, vt = typing.get_args(tp)
        return {str(k): _build(vt, v, f"{where}.{k}") for k, v in value.items()}
    if isinstance(tp, type) and issubclass(tp, StrEnum):
        try:
            return tp(value)
        except ValueError:
            raise ConfigError(f"{where}: {value!r} is not one of {[str(m) for m in tp]}") from None
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp in (int, float, str, bool) and (
        not isinstance(value, tp) or (tp is int and isinstance(value, bool))
    ):
        raise ConfigError(f"{where}: expected {tp.__name__}, got {value!r}")
    return value


def load_config(
    name_or_path: str = "omni-tiny", overrides: Sequence[tuple[str, str | None]] = ()
) -> RunConfig:
    """Read and type-check a TOML run config (sizes are checked by :func:`omni_train.preflight.validate`).

    Args:
        name_or_path: a bundled config name or a TOML path.
        overrides: ``(field, value)`` pairs from the command line (:func:`apply_overrides`), applied to
            the TOML's tables before type-checking, so they are checked exactly as the TOML is.

    Raises:
        ConfigError: missing, unreadable, empty, oversized or non-UTF-8 file, TOML syntax error, keys
            nested deeper than TOML configs need (:func:`read_toml`), unknown key, missing required
            table or key, wrong type, bad override, a number out of its range
            (:func:`omni_train.config.check_bounds`); the message names the file or the field.
    """
    path = config_path(name_or_path)
    raw = read_toml(path)
    if not raw and not overrides:
        raise ConfigError(
            f"config: {path} is empty; a run config needs at least the [model] and [data] tables"
        )
    raw.setdefault("name", path.stem)
    apply_overrides(raw, overrides)
    cfg = _build(RunConfig, raw, "")
    check_bounds(cfg)
    cfg.source = str(path)
    # a tokenizer beside the config wins over a bundled one of the same name; made absolute so that
    # every reader of data.tokenizer (and the run's saved config) finds the same file
    first = tokenizer_candidates(cfg)[0]
    if first.is_file():
        cfg.data.tokenizer = str(first.resolve())
    # a calibration run is read again by later runs calibrated from this one (their chain is followed
    # through the saved configs): saved absolute, it names the same directory from wherever they start
    if cfg.parallel.stage_calibration and cfg.parallel.stage_calibration.strip():
        cfg.parallel.stage_calibration = str(Path(cfg.parallel.stage_calibration).resolve())
    return cfg


def config_from_dict(raw: dict[str, Any]) -> RunConfig:
    """A run config from its plain form (:meth:`~omni_train.config.RunConfig.to_dict`, e.g. a run directory's ``config.json``),
    type-checked as :func:`load_config` checks TOML.

    Raises:
        ConfigError: unknown key or wrong type (message names the field).
    """
    if not isinstance(raw, dict) or not isinstance(raw.get("name"), str):
        raise ConfigError("config: expected a table with a string 'name'")
    cfg = _build(RunConfig, raw, "")
    check_bounds(cfg)
    return cfg


# A config is a small hand-written file; these bounds refuse hostile ones before tomllib reads them:
# tomllib keeps every prefix of a dotted key (``a.a.a...``), so memory and time grow with the square of
# its length (a key of 100,000 parts got the process killed for memory), and it recurses once per nested
# array or inline table (RecursionError near 1,000 levels). Run configs nest 4 deep.
_MAX_CONFIG_BYTES = 1 << 20
_MAX_KEY_PARTS = 64
# strings (each kept as one placeholder character and its newlines, so a quoted key part still counts and
# line numbers stay) and comments
_TOML_STRINGS = re.compile(r'"""[\s\S]*?"""|\'\'\'[\s\S]*?\'\'\'|"(?:\\.|[^"\\\n])*"|\'[^\'\n]*\'|#[^\n]*')
# possessive, from word starts only: a long run of key characters cannot make the search quadratic
_DOTTED_KEY = re.compile(
    rf"(?<![A-Za-z0-9_-])[A-Za-z0-9_-]++(?:[ \t]*+\.[ \t]*+[A-Za-z0-9_-]++){{{_MAX_KEY_PARTS},}}"
)


def read_toml(path: Path) -> dict[str, Any]:
    """The tables of the TOML file ``path``, read defensively: at most 1 MiB, UTF-8 (as TOML requires),
    dotted keys of at most 64 parts, nesting within Python's recursion limit.

    Raises:
        ConfigError: ``"config: <path>: ..."`` naming why (unreadable, too large, not UTF-8 with the byte
            offset, a key nested too deeply with its line, the TOML syntax error with line and column).
    """
    try:
        size = path.stat().st_size
        if size > _MAX_CONFIG_BYTES:
            raise ConfigError(f"config: {path} is {size} bytes; a run config is at most {_MAX_CONFIG_BYTES}")
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"config: {path}: cannot read it ({exc.strerror or exc})") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"config: {path}: not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start}); TOML "
            "files are UTF-8"
        ) from None
    bare = _TOML_STRINGS.sub(
        lambda m: "" if m.group()[0] == "#" else "x" + "\n" * m.group().count("\n"), text
    )
    deep = _DOTTED_KEY.search(bare)
    if deep is not None:
        line = bare.count("\n", 0, deep.start()) + 1
        raise ConfigError(
            f"config: {path}: line {line}: a key of {deep.group().count('.') + 1} dotted parts; keys of a "
            f"run config nest at most {_MAX_KEY_PARTS} deep"
        )
    try:
        return tomllib.loads(text)
    except RecursionError:
        raise ConfigError(f"config: {path}: arrays or inline tables nested too deeply") from None
    except ValueError as exc:  # TOMLDecodeError, and integers longer than Python converts
        raise ConfigError(f"config: {path}: {exc}") from None


# -- command-line overrides -----------------------------------------------------------------------------
# ``--parallel.pp 4 --optim.lr 3e-4 --data.sources[0].urls 'x-*.tar'``: each names a field by its dotted
# path (list items by ``[i]``, table entries such as mixture weights by ``.key``) and sets it in the raw
# TOML tables before ``_build`` type-checks them, so an override is checked exactly as the TOML is. The
# string is read by the field's type: ``str`` as is, ``int``/``float``/``bool`` (true/false, on/off,
# yes/no, 1/0) parsed, ``none`` for an optional field, a list of strings comma-separated or as a TOML array,
# any other list or table as a TOML value (``'{ image = 0.5, text = 0.5 }'``).

_PATH_PART = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)((?:\[\d+\])*)$")
_TRUE, _FALSE = ("true", "on", "yes", "1"), ("false", "off", "no", "0")


def _unwrap(tp: Any) -> tuple[Any, bool]:
    """``X | None`` -> ``(X, True)``; anything else -> ``(tp, False)``."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0], True
    return tp, False


def _split_path(path: str) -> list[str | int]:
    parts: list[str | int] = []
    for piece in path.split("."):
        m = _PATH_PART.match(piece)
        if m is None:
            raise ConfigError(f"{path}: not a field path (expected e.g. parallel.pp or data.sources[0].urls)")
        parts.append(m.group(1))
        parts.extend(int(i) for i in re.findall(r"\[(\d+)\]", m.group(2)))
    return parts


def _fields(tp: Any) -> dict[str, Any]:
    hints = typing.get_type_hints(tp)
    return {f.name: hints[f.name] for f in dataclasses.fields(tp) if f.init and f.name != "source"}


def _parse_value(tp: Any, text: str | None, where: str) -> Any:
    """The plain (TOML-like) value ``text`` stands for as a value of type ``tp``; ``None`` text: a bare
    flag (``--train.compile``), true for a bool field."""
    alternatives = typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else ()
    tp, optional = _unwrap(tp)
    if optional and text is not None and text.lower() in ("none", "null"):
        return None
    if text is not None and str in alternatives and not text.lstrip().startswith("["):
        return text  # a list-or-string field given a word (parallel.stage_layers auto)
    if text is None:
        if tp is bool:
            return True
        raise ConfigError(f"{where}: needs a value ({_describe(tp)})")
    if optional and text.lower() in ("none", "null"):
        return None
    if tp is bool:
        if text.lower() in _TRUE + _FALSE:
            return text.lower() in _TRUE
        raise ConfigError(f"{where}: expected a bool (true/false, on/off), got {text!r}")
    if tp is int:
        try:
            return int(text)
        except ValueError:
            raise ConfigError(f"{where}: expected an integer, got {text!r}") from None
    if tp is float:
        try:
            return float(text)
        except ValueError:
            raise ConfigError(f"{where}: expected a number, got {text!r}") from None
    if tp is str:
        return text
    if isinstance(tp, type) and issubclass(tp, StrEnum):
        if text not in {str(m) for m in tp}:
            raise ConfigError(f"{where}: {text!r} is not one of {[str(m) for m in tp]}")
        return text
    if typing.get_origin(tp) is list and typing.get_args(tp) == (str,) and not text.lstrip().startswith("["):
        return [s.strip() for s in text.split(",") if s.strip()]
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        raise ConfigError(f"{where}: expected {_describe(tp)} as a TOML value, got {text!r}") from None


def _describe(tp: Any) -> str:
    tp, optional = _unwrap(tp)
    if isinstance(tp, type) and issubclass(tp, StrEnum):
        name = "one of " + "|".join(str(m) for m in tp)
    elif dataclasses.is_dataclass(tp):
        name = "a table"
    elif typing.get_origin(tp) is list:
        name = "a list"
    elif typing.get_origin(tp) is dict:
        name = "a table"
    else:
        name = {bool: "a bool", int: "an integer", float: "a number", str: "a string"}.get(tp, str(tp))
    return name + (" or none" if optional else "")


def apply_overrides(raw: dict[str, Any], overrides: Sequence[tuple[str, str | None]]) -> dict[str, Any]:
    """Set each ``(field path, value text)`` of ``overrides`` in the raw TOML tables ``raw`` (in place, in
    order; returns ``raw``). See the comment above for the syntax. ``[i]`` may be one past a list's end
    to append an item (given field by field). Types are checked here for the field and again by
    :func:`load_config`'s type-check of the whole config.

    Raises:
        ConfigError: naming the field: an unknown field (with the allowed names), an index out of range,
            a value that does not parse as the field's type (with the allowed values of an enum).
    """
    for path, text in overrides:
        parts = _split_path(path)
        tp: Any = RunConfig
        node: Any = raw
        where = ""
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            tp, _ = _unwrap(tp)
            if isinstance(part, int):
                if typing.get_origin(tp) is not list:
                    raise ConfigError(f"{where}: not a list, [{part}] does not apply")
                where = f"{where}[{part}]"
                (tp,) = typing.get_args(tp)
                if not isinstance(node, list):
                    raise ConfigError(f"{where}: the config has no list here")
                if part > len(node):
                    raise ConfigError(f"{where}: index out of range (the config has {len(node)} items)")
                if part == len(node):
                    node.append({})
                key: str | int = part
            elif dataclasses.is_dataclass(tp):
                fields = _fields(tp)
                where = f"{where}.{part}".lstrip(".")
                if part not in fields:
                    raise ConfigError(f"{where}: unknown field (allowed: {sorted(fields)})")
                tp, key = fields[part], part
            elif typing.get_origin(tp) is dict:
                where = f"{where}.{part}"
                tp, key = typing.get_args(tp)[1], part
            else:
                raise ConfigError(f"{where}: is {_describe(tp)}, it has no field {part!r}")
            if last:
                node[key] = _parse_value(tp, text, where)
                break
            child = node[key] if (isinstance(node, list) or key in node) else None
            if child is None:
                child = [] if typing.get_origin(_unwrap(tp)[0]) is list else {}
                node[key] = child
            if not isinstance(child, dict | list):
                raise ConfigError(f"{where}: is a value, it has no field {parts[i + 1]!r}")
            node = child
    return raw


def field_paths(tp: Any = None, prefix: str = "") -> list[tuple[str, str]]:
    """Every overridable field as ``(dotted path, type description)``: lists of tables as ``path[i]``."""
    out: list[tuple[str, str]] = []
    for name, ft in _fields(RunConfig if tp is None else tp).items():
        inner, _ = _unwrap(ft)
        path = f"{prefix}{name}"
        if dataclasses.is_dataclass(inner):
            out += field_paths(inner, path + ".")
        elif typing.get_origin(inner) is list and dataclasses.is_dataclass(typing.get_args(inner)[0]):
            out += field_paths(typing.get_args(inner)[0], path + "[i].")
        elif typing.get_origin(inner) is dict:
            out.append((path + ".KEY", _describe(typing.get_args(inner)[1])))
        else:
            out.append((path, _describe(ft)))
    return out


def _drop_none(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _drop_none(v) for k, v in obj.items() if v is not None}
    if isinstance(obj, list):
        return [_drop_none(v) for v in obj]
    return obj


def to_toml(cfg: RunConfig) -> str:
    """The config as TOML that :func:`load_config` reads back to an equal config (``source`` left out;
    unset optional fields, which TOML cannot write, left out, i.e. at their default ``None``)."""
    import tomli_w

    plain = cfg.to_dict()
    plain.pop("source", None)
    return tomli_w.dumps(_drop_none(plain))


def _flatten(obj: Any, prefix: str, out: dict[str, Any]) -> dict[str, Any]:
    if isinstance(obj, dict):
        if not obj and prefix:
            out[prefix] = {}
        for k, v in obj.items():
            _flatten(v, f"{prefix}.{k}" if prefix else str(k), out)
    elif isinstance(obj, list) and obj and all(isinstance(v, dict) for v in obj):
        for i, v in enumerate(obj):
            _flatten(v, f"{prefix}[{i}]", out)
        out[f"{prefix}.len"] = len(obj)
    else:
        out[prefix] = obj
    return out


# Fields a resumed run may change (``--resume``, checked by :func:`resume_differences` before any worker
# starts): the length of the run, its checkpoint cadence, the optimizer's hyperparameters and schedule
# (the saved AdamW moments load whatever the learning rate; the cosine schedule is recomputed over the
# new ``train.steps``), execution options that leave the state unchanged, and the parallel sizes and
# sharding stages the checkpoint loads across, together or alone (``omni_train.checkpointing``: model and
# optimizer by box intersection; the loader replayed at the same DP size under another pipeline, TP, CP or
# Ulysses size, re-split over another DP size whatever the other sizes; the few combinations whose loader
# state cannot be carried over are refused by ``omni_train.preflight.check_resume_layout``). Everything else (the model, the data and its mixture, the rest of the parallel layout,
# the seed and the dtype) shapes the saved model,
# optimizer or loader state, or the data order the loader resumes in. From a step-0 checkpoint (weights
# only: ``omni-train import-hf``) only ``model`` must match.
RESUME_MAY_CHANGE = (
    "name",
    "train.steps",
    "train.compile",
    "train.recompute",
    "train.profile_steps",
    "train.collective_timeout_s",
    "train.hang_timeout_s",
    "train.preempt_grace_s",
    "train.on_nonfinite",
    "train.max_nonfinite_steps",
    "train.spike_zscore",
    "train.spike_window",
    "train.recompute_modules",
    "train.offload",
    "parallel.dp",
    "parallel.pp",
    "parallel.tp",
    "parallel.cp",
    "parallel.ulysses",
    "parallel.cp_attention",
    "parallel.sequence_parallel",
    "parallel.async_tp",
    "parallel.ep",
    "parallel.llm_reshard_after_forward",
    "parallel.llm_zero",
    "parallel.encoder_zero",
    "checkpoint",
    "optim",
)


def resume_differences(saved: RunConfig, cfg: RunConfig, *, weights_only: bool = False) -> list[str]:
    """The fields in which ``cfg`` differs from the run's ``saved`` config and that a resume cannot change
    (see :data:`RESUME_MAY_CHANGE`), each as ``"field: saved -> new"``; empty if compatible.

    Args:
        weights_only: the checkpoint to resume holds weights only (step 0): only ``model.*`` counts.
    """
    old, new = _flatten(saved.to_dict(), "", {}), _flatten(cfg.to_dict(), "", {})
    out = []
    for key in sorted(set(old) | set(new)):
        if key == "source" or any(key == f or key.startswith((f + ".", f + "[")) for f in RESUME_MAY_CHANGE):
            continue
        if weights_only and not key.startswith("model."):
            continue
        if old.get(key, "(absent)") != new.get(key, "(absent)"):
            out.append(f"{key}: {old.get(key, '(absent)')!r} -> {new.get(key, '(absent)')!r}")
    return out

"""The generic half of the config: YAML files and dotted overrides -> a dataclass tree.

    YAML file ──┐
                ├─ merged mapping ── build(root, data) ── root(**...) ── __post_init__ checks
    overrides ──┘        (unknown key: ConfigError naming the closest valid one)

It knows nothing of areal's keys: `areal/config.py` holds the schema (the dataclasses, their
documented fields and checks; the objective's sections are areal/trainer/ppo_config.py's) and
binds these functions to its root, `ExperimentConfig`. A section is any dataclass (`Section`
gives it the shared checks); a leaf is a bool, int, float, str, a list of one of them, or one
of them or null; a dict leaf holds a plugin's options (`dataset.options.max_operand=3`
reaches into it), which the plugin's own section checks (build(..., at=...)). Standard
library and PyYAML only: every role imports this first.
"""

import ast
import dataclasses
import difflib
import inspect
import json
import re
import types
import typing
from collections.abc import Iterable, Iterator, Mapping
from functools import cache
from pathlib import Path
from typing import Any, ClassVar, NoReturn, TypeVar

import yaml

T = TypeVar("T")


class ConfigError(ValueError):
    """A user mistake in a config file, an override, or a constructed config."""


# ---- types ---------------------------------------------------------------------------------


class _Mismatch(Exception):
    pass


def is_section(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _type_name(tp: Any) -> str:
    if is_section(tp):
        return "a section (a mapping of its keys)"
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        (inner,) = [a for a in args if a is not type(None)]
        return f"{_type_name(inner)} or null"
    if typing.get_origin(tp) is list:
        return f"a list of {args[0].__name__}s"
    if typing.get_origin(tp) is dict:
        return "a mapping of option names to values"
    return {bool: "a bool (true/false)", int: "an int", float: "a float", str: "a str"}[tp]


def _convert(value: Any, tp: Any) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in typing.get_args(tp):
            return None
        (inner,) = [a for a in typing.get_args(tp) if a is not type(None)]
        return _convert(value, inner)
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise _Mismatch
        return [_convert(v, typing.get_args(tp)[0]) for v in value]
    if origin is dict:  # a plugin's options: their own section checks them
        if not isinstance(value, Mapping):
            raise _Mismatch
        return {str(k): v for k, v in value.items()}
    # bool is a subclass of int: `lr: true` is a mistake, not 1.0.
    if tp is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if tp is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if tp in (bool, str) or is_section(tp):
        if isinstance(value, tp):
            return value
        raise _Mismatch
    raise _Mismatch


def short(value: Any) -> str:
    """A value for a message: its repr, cut to 60 characters."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def convert_checked(value: Any, tp: Any, key: str) -> Any:
    """`value` as the field type `tp` (int -> float allowed); ConfigError naming `key` if not."""
    try:
        return _convert(value, tp)
    except _Mismatch:
        hint = ""
        if isinstance(value, Mapping) and not is_section(tp) and typing.get_origin(tp) is not dict:
            hint = f": {key} is a single value, not a section"
        raise ConfigError(
            f"{key} expects {_type_name(tp)}, got {short(value)} ({type(value).__name__}){hint}"
        ) from None


# ---- sections ------------------------------------------------------------------------------


class Section:
    """A config section with its shared checks; `_section` is its dotted path, so messages
    name keys. A plugin's options (a task's: dataset.options) are a Section too."""

    _section: ClassVar[str] = ""

    def _key(self, name: str) -> str:
        return f"{self._section}.{name}" if self._section else name

    def _fail(self, name: str, msg: str) -> NoReturn:
        raise ConfigError(f"{self._key(name)} {msg}")

    def _check_types(self) -> None:
        # Runs first in every __post_init__ so that direct construction and loading share
        # one type check, and int -> float is normalised once.
        hints = typing.get_type_hints(type(self))  # a plugin's section may postpone them
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            setattr(self, f.name, convert_checked(value, hints[f.name], self._key(f.name)))

    def _positive(self, *names: str) -> None:
        for name in names:
            value = getattr(self, name)
            if not value > 0:  # `not >` also rejects NaN
                self._fail(name, f"must be > 0, got {value!r}")

    def _non_negative(self, *names: str) -> None:
        for name in names:
            value = getattr(self, name)
            if not value >= 0:
                self._fail(name, f"must be >= 0, got {value!r}")

    def _one_of(self, name: str, choices: tuple[str, ...]) -> None:
        value = getattr(self, name)
        if value not in choices:
            self._fail(name, f"must be one of {', '.join(choices)}; got {value!r}")

    def to_dict(self) -> dict[str, Any]:
        """This config as a nested dict of plain YAML-able values."""
        return dataclasses.asdict(self)

    def save(self, path: str | Path) -> None:
        """Write this config as YAML that `load` reads back to an equal config."""
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=None))


# ---- keys ----------------------------------------------------------------------------------


def walk(cls: type, prefix: str = "") -> Iterator[tuple[str, dataclasses.Field, type]]:
    """(dotted key, field, owning class) for every field, sections before their leaves."""
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        yield key, f, cls
        if is_section(f.type):
            yield from walk(f.type, key + ".")


@cache
def _all_keys(root: type) -> dict[str, Any]:
    """Every dotted key (sections and leaves) -> its type."""
    return {key: f.type for key, f, _ in walk(root)}


def _unknown_key(root: type, key: str, at: str = "") -> ConfigError:
    """The error for `key` (relative to root, found at dotted `at`), with the closest keys."""
    keys = list(_all_keys(root))
    parent, _, last = key.rpartition(".")
    parent_tp = _all_keys(root).get(parent) if parent else root
    siblings = [f.name for f in dataclasses.fields(parent_tp)] if is_section(parent_tp) else []
    # Most telling first: a bare `lr` means `trainer.lr`; `trainer.lrr` is a sibling typo;
    # otherwise a typo anywhere in the dotted key ('trianer.lr').
    matches = (
        [k for k in keys if k.rpartition(".")[2] == last]
        or [f"{parent}.{m}" if parent else m for m in difflib.get_close_matches(last, siblings, 1)]
        or difflib.get_close_matches(key, keys, n=1, cutoff=0.8)
    )
    msg = f"unknown config key {at + key!r}"
    if matches:
        return ConfigError(f"{msg}: did you mean {' or '.join(repr(at + m) for m in matches)}?")
    if siblings:
        where = (
            f"of {at + parent!r}" if parent else (f"of {at[:-1]!r}" if at else "at the top level")
        )
        return ConfigError(f"{msg}: valid keys {where} are {', '.join(siblings)}")
    return ConfigError(msg)


# ---- building and loading ------------------------------------------------------------------


class _Loader(yaml.SafeLoader):
    """PyYAML reads `1e-3` as a string (YAML 1.1 wants `1.0e-3`); accept it as a float."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


def build(root: type[T], data: Any, at: str = "") -> T:
    """Build and validate `root` from a nested mapping; missing keys take defaults. at: the
    dotted key the mapping sits at (a plugin's options, e.g. "dataset.options."), for
    messages."""
    return _build(root, root, data, "", at)


def _build(root: type, cls: type, data: Any, prefix: str, at: str = "") -> Any:
    if data is None and (prefix or at):
        data = {}  # `trainer:` with every key commented out means its defaults
    if not isinstance(data, Mapping):
        where = f"{at}{prefix} is a section" if prefix or at else "the config must be a mapping"
        raise ConfigError(
            f"{where}: give a mapping of its keys, got {short(data)} ({type(data).__name__})"
        )
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for name, value in data.items():
        key = f"{prefix}.{name}" if prefix else str(name)
        if name not in fields:
            raise _unknown_key(root, key, at)
        tp = fields[name].type
        kwargs[name] = _build(root, tp, value, key, at) if is_section(tp) else value
    return cls(**kwargs)


def _merge(dst: dict, src: Mapping) -> None:
    for k, v in src.items():
        if isinstance(v, Mapping) and isinstance(dst.get(k), dict):
            _merge(dst[k], v)
        else:
            dst[k] = dict(v) if isinstance(v, Mapping) else v


def _apply_override(root: type, data: dict, override: str) -> None:
    if "=" not in override:
        raise ConfigError(
            f"override {override!r} has no '=': write overrides as "
            "dotted.key=value, e.g. trainer.lr=1e-5"
        )
    key, text = (s.strip() for s in override.split("=", 1))
    keys = _all_keys(root)
    owners = [k for k in keys if key.startswith(k + ".")]  # a plugin's option is below a dict
    if key not in keys and not (owners and typing.get_origin(keys[max(owners, key=len)]) is dict):
        raise _unknown_key(root, key)
    try:
        value = yaml.load(text, Loader=_Loader)
    except yaml.YAMLError as e:
        raise ConfigError(
            f"override {override!r}: cannot parse the value as YAML "
            f"({getattr(e, 'problem', e)}); quote strings, write lists as [a, b]"
        ) from None
    *parents, last = key.split(".")
    node = data
    for i, part in enumerate(parents):
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            section = ".".join(parents[: i + 1])
            raise ConfigError(
                f"{section} is a section, but the config file gives it "
                f"{short(node)}: make it a mapping of its keys"
            )
    _merge(node, {last: value})


def _read_yaml(path: str) -> dict:
    p = Path(path)
    try:
        text = p.read_text()
    except FileNotFoundError:
        raise ConfigError(f"config file {path!r} not found: check the path") from None
    except OSError as e:
        raise ConfigError(f"cannot read config file {path!r}: {e.strerror}") from None
    try:
        data = yaml.load(text, Loader=_Loader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f", line {mark.line + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e)
        raise ConfigError(f"cannot parse config file {path!r}{where}: {problem}") from None
    if data is None:  # an empty file means all defaults
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"config file {path!r} must hold a mapping of keys (e.g. "
            f"'trainer: {{lr: 1.0e-5}}'), got a {type(data).__name__}"
        )
    return data


def load(root: type[T], path: str | None = None, overrides: Iterable[str] = ()) -> T:
    """Defaults, then the YAML file at `path`, then each `dotted.key=value` override."""
    if isinstance(overrides, str):
        raise TypeError("overrides must be a list of 'key=value' strings, not one string")
    data = _read_yaml(path) if path is not None else {}
    for override in overrides:
        _apply_override(root, data, override)
    return build(root, data)


# The config's own (Section's methods), also spelt as functions: to_dict(cfg), save(cfg, path).
to_dict = Section.to_dict
save = Section.save


# ---- documentation -------------------------------------------------------------------------


@cache
def _field_docs(source_file: str) -> dict[tuple[str, str], str]:
    """(class name, field name) -> the string literal under the field, read from the source."""
    docs = {}
    for cls in ast.parse(Path(source_file).read_text()).body:
        if not isinstance(cls, ast.ClassDef):
            continue
        for stmt, nxt in zip(cls.body, cls.body[1:], strict=False):
            if (
                isinstance(stmt, ast.AnnAssign)
                and isinstance(stmt.target, ast.Name)
                and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)
            ):
                docs[(cls.name, stmt.target.id)] = nxt.value.value.strip()
    return docs


def describe(root: type) -> list[tuple[str, str, str]]:
    """(dotted key, default as YAML, docstring) for every leaf, in declaration order."""
    defaults = to_dict(root())
    rows = []
    for key, f, owner in walk(root):
        if is_section(f.type):
            continue
        value: Any = defaults
        for part in key.split("."):
            value = value[part]
        doc = _field_docs(inspect.getsourcefile(owner)).get((owner.__name__, f.name), "")
        rows.append((key, json.dumps(value), doc))
    return rows

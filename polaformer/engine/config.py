"""The configuration trees of every task: nested keys, typed and strict, YAML files plus overrides.

A task describes its settings as a tree of defaults (:class:`Config`); :func:`configure` merges a YAML
file (with its ``BASE:`` files, relative to the including file) and ``KEY VALUE`` overrides into it.
Values are decoded and type-checked as yacs does (``5e-4``, which YAML reads as a string, becomes a
float; ``None`` clears a value; ints may become floats), unknown keys are an error naming the valid keys
at that level, nodes made with ``new_allowed=True`` take any keys (model keyword arguments), and YAML
aliases are refused. The classification task's tree is the official PolaFormer ``config.py``
(:mod:`polaformer.tasks.classification.config`); the other tasks' trees live beside their tasks.

Every task declares the range of each of its own settings beside its defaults (a :class:`Range` per dotted key:
a positive integer, a finite number > 0, a probability in [0, 1), a seed...; the engine options' ranges are in
their one declaration, :mod:`.options`); :func:`check_settings` checks them all, once, after the file, the
overrides and the command-line flags are merged, and names the key in its one-line error. Settings that are not
keys (a sampling flag) are checked with :meth:`Range.check`. Files are read through
:func:`polaformer.files.read_text` (regular files of a bounded size only).
"""
from __future__ import annotations

import ast
import copy
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from ..files import MAX_CONFIG_BYTES, UnreadableFileError, read_text

__all__ = ["COUNT", "FINITE", "NON_NEGATIVE", "POSITIVE", "POSITIVE_INT", "SEED", "Config", "ConfigError", "Range",
           "check_settings", "coerce_value", "configure", "decode_value", "fraction", "load_yaml", "merge_file",
           "merge_opts", "unit"]


class ConfigError(ValueError):
    """An unknown key, a value of the wrong type, or an unusable setting (one line)."""


# --- declared ranges ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Range:
    """The values a setting may take: integers or finite numbers between optional bounds (``None``: unbounded),
    ``optional`` adds None (YAML null); a list value is checked item by item. ``text`` replaces the generated
    description, ``note`` follows it in parentheses (what a special value means)."""

    integer: bool = False
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    optional: bool = False
    note: str = ""
    text: str = ""

    def accepts(self, value: Any) -> bool:
        if value is None:
            return self.optional
        if isinstance(value, (list, tuple)):
            return all(self.accepts(item) for item in value)
        if isinstance(value, bool) or not isinstance(value, int if self.integer else (int, float)):
            return False
        if isinstance(value, float) and not math.isfinite(value):
            return False
        if self.low is not None and (value < self.low or (self.low_open and value == self.low)):
            return False
        return self.high is None or (value < self.high or (not self.high_open and value == self.high))

    def describe(self) -> str:
        """What follows "must" in the error: ``be a positive integer``, ``lie in [0, 1)``..."""
        def show(bound: float) -> str:
            return str(int(bound)) if self.integer else f"{bound:g}"

        if self.text:
            text = self.text
        elif self.low is not None and self.high is not None:
            interval = (f"{'(' if self.low_open else '['}{show(self.low)}, {show(self.high)}"
                        f"{')' if self.high_open else ']'}")
            text = f"be an integer in {interval}" if self.integer else f"lie in {interval}"
        elif self.integer:
            text = "be a positive integer" if self.low == 1 and not self.low_open else (
                "be an integer" + (f" {'>' if self.low_open else '>='} {show(self.low)}" if self.low is not None
                                   else ""))
        else:
            bound = f" {'>' if self.low_open else '>='} {show(self.low)}" if self.low is not None else (
                f" {'<' if self.high_open else '<='} {show(self.high)}" if self.high is not None else "")
            text = f"be a finite number{bound}"
        text += " or null" if self.optional else ""
        return f"{text} ({self.note})" if self.note else text

    def check(self, name: str, value: Any, error: type[Exception] = ConfigError) -> None:
        if not self.accepts(value):
            raise error(f"{name} must {self.describe()}, got {value!r}")

    def but(self, **changes) -> Range:
        """This range with some fields changed (a note, null allowed)."""
        return Range(**{**self.__dict__, **changes})


POSITIVE_INT = Range(integer=True, low=1)
COUNT = Range(integer=True, low=0)  # an integer >= 0
POSITIVE = Range(low=0, low_open=True)  # a finite number > 0
NON_NEGATIVE = Range(low=0)
FINITE = Range()
SEED = Range(integer=True, low=-2**63, high=2**63, high_open=True,
             text="be an integer in [-2**63, 2**63)")  # what the random generators take


def unit(high_open: bool = True, low_open: bool = False) -> Range:
    """A number in [0, 1) (probabilities of dropping, decays), or another side of the unit interval."""
    return Range(low=0, high=1, low_open=low_open, high_open=high_open)


def fraction() -> Range:
    """A number strictly inside (0, 1): a share of a split, a point of a schedule."""
    return unit(high_open=True, low_open=True)


def check_settings(cfg: Config, rules: Mapping[str, Range], error: type[Exception] = ConfigError) -> None:
    """Check every dotted key of ``rules`` in ``cfg`` against its range; the first failure names the key."""
    for dotted, rule in rules.items():
        node: Any = cfg
        for part in dotted.split("."):
            node = node[part]
        rule.check(dotted, node, error)


_MAX_NESTING = 64  # levels of lists and mappings in a configuration file
_MAX_INT_DIGITS = 100  # Python refuses to convert integers beyond 4,300 digits, with a multi-line hint


class _NoAliasLoader(yaml.SafeLoader):
    """PyYAML's safe loader without aliases: a few hundred bytes of nested ``*ref`` can expand to
    gigabytes (a "billion laughs" file). Configuration files have no use for them, nor for deep
    nesting (``[[[[...`` recurses once per level) or integers of hundreds of digits."""

    _depth = 0

    def compose_node(self, parent, index):
        mark = self.peek_event().start_mark
        if self.check_event(yaml.AliasEvent):
            raise yaml.constructor.ConstructorError(
                None, None, "YAML aliases (*name) are not allowed in configurations", mark)
        if self._depth >= _MAX_NESTING:
            raise yaml.constructor.ConstructorError(
                None, None, f"lists and mappings nested deeper than {_MAX_NESTING} levels", mark)
        self._depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_yaml_int(self, node):
        digits = sum(c.isdigit() for c in node.value)
        if digits > _MAX_INT_DIGITS:
            raise yaml.constructor.ConstructorError(
                None, None, f"an integer of {digits} digits (at most {_MAX_INT_DIGITS})", node.start_mark)
        return super().construct_yaml_int(node)


_NoAliasLoader.add_constructor("tag:yaml.org,2002:int", _NoAliasLoader.construct_yaml_int)


def load_yaml(text: str) -> Any:
    """``yaml.safe_load`` refusing aliases (see :class:`_NoAliasLoader`)."""
    return yaml.load(text, Loader=_NoAliasLoader)


# --- the nested configuration ----------------------------------------------------------------

class Config:
    """A nested configuration with attribute access (``cfg.TRAIN.BASE_LR``), like yacs' CfgNode.

    Only existing keys can be set, except in nodes created with ``new_allowed=True`` (such as
    ``MODEL.KWARGS``). :meth:`freeze` makes the whole tree read-only.
    """

    def __init__(self, values: Mapping[str, Any] | None = None, *, new_allowed: bool = False, path: str = ""):
        object.__setattr__(self, "_values", {})
        object.__setattr__(self, "_new_allowed", new_allowed)
        object.__setattr__(self, "_frozen", False)
        object.__setattr__(self, "_path", path)
        for key, value in (values or {}).items():
            self._values[key] = Config(value, path=self._child(key)) if isinstance(value, Mapping) else value

    # access

    def __getattr__(self, key: str) -> Any:
        values = object.__getattribute__(self, "_values")
        if key in values:
            return values[key]
        if key.startswith("__"):  # copy/pickle probe dunder methods
            raise AttributeError(key)
        raise AttributeError(self._unknown(key))

    def __getitem__(self, key: str) -> Any:
        if key not in self._values:
            raise KeyError(self._unknown(key))
        return self._values[key]

    def __contains__(self, key: str) -> bool:
        return key in self._values

    def __iter__(self):
        return iter(self._values)

    def keys(self):
        return self._values.keys()

    def items(self):
        return self._values.items()

    def get(self, key: str, default: Any = None) -> Any:
        return self._values.get(key, default)

    def __eq__(self, other) -> bool:
        return isinstance(other, Config) and self.to_dict() == other.to_dict()

    def __repr__(self) -> str:
        return f"Config({self.to_dict()!r})"

    # changes

    def __setattr__(self, key: str, value: Any) -> None:
        self._set(key, value)

    def __setitem__(self, key: str, value: Any) -> None:
        self._set(key, value)

    def _set(self, key: str, value: Any, source: str = "") -> None:
        if self._frozen:
            raise ConfigError(f"cannot set {self._child(key)}: the configuration is frozen")
        if key not in self._values:
            if not self._new_allowed:
                raise ConfigError(self._unknown(key, source))
            self._values[key] = Config(value, path=self._child(key), new_allowed=True) if isinstance(
                value, Mapping) else decode_value(value)
            return
        current = self._values[key]
        if isinstance(current, Config):
            if not isinstance(value, Mapping):
                raise ConfigError(f"{self._child(key)} is a group of keys ({', '.join(current.keys()) or 'any'}), "
                                  f"not a value: got {value!r}{_where(source)}")
            current.merge(value, source=source)
            return
        self._values[key] = coerce_value(self._child(key), current, value, source)

    def merge(self, values: Mapping[str, Any], *, source: str = "") -> Config:
        """Merge nested ``values`` into this node, checking every key and type."""
        for key, value in values.items():
            self._set(str(key), value, source)
        return self

    def clear(self) -> Config:
        """Remove every key of a free-form node (one made with ``new_allowed=True``)."""
        if self._frozen or not self._new_allowed:
            raise ConfigError(f"cannot clear {self._path or 'the configuration'}: "
                              f"{'it is frozen' if self._frozen else 'its keys are fixed'}")
        self._values.clear()
        return self

    def set_path(self, dotted: str, value: Any, *, source: str = "") -> None:
        """Set ``'TRAIN.BASE_LR'``-style keys; the value is decoded as yacs decodes strings."""
        *parents, leaf = dotted.split(".")
        node = self
        for name in parents:
            child = node._values.get(name)
            if not isinstance(child, Config):
                raise ConfigError(node._unknown(name, source) if child is None and name not in node._values
                                  else f"{node._child(name)} is a value, not a group of keys{_where(source)}")
            node = child
        node._set(leaf, value, source)

    def freeze(self) -> Config:
        return self._set_frozen(True)

    def defrost(self) -> Config:
        return self._set_frozen(False)

    def _set_frozen(self, frozen: bool) -> Config:
        object.__setattr__(self, "_frozen", frozen)
        for value in self._values.values():
            if isinstance(value, Config):
                value._set_frozen(frozen)
        return self

    @property
    def is_frozen(self) -> bool:
        return self._frozen

    def clone(self) -> Config:
        return copy.deepcopy(self)

    def __deepcopy__(self, memo) -> Config:
        clone = Config(new_allowed=self._new_allowed, path=self._path)
        for key, value in self._values.items():
            clone._values[key] = copy.deepcopy(value, memo)
        object.__setattr__(clone, "_frozen", self._frozen)
        return clone

    def to_dict(self) -> dict:
        """Plain nested dicts (tuples become lists, as YAML and JSON have them)."""
        return {key: value.to_dict() if isinstance(value, Config) else _plain(value)
                for key, value in self._values.items()}

    def dump(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    # messages

    def _child(self, key: str) -> str:
        return f"{self._path}.{key}" if self._path else key

    def _unknown(self, key: str, source: str = "") -> str:
        where = f"under {self._path}" if self._path else "at the top level"
        return f"unknown config key {self._child(key)!r}{_where(source)}; valid keys {where}: {', '.join(self._values)}"


def _where(source: str) -> str:
    return f" (in {source})" if source else ""


def _plain(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def decode_value(value: Any) -> Any:
    """yacs' decoding: strings that are Python literals become them (``'5e-4'`` -> 0.0005, ``'None'``)."""
    if not isinstance(value, str):
        return value
    try:
        return ast.literal_eval(value)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return value


_SCALARS = (str, int, float, bool, list, tuple)


def coerce_value(key: str, current: Any, value: Any, source: str = "") -> Any:
    """``value`` for a key whose default is ``current``, with yacs' type rules (ints may become floats).

    Strings for string keys are kept verbatim (paths, names); other strings are decoded first.
    """
    if not (isinstance(current, str) and isinstance(value, str)):
        value = decode_value(value)
    if value is None or current is None:
        if value is not None and not isinstance(value, _SCALARS):
            raise ConfigError(f"{key} cannot be {value!r}{_where(source)}")
        return value
    if isinstance(current, bool) or isinstance(value, bool):
        if isinstance(current, bool) and isinstance(value, bool):
            return value
    elif isinstance(current, float) and isinstance(value, (int, float)):
        return float(value)
    elif isinstance(current, (list, tuple)) and isinstance(value, (list, tuple)):
        return type(current)(value)
    elif type(value) is type(current):
        return value
    raise ConfigError(f"{key} expects {type(current).__name__}, got {value!r} ({type(value).__name__}){_where(source)}")


def merge_file(cfg: Config, path: str | os.PathLike, _seen: tuple = ()) -> Config:
    path = Path(path)
    try:  # read before resolving: a loop of symbolic links is then the open's one-line error
        text = read_text(path, MAX_CONFIG_BYTES)
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except UnreadableFileError as e:
        raise ConfigError(f"config file {e}") from None
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {path} is not UTF-8 text (byte {e.start})") from None
    if path.resolve() in _seen:
        raise ConfigError(f"config file {path} includes itself through BASE")
    try:
        values = load_yaml(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"config file {path} is not valid YAML{at}: {getattr(e, 'problem', None) or e}") from None
    if values is None:
        return cfg
    if not isinstance(values, Mapping):
        raise ConfigError(f"config file {path} must hold a mapping of keys, not {type(values).__name__}")
    bases = values.get("BASE") or []
    bases = [bases] if isinstance(bases, str) else bases
    if not isinstance(bases, list) or not all(isinstance(base, str) for base in bases):
        raise ConfigError(f"BASE in {path} must be a file name or a list of them, got {values['BASE']!r}")
    for base in bases:
        if base:
            merge_file(cfg, path.parent / base, _seen + (path.resolve(),))
    if "BASE" not in cfg:  # a tree without the official BASE key still takes includes
        values = {key: value for key, value in values.items() if key != "BASE"}
    cfg.merge(values, source=str(path))
    return cfg


def merge_opts(cfg: Config, opts: Sequence[str]) -> Config:
    if len(opts) % 2:
        raise ConfigError(f"--opts needs KEY VALUE pairs; {opts[-1]!r} has no value")
    for key, text in zip(opts[::2], opts[1::2]):
        try:
            value = load_yaml(text) if isinstance(text, str) else text
        except yaml.YAMLError:
            value = text
        cfg.set_path(key, value, source="--opts")
    return cfg


def configure(defaults: Config, path: str | os.PathLike | None = None, opts: Sequence[str] = (),
              overrides: Mapping[str, Any] | None = None, rules: Mapping[str, Range] | None = None,
              check: Callable[[Config], None] | None = None) -> Config:
    """``defaults`` (changed in place and returned), then the YAML file at ``path``, then ``opts``
    (a flat ``['TRAIN.EPOCHS', '10', ...]`` list, each value read as YAML), then ``overrides``
    (``{'train.lr': 1e-4}`` from command-line flags; None values are skipped); then every key of
    ``rules`` is checked (:func:`check_settings`), and the whole by ``check``."""
    if path is not None:
        merge_file(defaults, path)
    merge_opts(defaults, opts)
    for dotted, value in (overrides or {}).items():
        if value is not None:
            defaults.set_path(dotted, value, source="the command line")
    if rules:
        check_settings(defaults, rules)
    if check is not None:
        check(defaults)
    return defaults

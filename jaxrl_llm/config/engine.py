"""A small typed-YAML engine: frozen dataclasses built from YAML files and dotted overrides.

The engine knows nothing of any particular schema. A schema is a tree of (frozen, slotted,
kw-only) dataclasses whose fields are typed with ``bool``, ``int``, ``float``, ``str``,
``Literal[...]``, ``tuple[T, ...]``, ``Mapping[str, Any]``, ``Any``, a nested dataclass, or a
union of those with ``None``; :func:`_field` attaches numeric bounds (``ge``, ``gt``, ``le``,
``lt``) to a field. :func:`load` goes:

1. read the YAML file (:func:`_read_yaml`): a top-level ``base:`` or ``defaults:`` key names one
   file or a list of files, relative to the including file (or, failing that, found by the
   schema's finder), read the same way and merged underneath, left to right; mappings merge key
   by key, anything else replaces (:func:`_merge`);
2. apply ``dotted.key=value`` overrides in order (:func:`merge_overrides`), each value read as
   YAML (``1e-6``, ``true``, ``[1, 2]``, ``null``), so a later one wins; a value YAML would
   read differently from what was typed (``#`` starting a comment, ``: `` making a mapping) is
   the typed text for a string field and an error saying to quote it for any other;
3. refuse any value left as ``???`` (:data:`MISSING`, "required, give it on the command line");
4. build the dataclasses (:func:`_build`): an unknown key is an error that suggests the nearest
   valid one, a value of the wrong type is an error naming its dotted key path (ints become
   floats and lists tuples where the type says so, mappings become :class:`FrozenDict`), and a
   number outside its field's bounds is an error stating them.

Every problem raises :class:`ConfigError` naming the key path, the value and what was expected.
A document standing for more than :data:`MAX_YAML_NODES` values once its aliases are expanded
(an "alias bomb"), or containing itself, is refused before it is built. The YAML reader is
PyYAML's safe loader, reading ``1e-6`` as a float (YAML 1.1 wants ``1.0e-6``)
and rejecting duplicate keys; :func:`dump_yaml` writes what it reads back to an equal value.

A schema may add a merge rule (``rule(path, base, child) -> base``, called before ``child`` is
merged over ``base`` at the key path ``path``), e.g. to drop keys of the layers below that a
change in ``child`` makes meaningless, and a shorthand hook (``expand(raw, where) -> raw``,
called on each file's mapping and each override before any merging) that rewrites the short
spellings it accepts into the schema's own form. Cross-field checks belong to the schema, not
here.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import types
import typing
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import yaml

#: A merge hook: ``rule(path, base, child)`` returns the ``base`` mapping to merge ``child`` over.
MergeRule = Callable[[tuple[str, ...], Mapping, Mapping], Mapping]
# An include's file where none exists relative to the including file, or a reason there is none
IncludeFinder = Callable[[str], "Path | str | None"]
# One document's (or override's) raw mapping with the schema's shorthands expanded; `where`
# names the document for errors
Shorthand = Callable[[dict, str], dict]

MISSING = "???"  # a required value a config leaves to the command line (e.g. model.path=???)

# ---------------------------------------------------------------------------------------------
# Errors.


class ConfigError(ValueError):
    """A config that cannot run; the message names the key path, the value and what was expected.

    Attributes:
      key: the dotted key path at fault (``""`` for the file as a whole).
    """

    def __init__(self, message: str, key: str = ""):
        super().__init__(message)
        self.key = key


def _bad(key: str, value: Any, expected: str) -> ConfigError:
    return ConfigError(f"{key} = {value!r}: expected {expected}", key)


def _join(key: str, name: str) -> str:
    return f"{key}.{name}" if key else name


def _suggest(name: Any, valid: Sequence[Any], prefix: str = "") -> str:
    options = {str(v): v for v in valid}
    close = difflib.get_close_matches(str(name), list(options), n=1, cutoff=0.6)
    if not close:
        return ""
    best = options[close[0]]
    return f"; did you mean {_join(prefix, best) if prefix else best!r}?"


def _unknown(key: str, name: Any, valid: Sequence[str], why: str = "") -> ConfigError:
    full = _join(key, str(name))
    return ConfigError(
        f"unknown key {full!r}{why}{_suggest(name, valid, key)} (valid keys of "
        f"{key or 'the top level'}: {', '.join(valid)})",
        full,
    )


def _describe(hint: Any) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join("null" if a is type(None) else _describe(a) for a in args)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin is tuple:
        return f"a list (each {_describe(args[0])})"
    if dataclasses.is_dataclass(hint):
        return f"a mapping ({hint.__name__})"
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
    return names.get(hint, "a mapping" if origin is Mapping else str(hint))


# ---------------------------------------------------------------------------------------------
# An immutable mapping, and fields with bounds.


class FrozenDict(Mapping):
    """A hashable, read-only dict (free-form mappings of a config, e.g. keyword arguments)."""

    __slots__ = ("_data",)

    def __init__(self, data: Mapping | None = None):
        object.__setattr__(self, "_data", dict(data or {}))

    def __getitem__(self, key: Any) -> Any:
        return self._data[key]

    def __iter__(self) -> Iterator:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __hash__(self) -> int:
        return hash(tuple(sorted(self._data.items(), key=lambda kv: str(kv[0]))))

    def __repr__(self) -> str:
        return f"FrozenDict({self._data!r})"

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("FrozenDict is immutable")

    def __reduce__(self):
        return (FrozenDict, (self._data,))


def _freeze(value: Any) -> Any:
    """Lists become tuples and mappings FrozenDicts, recursively, so configs stay hashable."""
    if isinstance(value, Mapping):
        return FrozenDict({k: _freeze(v) for k, v in value.items()})
    if isinstance(value, list | tuple):
        return tuple(_freeze(v) for v in value)
    if isinstance(value, str) and type(value) is not str:
        return str(value)  # an override's _RawText
    return value


def _field(default: Any = dataclasses.MISSING, **bounds: float) -> Any:
    """A dataclass field with numeric bounds (``ge``, ``gt``, ``le``, ``lt``) checked on load."""
    if isinstance(default, FrozenDict | tuple) or dataclasses.is_dataclass(default):
        return dataclasses.field(default_factory=lambda: default, metadata=bounds)
    return dataclasses.field(default=default, metadata=bounds)


def _default(cls: type, name: str) -> Any:
    """The default of the field ``name`` of the dataclass ``cls``."""
    field = next(f for f in dataclasses.fields(cls) if f.name == name)
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return field.default


def _given_or_default(section: Any, cls: type, name: str) -> Any:
    """``section[name]`` of a raw section of type ``cls``, else the field's default; ``None``
    when the section is not a mapping."""
    if not isinstance(section, Mapping):
        return None
    return section[name] if name in section else _default(cls, name)


# ---------------------------------------------------------------------------------------------
# YAML: reading with includes, merging, overrides, writing.

_FLOAT_RE = re.compile(
    r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
    |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""",
    re.X,
)


class _Loader(yaml.SafeLoader):
    """SafeLoader that reads ``1e-6`` as a float (YAML 1.1 wants ``1.0e-6``) and rejects
    duplicate keys instead of keeping the last one silently."""


class _Dumper(yaml.SafeDumper):
    """SafeDumper that quotes strings _Loader would read as floats."""


for _cls in (_Loader, _Dumper):
    _cls.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT_RE, list("-+0123456789."))


def _construct_mapping(loader: _Loader, node: yaml.MappingNode) -> dict:
    loader.flatten_mapping(node)
    seen = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        if isinstance(key, typing.Hashable) and key in seen:
            raise yaml.constructor.ConstructorError(
                "while reading a mapping",
                node.start_mark,
                f"duplicate key {key!r}",
                key_node.start_mark,
            )
        seen.add(key)
    return loader.construct_mapping(node, deep=True)


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


#: The most YAML nodes (scalars, lists, mappings) one document may stand for once its aliases
#: are expanded. A config has a few hundred; an "alias bomb" (``a: &a [x, x, ...]``,
#: ``b: &b [*a, *a, ...]``, ...) of 600 bytes stands for 10⁹ and would stall every walk over the
#: config (merging, freezing, checking), so a document over the limit is refused before it is
#: built. Recursive aliases (``a: &a [*a]``) are refused too.
MAX_YAML_NODES = 100_000


def _expanded_size(node: yaml.Node, where: str) -> int:
    """The number of nodes ``node`` stands for with every alias expanded (each shared node
    counted as often as it is referenced), raising :class:`ConfigError` past
    :data:`MAX_YAML_NODES` or on a node that contains itself. Memoised by node, so the cost is
    linear in the document's size, not in its expansion."""
    sizes: dict[int, int] = {}
    open_: set[int] = set()

    def size(n: yaml.Node) -> int:
        key = id(n)
        if key in sizes:
            return sizes[key]
        if key in open_:
            mark = n.start_mark
            raise ConfigError(
                f"{where}:{mark.line + 1}:{mark.column + 1}: a YAML alias refers to the "
                "node that contains it (a recursive structure); a config must be a finite tree"
            )
        total = 1
        if isinstance(n, yaml.SequenceNode | yaml.MappingNode):
            open_.add(key)
            children = (
                n.value if isinstance(n, yaml.SequenceNode) else [c for kv in n.value for c in kv]
            )
            for child in children:
                total += size(child)
                if total > MAX_YAML_NODES:
                    break
            open_.discard(key)
        sizes[key] = total
        if total > MAX_YAML_NODES:
            raise ConfigError(
                f"{where}: the YAML stands for more than {MAX_YAML_NODES:,} values once its "
                "aliases (*name) are expanded; a config has a few hundred. Is it an alias bomb? "
                "(the limit is jaxrl_llm.config.engine.MAX_YAML_NODES)"
            )
        return total

    return size(node)


def _parse_yaml(text: str, where: str) -> Any:
    """``text`` read by :class:`_Loader`, its size with aliases expanded bounded first."""
    try:
        loader = _Loader(text)
        try:
            node = loader.get_single_node()
            if node is None:
                return None
            _expanded_size(node, where)
            return loader.construct_document(node)
        finally:
            loader.dispose()
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        at = f"{where}:{mark.line + 1}:{mark.column + 1}" if mark else where
        detail = " ".join(str(s) for s in (e.context, e.problem) if s)
        raise ConfigError(f"{at}: malformed YAML: {detail}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{where}: malformed YAML: {e}") from None


def _merge(
    base: Mapping, child: Mapping, path: tuple[str, ...] = (), rule: MergeRule | None = None
) -> dict:
    """``child`` over ``base``: mappings merge key by key, anything else replaces.

    Before a mapping of ``child`` is merged over the one of ``base`` at the same key path,
    ``rule(path, base_mapping, child_mapping)`` (if given) may return a trimmed ``base_mapping``.
    """
    out = dict(base)
    for key, value in child.items():
        old = out.get(key)
        if isinstance(old, Mapping) and isinstance(value, Mapping):
            sub = (*path, key)
            if rule is not None:
                old = rule(sub, old, value)
            out[key] = _merge(old, value, sub, rule)
        else:
            out[key] = value
    return out


def _read_yaml(
    path: Path,
    chain: tuple[Path, ...] = (),
    rule: MergeRule | None = None,
    find: IncludeFinder | None = None,
    expand: Shorthand | None = None,
) -> dict:
    """A YAML file with its ``base:`` / ``defaults:`` includes merged underneath.

    An include is a path relative to the including file; where no such file exists,
    ``find(include)`` (if given) may name the file it means instead (e.g. a config shipped in
    a package), or say why there is none. ``expand`` (if given) rewrites each file's mapping
    before it is merged.
    """
    where = str(path)
    if not path.is_file():
        via = f" (included from {chain[-1]})" if chain else ""
        raise ConfigError(f"config file not found: {where}{via}")
    resolved = path.resolve()
    if resolved in chain:
        cycle = " -> ".join(str(p) for p in (*chain, resolved))
        raise ConfigError(f"{where}: include cycle: {cycle}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{where}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    raw = _parse_yaml(text, where)
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where}: expected a mapping of sections at the top level, got {raw!r}")
    raw = dict(raw)
    if "base" in raw and "defaults" in raw:
        raise ConfigError(f"{where}: give `base:` or `defaults:`, not both", "base")
    key = "base" if "base" in raw else "defaults"
    includes = raw.pop(key, None)
    if includes is None:
        includes = []
    elif isinstance(includes, str):
        includes = [includes]
    if not isinstance(includes, list) or not all(isinstance(i, str) for i in includes):
        raise _bad(key, includes, "a relative path to a YAML file, or a list of them")
    merged: dict = {}
    for include in includes:
        target = path.parent / include
        if find is not None and not target.is_file():
            found = find(include)
            if isinstance(found, str):
                raise ConfigError(
                    f"config file not found: {target} (included from {resolved}); {found}", key
                )
            target = target if found is None else found
        below = _read_yaml(target, (*chain, resolved), rule, find, expand)
        merged = _merge(merged, below, rule=rule)
    if expand is not None:
        raw = expand(raw, where)
    return _merge(merged, raw, rule=rule)


_KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class _RawText(str):
    """An override value taken as the literal text typed because YAML would have read it as
    something else: a ``#`` that starts a comment (``data.system_prompt=# Task`` would be null)
    or ``: `` that makes a mapping (``data.system_prompt=Answer: 42``), or cannot read it at
    all (``rewards=[gsm8k, {type: regex``). A field that wants a string gets the text; any
    other field reports it with "quote the value", or with YAML's error (:func:`_convert`).

    Attributes:
      yaml_value: what YAML reads the text as.
      yaml_error: why YAML cannot read it (``None`` when it can).
    """

    yaml_value: Any = None
    yaml_error: str | None = None


_COMMENT_RE = re.compile(r"(?:^|\s)#")


def _override_value(text: str, where: str) -> Any:
    """An override's value: ``text`` read as YAML, or :class:`_RawText` when YAML would drop
    part of it as a comment or read a block mapping from it."""
    try:
        value = _parse_yaml(text, where)
    except ConfigError as e:
        if "malformed YAML" not in str(e):
            raise  # an alias bomb or a recursive alias
        raw = _RawText(text)
        raw.yaml_error = str(e).split("malformed YAML: ", 1)[1]
        return raw
    comment = _COMMENT_RE.search(text)
    swallowed = False
    if comment is not None:
        try:
            swallowed = _parse_yaml(text[: comment.start()], where) == value
        except ConfigError:
            swallowed = False
    block_mapping = isinstance(value, Mapping) and not text.lstrip().startswith("{")
    if not (swallowed or block_mapping):
        return value
    raw = _RawText(text.strip())
    raw.yaml_value = value
    return raw


def _quote_hint(value: Any, key: str) -> str:
    """For a :class:`_RawText` value: why it is text, and how to give it as YAML."""
    if not isinstance(value, _RawText):
        return ""
    if value.yaml_error is not None:
        return (
            f" (the value is not valid YAML, so it was read as text: {value.yaml_error}; "
            "check its brackets, braces and quotes)"
        )
    why = "'#' starts a YAML comment" if _COMMENT_RE.search(value) else "': ' makes a mapping"
    return (
        f" (as YAML, {value!r} reads as {value.yaml_value!r}: {why}; quote the value inside "
        f"the argument, '{key}=\"...\"', and write a mapping in braces, {{a: 1}})"
    )


def parse_override(item: str) -> dict:
    """``"a.b.c=value"`` → ``{"a": {"b": {"c": value}}}``, the value parsed as YAML.

    A value that is not valid YAML is taken as a plain string, and so is one YAML would read
    differently from what was typed (a ``#`` starting a comment, ``: `` making a block mapping;
    see :class:`_RawText`): a string field gets the text, any other field says to quote it.
    """
    if "=" not in item:
        raise ConfigError(f"override {item!r}: expected `dotted.key=value`, e.g. optim.lr=1e-6")
    key, text = item.split("=", 1)
    parts = key.strip().split(".")
    if not all(_KEY_RE.match(p) for p in parts):
        raise ConfigError(f"override {item!r}: {key.strip()!r} is not a dotted key like a.b.c")
    value = _override_value(text, f"override {key.strip()}")
    for part in reversed(parts):
        value = {part: value}
    return value


def merge_overrides(
    raw: Mapping,
    overrides: Sequence[str],
    rule: MergeRule | None = None,
    expand: Shorthand | None = None,
) -> dict:
    """Applies dotted overrides in order (a later one wins) to a raw config mapping;
    ``expand`` (if given) rewrites each override's mapping first."""
    if isinstance(overrides, str):
        raise TypeError("overrides must be a list of 'key=value' strings, not one string")
    out = dict(raw)
    for item in overrides:
        parsed = parse_override(item)
        if expand is not None:
            parsed = expand(parsed, f"override {item.split('=', 1)[0].strip()}")
        out = _merge(out, parsed, rule=rule)
    return out


def to_dict(config: Any) -> Any:
    """Plain dicts, lists and scalars (YAML-ready) from a config or any of its sections."""
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        return {f.name: to_dict(getattr(config, f.name)) for f in dataclasses.fields(config)}
    if isinstance(config, Mapping):
        return {k: to_dict(v) for k, v in config.items()}
    if isinstance(config, list | tuple):
        return [to_dict(v) for v in config]
    return config


def dump_yaml(config: Any, header: str = "") -> str:
    """``config`` (a dataclass, or any part of one) as YAML after ``header``; reading the text
    back and building the same type gives an equal value."""
    body = yaml.dump(
        to_dict(config), Dumper=_Dumper, sort_keys=False, allow_unicode=True, width=100
    )
    return header + body


# ---------------------------------------------------------------------------------------------
# Building the dataclasses from raw mappings, with type and range checks.


def _convert(value: Any, hint: Any, key: str) -> Any:
    """``value`` checked against the type ``hint`` (and converted: int → float, list → tuple)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        for option in options:
            try:
                return _convert(value, option, key)
            except ConfigError:
                if len(options) == 1:
                    raise
        raise ConfigError(
            f"{key} = {value!r}: expected {_describe(hint)}{_quote_hint(value, key)}", key
        )
    if hint is Any:
        return _freeze(value)
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, key)
    if origin is Literal:
        if isinstance(value, str | int | float) and not isinstance(value, bool) and value in args:
            return value
        raise ConfigError(
            f"{key} = {value!r}: expected {_describe(hint)}{_suggest(value, args)}"
            f"{_quote_hint(value, key)}",
            key,
        )
    if hint is bool:
        if isinstance(value, bool):
            return value
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
    elif hint is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            if math.isfinite(value):
                return float(value)
            raise _bad(key, value, "a finite number")
    elif hint is str:
        if isinstance(value, str):
            return str(value)
    elif origin is tuple:
        if isinstance(value, list | tuple):
            return tuple(_convert(v, args[0], f"{key}[{i}]") for i, v in enumerate(value))
    elif origin is Mapping:
        if isinstance(value, Mapping):
            if not all(isinstance(k, str) for k in value):
                raise _bad(key, value, "a mapping with string keys")
            return _freeze(value)
    else:
        return value
    got = "str" if isinstance(value, str) else type(value).__name__
    raise ConfigError(
        f"{key} = {value!r}: expected {_describe(hint)}, got {got}{_quote_hint(value, key)}", key
    )


_BOUNDS = {
    "ge": (lambda v, b: v >= b, "≥"),
    "gt": (lambda v, b: v > b, ">"),
    "le": (lambda v, b: v <= b, "≤"),
    "lt": (lambda v, b: v < b, "<"),
}


def _check_bounds(value: Any, field: dataclasses.Field, hint: Any, key: str) -> None:
    if value is None or not field.metadata:
        return
    for name, bound in field.metadata.items():
        if not _BOUNDS[name][0](value, bound):
            limits = " and ".join(f"{_BOUNDS[n][1]} {b:g}" for n, b in field.metadata.items())
            kind = "an integer" if isinstance(value, int) else "a number"
            null = " (or null)" if type(None) in typing.get_args(hint) else ""
            raise _bad(key, value, f"{kind} {limits}{null}")


def _build(cls: type, raw: Any, key: str) -> Any:
    if not isinstance(raw, Mapping):
        where = key or "the config"
        raise ConfigError(
            f"{where} = {raw!r}: expected a mapping with keys "
            f"{', '.join(f.name for f in dataclasses.fields(cls))}{_quote_hint(raw, key)}",
            key,
        )
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    for name in raw:
        if name not in fields:
            raise _unknown(key, name, list(fields))
    kwargs = {}
    for name, value in raw.items():
        sub = _join(key, name)
        kwargs[name] = _convert(value, hints[name], sub)
        _check_bounds(kwargs[name], fields[name], hints[name], sub)
    missing = [n for n, f in fields.items() if _is_required(f) and n not in kwargs]
    if missing:
        raise ConfigError(f"{_join(key, missing[0])} is required", _join(key, missing[0]))
    return cls(**kwargs)


def _is_required(field: dataclasses.Field) -> bool:
    return field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING


def _find_missing(raw: Any, key: str = "") -> str | None:
    if isinstance(raw, Mapping):
        for name, value in raw.items():
            found = _find_missing(value, _join(key, str(name)))
            if found:
                return found
    elif isinstance(raw, list):
        for i, value in enumerate(raw):
            found = _find_missing(value, f"{key}[{i}]")
            if found:
                return found
    elif raw == MISSING:
        return key
    return None


def _check_top_level(raw: Any) -> None:
    """A raw config must be a mapping of sections with no value left as :data:`MISSING`."""
    if not isinstance(raw, Mapping):
        raise ConfigError(f"the config = {raw!r}: expected a mapping of sections")
    missing = _find_missing(raw)
    if missing:
        raise ConfigError(
            f"{missing} is required (the config leaves it as {MISSING}); set it on the command "
            f"line, e.g. `{missing}=...`",
            missing,
        )


def build(cls: type, raw: Mapping) -> Any:
    """The dataclass ``cls`` from a raw (YAML-shaped) mapping, types and bounds checked."""
    _check_top_level(raw)
    return _build(cls, raw, "")


def load(
    cls: type,
    path: str | os.PathLike,
    overrides: Sequence[str] = (),
    rule: MergeRule | None = None,
    expand: Shorthand | None = None,
) -> Any:
    """The dataclass ``cls`` from a YAML file (with its includes) and dotted overrides."""
    raw = merge_overrides(_read_yaml(Path(path), rule=rule, expand=expand), overrides, rule, expand)
    return build(cls, raw)


__all__ = [
    "MISSING",
    "ConfigError",
    "FrozenDict",
    "MergeRule",
    "Shorthand",
    "build",
    "dump_yaml",
    "load",
    "merge_overrides",
    "parse_override",
    "to_dict",
]

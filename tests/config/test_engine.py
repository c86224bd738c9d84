"""jaxrl_llm.config.engine on a toy schema: it knows nothing of the training run's sections."""

from __future__ import annotations

import dataclasses
import re
import textwrap
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import pytest

from jaxrl_llm.config import engine as E
from jaxrl_llm.config.engine import ConfigError, FrozenDict, _field

_TOY = dict(frozen=True, slots=True, kw_only=True)


@dataclasses.dataclass(**_TOY)
class Inner:
    rate: float = _field(0.5, gt=0, le=1)
    count: int = _field(1, ge=1)
    mode: Literal["fast", "slow"] = "fast"
    tags: tuple[str, ...] = ()


@dataclasses.dataclass(**_TOY)
class Toy:
    name: str
    inner: Inner = dataclasses.field(default_factory=Inner)
    extra: Mapping[str, Any] = _field(FrozenDict())
    limit: int | None = _field(None, ge=0)
    flag: bool = False


def _write(folder: Path, text: str, name: str = "c.yaml") -> Path:
    path = folder / name
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


def _fails(raw: Any, *fragments: str, key: str | None = None) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        E.build(Toy, raw)
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))
    if key is not None:
        assert info.value.key == key
    return info.value


# ---------------------------------------------------------------------------------------------
# Building: conversions, unknown keys, types, bounds, required values.


def test_build_converts_and_freezes():
    toy = E.build(Toy, {"name": "a", "inner": {"rate": 1, "tags": ["x", "y"]}, "extra": {"k": [1]}})
    assert toy == Toy(name="a", inner=Inner(rate=1.0, tags=("x", "y")), extra={"k": (1,)})
    assert isinstance(toy.inner.rate, float) and isinstance(toy.extra, FrozenDict)
    assert hash(toy)
    with pytest.raises(TypeError):
        toy.extra["k"] = 2
    assert E.build(Toy, {"name": "a", "inner": {"count": 3.0}}).inner.count == 3


def test_unknown_key_suggests_the_nearest():
    e = _fails(
        {"name": "a", "inner": {"cuont": 2}},
        "unknown key 'inner.cuont'",
        "did you mean 'inner.count'?",
        "valid keys of inner: rate, count, mode, tags",
        key="inner.cuont",
    )
    assert isinstance(e, ValueError)
    _fails({"name": "a", "flgs": True}, "did you mean 'flag'?", "valid keys of the top level")
    _fails({"name": "a", "zzzz": 1}, "unknown key 'zzzz' (valid keys")


def test_type_errors_name_the_dotted_key():
    _fails(
        {"name": "a", "inner": {"count": "x"}}, "inner.count = 'x'", "expected an integer, got str"
    )
    _fails({"name": "a", "inner": {"count": 2.5}}, "inner.count = 2.5", key="inner.count")
    _fails({"name": "a", "inner": {"count": True}}, "inner.count = True", "expected an integer")
    _fails({"name": "a", "inner": {"rate": float("nan")}}, "inner.rate", "a finite number")
    _fails({"name": "a", "inner": {"tags": ["x", 3]}}, "inner.tags[1] = 3", key="inner.tags[1]")
    _fails({"name": "a", "inner": {"mode": "slwo"}}, "one of 'fast', 'slow'", "did you mean 'slow'")
    _fails({"name": "a", "inner": 3}, "inner = 3", "expected a mapping with keys rate, count")
    _fails({"name": "a", "flag": 1}, "flag = 1", "expected true or false")
    _fails({"name": "a", "limit": "x"}, "limit = 'x'", "expected an integer", key="limit")
    _fails({"name": "a", "extra": {1: 2}}, "extra = {1: 2}", "string keys")
    _fails({"name": 5}, "name = 5", "expected a string, got int")
    _fails([1], "the config = [1]", "expected a mapping of sections")


def test_bounds():
    _fails({"name": "a", "inner": {"rate": 0}}, "inner.rate = 0.0", "a number > 0 and ≤ 1")
    _fails({"name": "a", "inner": {"rate": 1.5}}, "> 0 and ≤ 1")
    _fails({"name": "a", "inner": {"count": 0}}, "inner.count = 0", "an integer ≥ 1")
    _fails({"name": "a", "limit": -1}, "limit = -1", "an integer ≥ 0 (or null)")
    assert E.build(Toy, {"name": "a", "limit": None}).limit is None
    assert E.build(Toy, {"name": "a", "limit": 0}).limit == 0


def test_required_values():
    _fails({}, "name is required", key="name")
    e = _fails({"name": "???"}, "name is required (the config leaves it as ???)", "`name=...`")
    assert e.key == "name"
    _fails({"name": "a", "inner": {"tags": ["x", "???"]}}, "inner.tags[1] is required")
    assert E.MISSING == "???"


def test_given_or_default():
    assert E._given_or_default({"name": "b"}, Toy, "name") == "b"
    assert E._given_or_default({}, Toy, "flag") is False
    assert E._given_or_default({}, Toy, "inner") == Inner()
    assert E._given_or_default(None, Toy, "flag") is None


# ---------------------------------------------------------------------------------------------
# Overrides.


def test_overrides():
    assert E.parse_override("inner.rate=1e-3") == {"inner": {"rate": 1e-3}}
    assert E.parse_override("a.b=[unclosed") == {"a": {"b": "[unclosed"}}
    assert E.parse_override("a=") == {"a": None}
    raw = E.merge_overrides({"name": "a", "inner": {"count": 2}}, ["inner.rate=.25", "name=b"])
    assert raw == {"name": "b", "inner": {"count": 2, "rate": 0.25}}
    assert E.merge_overrides({}, ["limit=1", "limit=2"]) == {"limit": 2}
    with pytest.raises(ConfigError, match=re.escape("expected `dotted.key=value`")):
        E.parse_override("inner.rate")
    with pytest.raises(ConfigError, match="not a dotted key"):
        E.parse_override("inner..rate=1")
    with pytest.raises(TypeError):
        E.merge_overrides({}, "name=a")


def test_load_with_overrides_fills_required(tmp_path):
    path = _write(tmp_path, "name: ???\ninner: {rate: 1e-1, tags: [a]}\n")
    with pytest.raises(ConfigError, match=re.escape("name is required")):
        E.load(Toy, path)
    toy = E.load(Toy, path, ["name=x", "inner.tags=[b, c]"])
    assert toy == Toy(name="x", inner=Inner(rate=0.1, tags=("b", "c")))


# ---------------------------------------------------------------------------------------------
# Inheritance, merge rules, YAML.


def test_inheritance(tmp_path):
    _write(tmp_path, "name: a\ninner: {rate: 0.2, count: 5, tags: [x, y]}\n", "a.yaml")
    _write(tmp_path, "defaults: a.yaml\ninner: {count: 6, tags: [z]}\n", "b.yaml")
    _write(tmp_path, "flag: true\n", "c.yaml")
    sub = tmp_path / "sub"
    sub.mkdir()
    path = _write(sub, "base: [../b.yaml, ../c.yaml]\ninner: {mode: slow}\n")
    toy = E.load(Toy, path)  # mappings merge key by key, lists replace, later files win
    assert toy == Toy(name="a", inner=Inner(rate=0.2, count=6, mode="slow", tags=("z",)), flag=True)


def test_an_include_not_beside_the_file_goes_to_the_finder(tmp_path):
    shelf = _write(tmp_path, "name: shelf\ninner: {count: 7}\n", "shelf.yaml")
    asked = []

    def find(include):
        asked.append(include)
        return shelf if include == "pkg/a" else None if include == "none" else "no such name"

    sub = tmp_path / "sub"
    sub.mkdir()
    raw = E._read_yaml(_write(sub, "base: pkg/a\nflag: true\n"), find=find)
    assert raw == {"name": "shelf", "inner": {"count": 7}, "flag": True} and asked == ["pkg/a"]
    _write(sub, "name: local\n", "shelf.yaml")  # a file beside the includer wins: not asked
    assert E._read_yaml(_write(sub, "base: shelf.yaml\n"), find=find) == {"name": "local"}
    assert asked == ["pkg/a"]
    with pytest.raises(ConfigError, match=r"other\.yaml \(included from .*c\.yaml\); no such name"):
        E._read_yaml(_write(sub, "base: other.yaml\n"), find=find)
    with pytest.raises(ConfigError, match=r"config file not found: .*none \(included from"):
        E._read_yaml(_write(sub, "base: none\n"), find=find)


def test_shorthands_expand_in_each_document_and_override_before_merging(tmp_path):
    """The schema's `expand` hook sees every file and every override on its own, before any
    merging, so a short spelling in one layer keeps the keys the layers below set."""
    seen = []

    def expand(raw, where):  # `inner: 7` is short for `inner: {count: 7}`
        seen.append(Path(where).name if where.endswith(".yaml") else where)
        return (
            {**raw, "inner": {"count": raw["inner"]}} if isinstance(raw.get("inner"), int) else raw
        )

    _write(tmp_path, "inner: {count: 1, rate: 0.25}\n", "below.yaml")
    toy = E.load(Toy, _write(tmp_path, "base: below.yaml\nname: n\ninner: 3\n"), expand=expand)
    assert (toy.inner.count, toy.inner.rate) == (3, 0.25) and seen == ["below.yaml", "c.yaml"]
    toy = E.load(Toy, tmp_path / "below.yaml", ["name=n", "inner=9"], expand=expand)
    assert (toy.inner.count, toy.inner.rate) == (9, 0.25) and seen[-2:] == [
        "override name",
        "override inner",
    ]
    with pytest.raises(ConfigError, match=r"inner = 3: expected a mapping"):
        E.load(Toy, tmp_path / "c.yaml")  # without the hook the short form is not the schema's


def test_include_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"config file not found: .*nope\.yaml"):
        E.load(Toy, tmp_path / "nope.yaml")
    path = _write(tmp_path, "base: missing.yaml\n")
    with pytest.raises(ConfigError, match=r"missing\.yaml \(included from .*c\.yaml\)"):
        E.load(Toy, path)
    _write(tmp_path, "base: b.yaml\n", "a.yaml")
    _write(tmp_path, "base: a.yaml\n", "b.yaml")
    with pytest.raises(ConfigError, match="include cycle"):
        E.load(Toy, tmp_path / "a.yaml")
    with pytest.raises(ConfigError, match="not both"):
        E.load(Toy, _write(tmp_path, "base: a.yaml\ndefaults: b.yaml\n"))
    with pytest.raises(ConfigError, match="a relative path to a YAML file"):
        E.load(Toy, _write(tmp_path, "base: {a: 1}\n"))


def test_merge_rule(tmp_path):
    def drop_extra_on_rename(path, base, child):
        if path == ("inner",) and "mode" in child and base.get("mode") != child["mode"]:
            return {k: v for k, v in base.items() if k != "tags"}
        return base

    _write(tmp_path, "name: a\ninner: {mode: fast, tags: [x], count: 2}\n", "a.yaml")
    path = _write(tmp_path, "base: a.yaml\ninner: {mode: slow}\n")
    assert E.load(Toy, path, rule=drop_extra_on_rename).inner == Inner(mode="slow", count=2)
    assert E.load(Toy, path).inner == Inner(mode="slow", count=2, tags=("x",))
    toy = E.load(Toy, tmp_path / "a.yaml", ["inner.mode=slow"], rule=drop_extra_on_rename)
    assert toy.inner.tags == ()
    toy = E.load(Toy, tmp_path / "a.yaml", ["inner.mode=fast"], rule=drop_extra_on_rename)
    assert toy.inner.tags == ("x",)


def test_yaml_reading(tmp_path):
    toy = E.load(Toy, _write(tmp_path, "name: a\ninner: {rate: 5e-1}\n"))
    assert toy.inner.rate == 0.5
    with pytest.raises(ConfigError, match=r"c\.yaml:4:3: .*duplicate key 'rate'"):
        E.load(Toy, _write(tmp_path, "name: a\ninner:\n  rate: 0.1\n  rate: 0.2\n"))
    with pytest.raises(ConfigError, match=r"c\.yaml:2:1: malformed YAML"):
        E.load(Toy, _write(tmp_path, "name: a\n\tinner: 1\n"))
    with pytest.raises(ConfigError, match="expected a mapping of sections at the top level"):
        E.load(Toy, _write(tmp_path, "- a\n"))
    with pytest.raises(ConfigError, match="name is required"):
        E.load(Toy, _write(tmp_path, ""))


def test_dump_yaml_round_trip(tmp_path):
    toy = Toy(name="1e-6", inner=Inner(rate=1e-3, tags=("null", "x")), extra={"k": (1, 2)})
    text = E.dump_yaml(toy, "# toy\n")
    assert text.startswith("# toy\nname: '1e-6'\n")
    assert E.load(Toy, _write(tmp_path, text)) == toy
    assert E.to_dict(toy)["extra"] == {"k": [1, 2]}


def test_alias_expansion_is_bounded(tmp_path, monkeypatch):
    monkeypatch.setattr(E, "MAX_YAML_NODES", 50)
    # 4 anchors of 5 references each: 5^4 = 625 leaves from a few lines.
    bomb = "name: x\nextra:\n  a: &a [1, 1, 1, 1, 1]\n" + "".join(
        f"  {b}: &{b} [{', '.join([f'*{a}'] * 5)}]\n" for a, b in zip("abc", "bcd", strict=True)
    )
    with pytest.raises(ConfigError, match=r"c\.yaml: the YAML stands for more than 50 values"):
        E.load(Toy, _write(tmp_path, bomb))
    shared = "name: x\nextra:\n  a: &a [1, 2]\n  b: *a\n  c: *a\n"  # 1 + 3 + 2·3 + ... < 50
    assert E.load(Toy, _write(tmp_path, shared)).extra["c"] == (1, 2)
    with pytest.raises(ConfigError, match=r"c\.yaml:2:\d+: a YAML alias refers to the node"):
        E.load(Toy, _write(tmp_path, "name: x\nextra: &e {self: *e}\n"))
    with pytest.raises(ConfigError, match="override extra: the YAML stands for more than 50"):
        E.load(
            Toy,
            _write(tmp_path, "name: x\n"),
            ["extra={a: &a [1, 1, 1, 1, 1, 1, 1, 1], b: [*a, *a, *a, *a, *a, *a, *a]}"],
        )


def test_overrides_that_yaml_would_misread():
    # A '#' that would start a comment, or ': ' that would make a mapping: the typed text for a
    # string field ...
    toy = E.build(Toy, E.merge_overrides({}, ["name=# heading", "inner.tags=[a, b]"]))
    assert toy.name == "# heading" and type(toy.name) is str
    assert E.build(Toy, E.merge_overrides({}, ["name=Answer: 42"])).name == "Answer: 42"
    assert E.build(Toy, E.merge_overrides({}, ["name='quoted # kept'"])).name == "quoted # kept"
    assert E.build(Toy, E.merge_overrides({}, ["name=a#b"])).name == "a#b"  # no comment: plain
    # ... and an error that says to quote it for any other field.
    for override, reads_as in [
        ("limit=#3", "None"),
        ("limit=3 # three", "3"),
        ("extra=a: 1", "{'a': 1}"),
        ("inner.mode=fast # or slow", "'fast'"),
    ]:
        key = override.split("=")[0]
        with pytest.raises(ConfigError, match="quote the value") as e:
            E.build(Toy, E.merge_overrides({"name": "x"}, [override]))
        assert f"reads as {reads_as}" in str(e.value) and f"'{key}=\"...\"'" in str(e.value)
    # Text YAML cannot read at all (an unclosed bracket): a string field gets it, any other
    # field's error quotes YAML's complaint.
    assert E.build(Toy, E.merge_overrides({}, ["name=[draft"])).name == "[draft"
    for override, expected in [("limit=[3", "an integer"), ("inner=[a, {b: 1", "a mapping")]:
        with pytest.raises(ConfigError, match=f"expected {expected}") as e:
            E.build(Toy, E.merge_overrides({"name": "x"}, [override]))
        assert "not valid YAML, so it was read as text: while parsing a flow" in str(e.value)
    # Free-form mappings get plain strings (YAML-dumpable).
    toy = E.build(Toy, E.merge_overrides({"name": "x"}, ["extra.note=# n"]))
    assert type(toy.extra["note"]) is str and "note: '# n'" in E.dump_yaml(toy)

"""jaxrl_llm.config.schema: one comment per knob, names taken from the modules that own them.

The shipped configs, ``configs/base.yaml`` as the defaults and the validation checks are tested
in tests/test_config.py.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import typing

from jaxrl_llm import algorithms, numerics
from jaxrl_llm.config import engine, schema, validation
from jaxrl_llm.rewards import registry


def _schema_classes() -> list[type]:
    return [
        obj
        for obj in vars(schema).values()
        if inspect.isclass(obj)
        and dataclasses.is_dataclass(obj)
        and obj.__module__ == schema.__name__
    ]


def test_every_knob_has_one_comment_line():
    source = inspect.getsource(schema).splitlines()
    tree = ast.parse("\n".join(source))
    classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}
    assert {c.__name__ for c in _schema_classes()} <= set(classes)
    for cls in _schema_classes():
        params = cls.__dataclass_params__
        assert params.frozen and cls.__slots__ and all(f.kw_only for f in dataclasses.fields(cls))
        fields = [n for n in classes[cls.__name__].body if isinstance(n, ast.AnnAssign)]
        assert [f.target.id for f in fields] == [f.name for f in dataclasses.fields(cls)]
        for node in fields:
            where = f"{cls.__name__}.{node.target.id}"
            above, two_above = source[node.lineno - 2].strip(), source[node.lineno - 3].strip()
            assert above.startswith("# "), f"{where} has no comment on the line above"
            assert not two_above.startswith("#"), f"{where}: one comment line per knob"
            assert len(source[node.lineno - 2]) <= 100


def test_recipe_and_numerics_names_come_from_their_modules():
    assert typing.get_args(schema.RecipeName) == tuple(algorithms.RECIPES)
    names = typing.get_args(schema.NumericsName)
    assert names == ("default", "verl", "trl", "openrlhf")
    assert set(names) <= set(numerics.PRESETS)
    assert {id(numerics.PRESETS[n]) for n in names} == {id(p) for p in numerics.PRESETS.values()}
    hints = typing.get_type_hints(schema.AlgorithmConfig)
    assert hints["name"] == schema.RecipeName and hints["numerics"] == schema.NumericsName


def test_recipe_lists_and_reward_types_name_real_ones():
    assert set(validation.GROUP_RECIPES) < set(algorithms.RECIPES)
    assert set(validation.RATIO_FREE_RECIPES) < set(algorithms.RECIPES)
    assert validation.REWARD_TYPES == (
        "integer_answer",
        "gsm8k",
        "boxed",
        "math_verify",
        "regex",
        "length_penalty",
        "reward_model",
        "verl",
        "trl",
        "route",
    )
    for name in validation.REWARD_TYPES:
        assert registry.TYPE_ALIASES.get(name, name) in registry.REWARD_TYPES


def test_the_engine_knows_no_schema():
    tree = ast.parse(inspect.getsource(engine))
    imported = [
        alias.name if isinstance(node, ast.Import) else node.module
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in node.names
    ]
    assert not [m for m in imported if m and m.startswith("jaxrl_llm")], imported
    assert "TrainConfig" not in inspect.getsource(engine)

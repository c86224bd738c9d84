"""jaxrl_llm.core's namespace: every public function of a core module, in chain order."""

import ast
import importlib
import inspect
import pkgutil
from pathlib import Path

import jaxrl_llm.core as core


def _core_modules():
    """The public modules of ``jaxrl_llm.core`` (``_contracts`` is internal)."""
    for info in pkgutil.iter_modules(core.__path__):
        if not info.name.startswith("_"):
            yield importlib.import_module(f"{core.__name__}.{info.name}")


def _is_lookup(name: str) -> bool:
    """A string -> function lookup (``get_aggregation``, ...): the recipe layer's, not core's."""
    return name.startswith("get_")


def _public_definitions(module):
    """Public functions and classes defined in ``module`` itself (not imported into it)."""
    for name, obj in vars(module).items():
        if name.startswith("_") or _is_lookup(name):
            continue
        if (inspect.isfunction(obj) or inspect.isclass(obj)) and obj.__module__ == module.__name__:
            yield name, obj


def test_every_public_function_of_a_core_module_is_exported():
    missing = []
    for module in _core_modules():
        for name, obj in _public_definitions(module):
            if name not in core.__all__ or getattr(core, name) is not obj:
                missing.append(f"{module.__name__}.{name}")
    assert not missing, f"add to jaxrl_llm/core/__init__.py (imports and __all__): {missing}"


def test_exports_are_core_functions_and_nothing_else():
    assert len(core.__all__) == len(set(core.__all__)), "duplicates in __all__"
    modules = {m.__name__ for m in _core_modules()}
    for name in core.__all__:
        obj = getattr(core, name)
        assert obj.__module__ in modules, name
        assert not _is_lookup(name) and not isinstance(obj, dict | tuple | list), name


def test_all_is_in_the_order_of_the_imports():
    """``__all__`` lists the names in the chain order the imports follow."""
    tree = ast.parse(Path(core.__file__).read_text())
    imported = [
        alias.asname or alias.name
        for node in tree.body
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    ]
    assert imported == core.__all__


def test_submodules_stay_importable():
    from jaxrl_llm.core import kl as _kl
    from jaxrl_llm.core import returns

    assert core.returns is returns and core.gae is returns.gae
    assert _kl.kl_k3 is core.kl_k3
    assert core.aggregation.token_mean is core.token_mean

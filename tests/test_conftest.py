"""The suite's own machinery in ``tests/conftest.py``: JAX's caches are dropped at a test
module's end once the process holds 40% of the kernel's memory-mapping limit."""

import types

import jax

from tests import conftest


def _item(path: str) -> types.SimpleNamespace:
    return types.SimpleNamespace(path=path)


def test_caches_are_dropped_at_a_module_end_past_the_mapping_threshold(monkeypatch):
    cleared = []
    monkeypatch.setattr(jax, "clear_caches", lambda: cleared.append(True))
    monkeypatch.setattr(conftest, "_max_mappings", lambda: 1000)
    monkeypatch.setattr(conftest, "_mappings", lambda: 401)
    conftest.pytest_runtest_teardown(_item("a.py"), _item("a.py"))  # same module: kept
    assert cleared == []
    conftest.pytest_runtest_teardown(_item("a.py"), _item("b.py"))
    conftest.pytest_runtest_teardown(_item("b.py"), None)  # the last test
    assert cleared == [True, True]
    monkeypatch.setattr(conftest, "_mappings", lambda: 400)  # at 40%, not past it: kept
    conftest.pytest_runtest_teardown(_item("b.py"), _item("c.py"))
    assert len(cleared) == 2


def test_the_mapping_count_is_this_process_s():
    count = conftest._mappings()
    if count is not None:  # Linux: one line of /proc/self/maps per mapping
        assert 100 < count < conftest._max_mappings()  # the Python + JAX process has hundreds

"""The pieces the test launchers share (tests/helpers/launch.py): wrapping a module attribute once its module is
imported, the lazily built worker extension class, and the replacement that fails on a renamed attribute."""

import sys
import types

import pytest

from tests.helpers import launch


def _module_source(tmp_path, monkeypatch, name: str):
    """An importable package ``name`` on a temporary path, with ``Class.method`` and a module function ``f``."""
    (tmp_path / f"{name}.py").write_text(
        "def f(x):\n    return x\n\n\nclass Class:\n    def method(self, x):\n        return x\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)


def _doubling(calls):
    def wrap(fn):
        calls.append(fn)

        def doubled(*args):
            return 2 * fn(*args)

        return doubled

    return wrap


def test_a_module_imported_after_arming_is_wrapped_exactly_once(tmp_path, monkeypatch):
    name = "launch_helpers_probe_after"
    _module_source(tmp_path, monkeypatch, name)
    calls = []
    for _ in range(2):  # armed twice, as two set-up hooks in one process could
        launch.wrap_after_import(name, "f", _doubling(calls), "_probe")
        launch.wrap_after_import(name, "Class.method", _doubling(calls), "_probe")
    assert name not in sys.modules and calls == []  # nothing imported by arming

    module = __import__(name)
    try:
        assert len(calls) == 2  # one wrap per attribute, not one per arming
        assert module.f(3) == 6 and module.Class().method(5) == 10
        assert module.f._probe and module.Class.method._probe
        # armed again now that it is imported: the marker keeps it wrapped once
        launch.wrap_after_import(name, "f", _doubling(calls), "_probe")
        assert module.f(3) == 6 and len(calls) == 2
        # another marker (another launcher's patch) wraps on top
        launch.wrap_after_import(name, "f", _doubling(calls), "_other")
        assert module.f(3) == 12
    finally:
        sys.modules.pop(name, None)


def test_a_module_imported_before_arming_is_wrapped_at_once(tmp_path, monkeypatch):
    name = "launch_helpers_probe_before"
    _module_source(tmp_path, monkeypatch, name)
    module = __import__(name)
    try:
        calls = []
        launch.wrap_after_import(name, "f", _doubling(calls), "_probe")
        assert module.f(4) == 8 and len(calls) == 1
        launch.wrap_after_import(name, "f", _doubling(calls), "_probe")
        assert module.f(4) == 8 and len(calls) == 1
    finally:
        sys.modules.pop(name, None)


def test_a_renamed_attribute_fails_instead_of_going_unwrapped(tmp_path, monkeypatch):
    name = "launch_helpers_probe_renamed"
    _module_source(tmp_path, monkeypatch, name)
    __import__(name)
    try:
        with pytest.raises(AttributeError):
            launch.wrap_after_import(name, "gone", _doubling([]), "_probe")
    finally:
        sys.modules.pop(name, None)
    target = types.SimpleNamespace(__name__="some.module", kept=1)
    with pytest.raises(AttributeError, match=r"some\.module\.gone is gone: update tests/helpers/span_gate\.py"):
        launch.replace(target, "gone", 2, "tests.helpers.span_gate")
    launch.replace(target, "kept", 2, "tests.helpers.span_gate")
    assert target.kept == 2


def test_the_worker_extension_is_built_once_on_first_use(monkeypatch):
    built = []

    def build(base):
        built.append(base)
        return type("Probe", (base,), {})

    getattr_ = launch.lazy_worker_extension("Probe", build)
    assert built == []
    fake = types.ModuleType("openrlhf_ess.trainer.ray.vllm_worker_wrap")
    fake.WorkerWrap = type("WorkerWrap", (), {})
    monkeypatch.setitem(sys.modules, fake.__name__, fake)  # no vLLM in this test
    cls = getattr_("Probe")
    assert getattr_("Probe") is cls and issubclass(cls, fake.WorkerWrap) and len(built) == 1
    with pytest.raises(AttributeError):
        getattr_("Other")

"""The span gate (tests/helpers/span_gate.py), the test-only device that makes weight syncs land inside a rollout
batch: a fake model runner, no engine."""

import threading
import types

from tests.helpers import span_gate


class _Runner:
    def __init__(self):
        self.calls = []

    def execute_model(self, scheduler_output):
        self.calls.append(scheduler_output.total_num_scheduled_tokens)
        return len(self.calls)


def _step(tokens):
    return types.SimpleNamespace(total_num_scheduled_tokens=tokens)


def test_armed_gate_lets_one_step_through_then_holds_until_released(tmp_path, monkeypatch):
    gate = str(tmp_path / "gate")
    monkeypatch.setenv(span_gate.ENV, gate)
    runner = _Runner()
    span_gate.gate_worker(runner)
    assert runner.execute_model(_step(5)) == 1  # not armed: no hold
    assert span_gate.arm(gate) == 1
    assert runner.execute_model(_step(0)) == 2  # a step that schedules nothing does not count
    assert runner.execute_model(_step(7)) == 3  # the armed gate's first step
    done = threading.Event()
    worker = threading.Thread(target=lambda: (runner.execute_model(_step(7)), done.set()))
    worker.start()
    worker.join(0.5)
    assert worker.is_alive() and not done.is_set() and len(runner.calls) == 3  # held before the step ran
    span_gate.release(gate)
    worker.join(30)
    assert done.is_set() and len(runner.calls) == 4
    assert span_gate.held(gate) == [1]
    # the next arm holds again after one step; a released gate never holds
    assert span_gate.arm(gate) == 2
    runner.execute_model(_step(3))
    span_gate.release(gate)
    runner.execute_model(_step(3))
    assert span_gate.held(gate) == [1] and len(runner.calls) == 6


def test_gate_off_without_the_variable(monkeypatch):
    monkeypatch.delenv(span_gate.ENV, raising=False)
    runner = _Runner()
    original = runner.execute_model
    span_gate.gate_worker(runner)
    span_gate.install_trainer()
    assert runner.execute_model == original

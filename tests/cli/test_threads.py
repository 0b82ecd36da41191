"""The CPU thread default (quantkit.threads) from injected load readings; no timing."""

from __future__ import annotations

import pytest

from quantkit import threads
from quantkit.errors import QuantkitError

STAT_BEFORE = "cpu  10 0 10 80 0 0 0 0 0 0\ncpu0 5 0 5 40 0 0 0 0 0 0\ncpu1 5 0 5 40 0 0 0 0 0 0\nintr 1 2\n"


def _snapshot(busy0: int, busy1: int, step: int = 100) -> dict[int, tuple[int, int]]:
    """Two CPUs after ``step`` jiffies, ``busy`` of them non-idle on each."""
    return {0: (40 + step - busy0, 50 + step), 1: (40 + step - busy1, 50 + step)}


def test_proc_stat_parsing(tmp_path):
    path = tmp_path / "stat"
    path.write_text(STAT_BEFORE)
    assert threads.read_proc_stat(str(path)) == {0: (40, 50), 1: (40, 50)}
    assert threads.read_proc_stat(str(tmp_path / "missing")) == {}


def test_busy_cores_between_snapshots():
    before = {0: (40, 50), 1: (40, 50)}
    assert threads.busy_cores([0, 1], before, _snapshot(100, 0)) == pytest.approx(1.0)
    assert threads.busy_cores([0, 1], before, _snapshot(50, 50)) == pytest.approx(1.0)
    assert threads.busy_cores([1], before, _snapshot(100, 0)) == pytest.approx(0.0)  # only the usable cores
    assert threads.busy_cores([5], before, _snapshot(0, 0)) is None


def test_measure_samples_twice_and_sleeps_the_interval():
    readings = iter([{0: (40, 50), 1: (40, 50)}, _snapshot(90, 95)])
    slept = []
    busy = threads.measure_busy_cores([0, 1], read=lambda: next(readings), sleep=slept.append, seconds=0.25)
    assert busy == pytest.approx(1.85) and slept == [0.25]
    assert threads.measure_busy_cores([0], read=dict, sleep=slept.append) is None


@pytest.mark.parametrize("n_usable,busy,expected,passive", [
    (2, 0.0, 2, False),   # idle machine: every core
    (2, 0.3, 2, False),   # background noise is not a busy core
    (2, 1.0, 1, True),    # one core busy elsewhere: the other one, and no spinning
    (2, 1.9, 1, True),    # both busy: still one thread
    (2, 5.0, 1, True),
    (16, 3.6, 12, True),
    (1, 0.9, 1, True),
])
def test_auto_is_the_free_cores_at_least_one(n_usable, busy, expected, passive):
    choice = threads.choose(option=None, env={}, n_usable=n_usable, busy=busy)
    assert (choice.threads, choice.source, choice.passive_wait) == (expected, "auto", passive)
    assert choice.reason.startswith(f"threads: {expected} (") and "--threads" in choice.reason


def test_explicit_choices_win_in_order():
    assert threads.choose(option=3, env={"OMP_NUM_THREADS": "1"}, n_usable=2, busy=2.0).threads == 3
    env_choice = threads.choose(option=None, env={"OMP_NUM_THREADS": "4"}, n_usable=2, busy=2.0)
    assert (env_choice.threads, env_choice.source) == (4, "env")
    # A malformed OMP_NUM_THREADS falls back to the automatic choice.
    assert threads.choose(option=None, env={"OMP_NUM_THREADS": "x"}, n_usable=2, busy=0.0).source == "auto"
    unknown = threads.choose(option=None, env={}, n_usable=4, busy=None)
    assert unknown.threads == 4 and "could not be read" in unknown.reason
    with pytest.raises(QuantkitError, match="--threads must be at least 1"):
        threads.choose(option=0, env={}, n_usable=2, busy=0.0)


def test_decide_reads_no_load_when_told(monkeypatch):
    monkeypatch.setattr(threads, "measure_busy_cores", lambda cores: pytest.fail("sampled although told"))
    assert threads.decide(2, env={}).threads == 2
    assert threads.decide(None, env={"OMP_NUM_THREADS": "1"}).threads == 1


def test_apply_sets_the_environment_for_torch_and_children():
    env: dict[str, str] = {"MKL_NUM_THREADS": "7"}
    threads.apply(threads.ThreadChoice(1, "auto", True, ""), environ=env)
    assert env == {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "7", "OMP_WAIT_POLICY": "PASSIVE"}
    import torch

    before = torch.get_num_threads()
    try:
        threads.apply(threads.ThreadChoice(1, "option", False, ""), environ={})
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)

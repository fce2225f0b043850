"""What omni-pipeline does when torch's private pipelining helpers are missing or changed, and without
matplotlib (the ``plot`` extra). The installed torch has the helpers; each test takes them away or
replaces them with monkeypatch and clears the cached probe on both sides."""

import sys
import warnings

import pytest
import torch
import torch.distributed.pipelining.schedules as tps

from omni_pipeline import Schedule1F1B, ScheduleError, ScheduleFromActions, plot_timeline
from omni_pipeline.schedules import _probe_torch_checkers
from omni_pipeline.trace import TimelineEvent


@pytest.fixture
def torch_pp(monkeypatch):
    """torch.distributed.pipelining.schedules, patchable; the probe sees the patched module."""
    _probe_torch_checkers.cache_clear()
    yield tps
    monkeypatch.undo()
    _probe_torch_checkers.cache_clear()


def test_validate_cross_checks_with_torch_by_default(torch_pp, monkeypatch):
    calls = []
    for name in ("_validate_schedule", "_add_send_recv", "_simulate_comms_compute"):
        original = getattr(torch_pp, name)
        monkeypatch.setattr(torch_pp, name, lambda *a, _f=original, _n=name: calls.append(_n) or _f(*a))
    Schedule1F1B(2, 3).validate()
    assert calls == ["_validate_schedule", "_add_send_recv", "_simulate_comms_compute"]
    calls.clear()
    Schedule1F1B(2, 3).validate(torch_check=False)
    assert calls == []


def test_missing_torch_helper_skips_the_cross_check_with_one_warning(torch_pp, monkeypatch):
    monkeypatch.delattr(torch_pp, "_add_send_recv")
    s = Schedule1F1B(2, 3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")  # Python's default: a warning once per text and place
        s.validate()
        Schedule1F1B(4, 8).validate()
    assert [str(w.message) for w in caught] == [
        "Schedule.validate: torch's pipelining cross-check skipped, only omni-pipeline's rules checked: "
        f"torch {torch.__version__}'s torch.distributed.pipelining.schedules has no _add_send_recv"
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        s.validate(torch_check=False)  # no warning when the caller asked for our rules only
    with pytest.raises(ImportError, match=r"validate\(torch_check=True\) needs .* has no _add_send_recv"):
        s.validate(torch_check=True)
    with pytest.raises(ImportError, match=r"Schedule.with_comms needs .* has no _add_send_recv"):
        s.with_comms()
    # our rules still run first and still name the broken action
    broken = ScheduleFromActions(2, 1, {0: ["0B0", "0F0"], 1: ["1F0", "1B0"]})
    with pytest.raises(
        ScheduleError, match="action 0B0: backward of stage 0 microbatch 0 before its forward"
    ):
        broken.validate(torch_check=True)


def test_changed_torch_signature_is_not_called(torch_pp, monkeypatch):
    called = []
    monkeypatch.setattr(torch_pp, "_simulate_comms_compute", lambda pipeline_order: called.append(1))
    with pytest.warns(UserWarning, match="_simulate_comms_compute does not take the 3 positional arguments"):
        Schedule1F1B(2, 3).validate()
    with pytest.raises(ImportError, match="_simulate_comms_compute does not take the 3 positional arguments"):
        Schedule1F1B(2, 3).validate(torch_check=True)
    assert called == []


def test_torch_rejecting_what_our_rules_accept_is_a_schedule_error(torch_pp, monkeypatch):
    def reject(actions, pp_group_size, num_stages, num_microbatches):
        raise AssertionError("rank 1 is missing 1F2")

    monkeypatch.setattr(torch_pp, "_validate_schedule", reject)
    with pytest.raises(ScheduleError, match="torch's pipelining checkers reject it: rank 1 is missing 1F2"):
        Schedule1F1B(2, 3).validate()
    Schedule1F1B(2, 3).validate(torch_check=False)


def test_plot_without_matplotlib_names_the_extra(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    events = {0: [TimelineEvent(0, "0F0", "F", 0.0, 1.0)]}
    with pytest.raises(ImportError, match=r"pip install 'omni-pipeline\[plot\]'") as info:
        plot_timeline(events, tmp_path / "t.png")
    assert info.value.name == "matplotlib"
    assert not (tmp_path / "t.png").exists()

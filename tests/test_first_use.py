"""Never slower than the reference on untuned shapes (pairgen/first_use.py), on the CPU: a default
variant comes with a pending first-use check; the check's verdict is recorded in the user's tuned
folder and read back by later lookups (kernel or reference), for that default's source only; a
failing check keeps the kernel; the verdict file is not a tuned database. The timing itself runs
on the GPU (tests/test_first_use_gpu.py)."""
from __future__ import annotations

import json
import warnings

import pytest

from pairgen import first_use, runtime, tuned
from pairgen.ops.contact import CONTACT
from pairgen.spec import DeviceLimits

INFO = runtime.DeviceInfo(0, "Test GPU", "test-gpu", "sm_90", DeviceLimits())
WIDTHS = {"P": 48, "H": 16}  # nobody tuned these


@pytest.fixture
def folder(first_use_folder):
    return first_use_folder


def _choose(n=100):
    return runtime.choose(CONTACT, "float32", WIDTHS, n, INFO)


class FakeVariant:
    def __init__(self, plan):
        self.plan = plan


def _pending(choice) -> first_use.Pending:
    return first_use.Pending(FakeVariant(choice.plan), "contact", INFO.slug, "float32", WIDTHS, 128,
                             choice.unchecked_source)


def test_an_untuned_key_runs_the_default_with_a_check_pending(folder):
    choice = _choose()
    assert choice.source == "default" and choice.plan is not None and choice.unchecked_source


@pytest.mark.parametrize("kernel_us,reference_us,winner", [(10.0, 30.0, "kernel"), (50.0, 20.0, "reference")])
def test_the_verdict_is_recorded_and_read_back(folder, monkeypatch, kernel_us, reference_us, winner):
    choice = _choose()
    pending = _pending(choice)
    timed = []
    monkeypatch.setattr(first_use, "measure", lambda k, r, d: timed.append(1) or (kernel_us, reference_us))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = pending.settle(lambda: None, lambda: None, "cuda:0")
    assert (result is pending.variant) == (winner == "kernel") and (result is None) == (winner == "reference")
    assert any("slower than the PyTorch reference" in str(w.message) for w in caught) == (winner == "reference")
    assert pending.settle(lambda: None, lambda: None, "cuda:0") is result and timed == [1], "timed once"
    path = folder / INFO.slug / "first-use" / "contact.json"
    (verdict,) = json.loads(path.read_text())["verdicts"]
    assert verdict["winner"] == winner and verdict["kernel_us"] == kernel_us and verdict["reference_us"] == reference_us
    again = _choose()
    assert again.unchecked_source is None, "a later lookup reads the verdict instead of timing again"
    if winner == "kernel":
        assert again.plan.label == choice.plan.label and again.source.startswith("default (faster than the reference")
    else:
        assert again.plan is None and again.expected_reference and "first-use check" in again.source and "slower" in again.source


def test_a_verdict_for_another_source_is_not_used(folder):
    """A template edit changes the default variant's source: its old verdict says nothing about it."""
    choice = _choose()
    first_use.record_verdict("contact", INFO.slug, "float32", WIDTHS, 128, "0" * 64, "old", 50.0, 20.0)
    assert _choose().source == "default" and _choose().unchecked_source == choice.unchecked_source


def test_a_failing_check_keeps_the_kernel_and_says_why(folder, monkeypatch):
    pending = _pending(_choose())

    def broken(kernel, reference, device):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(first_use, "measure", broken)
    with pytest.warns(UserWarning, match="first-use check .* failed .*out of memory.*running the default kernel"):
        assert pending.settle(lambda: None, lambda: None, "cuda:0") is pending.variant
    assert pending.settled and not (folder / INFO.slug / "first-use").exists()


def test_no_check_inside_a_cuda_graph_capture(folder, monkeypatch):
    pending = _pending(_choose())
    monkeypatch.setattr(first_use, "_capturing", lambda: True)
    monkeypatch.setattr(first_use, "measure", lambda *a: pytest.fail("timed inside a capture"))
    assert pending.settle(lambda: None, lambda: None, "cuda:0") is pending.variant and not pending.settled


def test_select_hands_out_a_pending_check_unless_turned_off(folder, monkeypatch):
    monkeypatch.setattr(runtime, "device_info", lambda index: INFO)
    monkeypatch.setattr(runtime, "_by_plan", lambda plan, arch: FakeVariant(plan))
    selected = runtime.select(CONTACT, "float32", WIDTHS, 100, 0)
    assert type(selected) is first_use.Pending and selected.bucket == 128
    monkeypatch.setenv("PAIRGEN_FIRST_USE_CHECK", "0")
    runtime.clear_caches()
    assert type(runtime.select(CONTACT, "float32", WIDTHS, 100, 0)) is FakeVariant


def test_the_verdict_file_is_not_a_tuned_database(folder):
    first_use.record_verdict("contact", INFO.slug, "float32", WIDTHS, 128, "0" * 64, "x", 1.0, 2.0)
    assert not [db for db in tuned.all_databases(folder) if "first" in str(db.path)]


def test_status_lists_the_verdicts(folder):
    from pairgen.tuning.tune_status import first_use_verdicts

    assert "no first-use verdicts" in first_use_verdicts()
    first_use.record_verdict("contact", INFO.slug, "float32", WIDTHS, 128, "0" * 64, "x", 50.0, 20.0)
    text = first_use_verdicts()
    assert "| test-gpu | contact | H=16 P=48 | float32 | 128 | 50.0 | 20.0 | reference |" in text

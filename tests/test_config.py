"""Environment variables: a bad value raises a ValueError that names the variable and the value,
so a typo fails at once with the fix in the message instead of every compile or trial failing
later with an error that does not say where the value came from."""
from __future__ import annotations

import pytest

from pairgen import config


@pytest.mark.parametrize("arch", ["sm_80", "sm_89", "sm_90", "sm_90a", "sm_100", "sm_100a", "sm_100f", "sm_120"])
def test_real_gpu_targets_are_accepted(monkeypatch, arch):
    monkeypatch.setenv("PAIRGEN_ARCH", arch)
    assert config.arch_override() == arch


def test_no_arch_override_when_unset_or_empty(monkeypatch):
    monkeypatch.delenv("PAIRGEN_ARCH", raising=False)
    assert config.arch_override() is None
    monkeypatch.setenv("PAIRGEN_ARCH", "")
    assert config.arch_override() is None


@pytest.mark.parametrize("arch", ["compute_90", "sm90", "90", "sm_9", "sm_90x", "SM_90", "sm_90 ", "lto_90"])
def test_a_bad_arch_names_the_variable_the_value_and_what_is_expected(monkeypatch, arch):
    """compute_90 (a virtual architecture) used to "compile" every variant into a 0-byte cubin."""
    monkeypatch.setenv("PAIRGEN_ARCH", arch)
    with pytest.raises(ValueError) as info:
        config.arch_override()
    message = str(info.value)
    assert "PAIRGEN_ARCH" in message and repr(arch) in message and "sm_90" in message


def test_compile_workers_default_and_explicit(monkeypatch):
    monkeypatch.delenv("PAIRGEN_COMPILE_WORKERS", raising=False)
    assert config.compile_workers() >= 1
    monkeypatch.setenv("PAIRGEN_COMPILE_WORKERS", "3")
    assert config.compile_workers() == 3


@pytest.mark.parametrize("value", ["four", "2.5", "0", "-1", "1e2"])
def test_bad_compile_workers_name_the_variable_and_the_value(monkeypatch, value):
    monkeypatch.setenv("PAIRGEN_COMPILE_WORKERS", value)
    with pytest.raises(ValueError) as info:
        config.compile_workers()
    assert "PAIRGEN_COMPILE_WORKERS" in str(info.value) and repr(value) in str(info.value)


def test_compile_budget_default_and_explicit(monkeypatch):
    monkeypatch.delenv("PAIRGEN_COMPILE_BUDGET_S", raising=False)
    assert config.compile_budget_s() == 60.0
    monkeypatch.setenv("PAIRGEN_COMPILE_BUDGET_S", "2.5")
    assert config.compile_budget_s() == 2.5


@pytest.mark.parametrize("value", ["soon", "0", "-5", "nan", "inf", "-inf"])
def test_bad_compile_budget_names_the_variable_and_the_value(monkeypatch, value):
    """A budget of 0 or less used to fail every trial as "over the budget" instead of saying why."""
    monkeypatch.setenv("PAIRGEN_COMPILE_BUDGET_S", value)
    with pytest.raises(ValueError) as info:
        config.compile_budget_s()
    assert "PAIRGEN_COMPILE_BUDGET_S" in str(info.value) and repr(value) in str(info.value)

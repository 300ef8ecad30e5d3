"""PAIRGEN_ARCH must name a target the installed NVRTC compiles for: sm_99 matched the pattern and
then failed every compile, and a bad value ended the commands with a traceback. The function raises
one ValueError naming the variable, the value and the valid values; the commands print that line
and exit with status 2."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pairgen import config

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("arch", ["garbage", "sm_99", "sm_80a", "sm_90f"])
def test_an_arch_nvrtc_does_not_compile_for_is_refused_with_the_valid_values(monkeypatch, arch):
    monkeypatch.setenv("PAIRGEN_ARCH", arch)
    with pytest.raises(ValueError) as info:
        config.arch_override()
    message = str(info.value)
    assert "PAIRGEN_ARCH" in message and repr(arch) in message
    assert all(f"sm_{cc}" in message for cc in config.supported_archs())
    assert "\n" not in message


def test_the_supported_archs_are_nvrtcs():
    from cuda.bindings import nvrtc

    err, archs = nvrtc.nvrtcGetSupportedArchs()
    assert err == nvrtc.nvrtcResult.NVRTC_SUCCESS
    assert config.supported_archs() == tuple(sorted(archs))
    assert 90 in config.supported_archs() and 99 not in config.supported_archs()


def test_without_nvrtc_a_known_list_is_used(monkeypatch):
    """Where NVRTC cannot be asked (not loadable, an old binding), a known list still refuses sm_99."""
    from cuda.bindings import nvrtc

    monkeypatch.delattr(nvrtc, "nvrtcGetSupportedArchs")  # as in a binding without the call
    config.supported_archs.cache_clear()
    try:
        assert config.supported_archs() == config.KNOWN_ARCHS
        monkeypatch.setenv("PAIRGEN_ARCH", "sm_90")
        assert config.arch_override() == "sm_90"
        monkeypatch.setenv("PAIRGEN_ARCH", "sm_99")
        with pytest.raises(ValueError, match="PAIRGEN_ARCH='sm_99'"):
            config.arch_override()
    finally:
        config.supported_archs.cache_clear()


@pytest.mark.parametrize("arch", ["garbage", "sm_99"])
@pytest.mark.parametrize("command", [("scripts/tune.py", "--dry-run", "--op", "contact", "--preset", "seed"),
                                     ("scripts/bench.py", "--op", "contact", "--preset", "seed")])
def test_the_commands_print_one_line_and_exit_2(arch, command):
    env = {**os.environ, "PAIRGEN_ARCH": arch}
    result = subprocess.run([sys.executable, *command], cwd=ROOT, capture_output=True, text=True, env=env,
                            timeout=600)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert "PAIRGEN_ARCH" in line and repr(arch) in line and "sm_90" in line

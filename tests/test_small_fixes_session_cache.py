"""A test session writes nothing into the user's cache (~/.cache/pairgen): tests/conftest.py points
PAIRGEN_CACHE_DIR at a folder of the session's own before any test module is imported, so work done
at import or collection time, in a module-scoped fixture, or in a thread that outlives its test (the
native helper's build) stays out of it too."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent

PROBE = '''
import os
from pathlib import Path

from pairgen import compiler, config

SOURCE = 'extern "C" __global__ void probe_k(float* x) { x[threadIdx.x] = 2.0f; }'
compiler.compile_source(SOURCE, "probe_k", "sm_90")  # at collection: before any fixture runs


def test_the_cache_is_the_sessions():
    home = Path(os.environ["HOME"]).resolve()
    cache = config.cache_dir().resolve()
    assert home not in cache.parents and list(cache.glob("cubin/*/*.cubin"))
'''


def test_a_session_writes_nothing_under_the_users_cache(tmp_path):
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    (work / "test_probe.py").write_text(PROBE)
    env = {k: v for k, v in os.environ.items() if k != "PAIRGEN_CACHE_DIR"}  # the conftest must set it itself
    env.update(HOME=str(home), PYTHONPATH=os.pathsep.join([str(TESTS), str(ROOT), env.get("PYTHONPATH", "")]))
    # The probe lies outside tests/, so the conftest is loaded as a plugin (-p conftest, from PYTHONPATH).
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "conftest", "-p", "no:cacheprovider",
                             "test_probe.py"], cwd=work, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    written = sorted(str(p.relative_to(home)) for p in (home / ".cache" / "pairgen").rglob("*")) \
        if (home / ".cache" / "pairgen").exists() else []
    assert written == [], f"the session wrote into the user's cache: {written[:5]}"

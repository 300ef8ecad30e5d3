"""Installing pairgen: the wheel carries the templates and the tuned results, its commands run from
a fresh environment outside the checkout, and the tuned folders follow the install (a checkout's
tuned/; the user folder over the shipped results; PAIRGEN_TUNED_DIR alone)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from importlib import metadata
from pathlib import Path

import pytest

from pairgen import codegen, config, runtime
from pairgen.ops import render
from pairgen.ops.contact import CONTACT
from pairgen.spec import DeviceLimits
from pairgen.tuned import TunedDB, make_key
from pairgen.tuning import tune_cli

ROOT = Path(__file__).resolve().parent.parent
WIDTHS = {"P": 64, "H": 32}
H200 = runtime.DeviceInfo(0, "NVIDIA H200", "nvidia-h200", "sm_90", DeviceLimits())
H100 = runtime.DeviceInfo(0, "NVIDIA H100", "nvidia-h100", "sm_90", DeviceLimits())


def pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def entry(bucket: int, threads: int = 128, us: float = 10.0) -> dict:
    """A contact entry as the tuner writes it, fresh against today's templates."""
    strategy, params = "thread_per_pair", {"threads": threads, "chunk": 8, "weights_smem": True, "symmetric": True}
    return {"key": make_key("float32", WIDTHS, bucket), "shape": {"B": 1, "N": bucket, **WIDTHS},
            "strategy": strategy, "params": params, "us": us, "baselines_us": {"eager": 10 * us},
            "template_sha256": codegen.template_hash("contact", strategy),
            "source_sha256": render("contact", strategy, params, WIDTHS).source_sha256}


# ---- the package list --------------------------------------------------------------------------

def test_pyproject_lists_every_package_and_template_folder():
    """pyproject.toml lists the packages by hand (the templates and tuned folders are mapped into
    the package): a package missing from the list would be missing from the wheel."""
    listed = set(pyproject()["tool"]["setuptools"]["packages"])
    python = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "pairgen").rglob("__init__.py")}
    templates = {"pairgen._templates"} | {
        "pairgen._templates." + ".".join(d.relative_to(ROOT / "templates").parts)
        for d in (ROOT / "templates").rglob("*") if d.is_dir() and d.name != "__pycache__"}
    expected = python | templates | {"pairgen._tuned"}
    assert listed == expected, (f"add to [tool.setuptools] packages in pyproject.toml: {sorted(expected - listed)}; "
                                f"remove: {sorted(listed - expected)}")
    scripts = pyproject()["project"]["scripts"]
    assert scripts == {"pairgen-tune": "pairgen.tuning.tune_cli:main", "pairgen-bench": "pairgen.tuning.bench_cli:main"}


# ---- where the folders are ---------------------------------------------------------------------

@pytest.fixture
def installed(tmp_path, monkeypatch):
    """pairgen.config as in an installed wheel: the package in a site-packages folder, with its
    _templates and _tuned; the user folder under a temporary XDG_DATA_HOME."""
    site = tmp_path / "venv" / "lib" / "python3.11" / "site-packages"
    package = site / "pairgen"
    (package / "_tuned").mkdir(parents=True)
    (package / "_templates").mkdir()
    monkeypatch.setattr(config, "PACKAGE_DIR", package)
    monkeypatch.setattr(config, "REPO_ROOT", site)
    monkeypatch.delenv("PAIRGEN_TUNED_DIR", raising=False)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    return package


def test_a_checkout_uses_its_top_level_folders(monkeypatch):
    monkeypatch.delenv("PAIRGEN_TUNED_DIR", raising=False)
    assert config.in_checkout()
    assert config.templates_dir() == codegen.TEMPLATES_DIR == ROOT / "templates"
    if os.access(ROOT / "tuned", os.W_OK):
        assert config.tuned_write_dir() == ROOT / "tuned"
        assert config.tuned_read_dirs() == [ROOT / "tuned"]


def test_a_read_only_checkout_writes_the_user_folder(tmp_path, monkeypatch):
    repo = tmp_path / "repo"
    for folder in ("pairgen", "templates", "tuned"):
        (repo / folder).mkdir(parents=True)
    (repo / "pyproject.toml").write_text("")
    monkeypatch.setattr(config, "PACKAGE_DIR", repo / "pairgen")
    monkeypatch.setattr(config, "REPO_ROOT", repo)
    monkeypatch.delenv("PAIRGEN_TUNED_DIR", raising=False)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    assert config.in_checkout() and config.tuned_write_dir() == repo / "tuned"
    monkeypatch.setattr(config.os, "access", lambda path, mode: Path(path) != repo / "tuned")
    user = tmp_path / "xdg" / "pairgen" / "tuned"
    assert config.tuned_write_dir() == user and config.tuned_read_dirs() == [user, repo / "tuned"]


def test_a_wheel_reads_the_user_folder_then_the_shipped_results(installed, tmp_path, monkeypatch):
    user = tmp_path / "xdg" / "pairgen" / "tuned"
    assert not config.in_checkout()
    assert config.templates_dir() == installed / "_templates"
    assert config.tuned_write_dir() == user
    assert config.tuned_read_dirs() == [user, installed / "_tuned"]
    assert TunedDB("contact", "some-gpu").path == user / "some-gpu" / "contact.json"  # tuning writes here
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for xdg in ("", "relative/path"):  # unset, or relative (which the XDG specification says to ignore)
        monkeypatch.setenv("XDG_DATA_HOME", xdg)
        assert config.user_tuned_dir() == tmp_path / "home" / ".local" / "share" / "pairgen" / "tuned"


def test_PAIRGEN_TUNED_DIR_is_the_only_folder(installed, tmp_path, monkeypatch):
    monkeypatch.setenv("PAIRGEN_TUNED_DIR", str(tmp_path / "mine"))
    assert config.tuned_read_dirs() == [tmp_path / "mine"] and config.tuned_write_dir() == tmp_path / "mine"


def test_lookups_read_the_user_folder_before_the_shipped_results(installed, tmp_path):
    """The user's entry for an N bucket hides the shipped one; the shipped entries for other
    buckets still apply (an exact shipped bucket beats the user's nearest one); the same holds for
    a GPU that uses another GPU's entries of its architecture."""
    user = tmp_path / "xdg" / "pairgen" / "tuned"
    shipped = installed / "_tuned"
    TunedDB("contact", "nvidia-h200", shipped).upsert(entry(64, threads=128), arch="sm_90")
    TunedDB("contact", "nvidia-h200", shipped).upsert(entry(256, threads=256), arch="sm_90")
    TunedDB("contact", "nvidia-h200", user).upsert(entry(64, threads=64, us=8.0), arch="sm_90")
    for info, how in ((H200, ""), (H100, " on nvidia-h200 (same architecture, sm_90)")):
        mine = runtime.choose(CONTACT, "float32", WIDTHS, 64, info)
        assert (mine.source, mine.plan.params["threads"], mine.entry["us"]) == ("tuned" + how, 64, 8.0)
        assert mine.database == str(user / "nvidia-h200" / "contact.json")
        theirs = runtime.choose(CONTACT, "float32", WIDTHS, 256, info)
        assert (theirs.source, theirs.plan.params["threads"]) == ("tuned" + how, 256)
        assert theirs.database == str(shipped / "nvidia-h200" / "contact.json")
        nearest = runtime.choose(CONTACT, "float32", WIDTHS, 1024, info)
        assert nearest.source == "tuned (nearest N bucket 256)" + how


def test_status_and_explain_follow_the_folders(installed, tmp_path, capsys):
    user = tmp_path / "xdg" / "pairgen" / "tuned"
    shipped = installed / "_tuned"
    TunedDB("contact", "nvidia-h200", shipped).upsert(entry(64), arch="sm_90")
    TunedDB("contact", "nvidia-h200", user).upsert(entry(64, threads=64), arch="sm_90")
    assert tune_cli.main(["--status", "--gpu", "nvidia-h100", "--arch", "sm_90"]) == 0
    out = capsys.readouterr().out
    assert out.index(f"## {user} (the user's, written by tuning)") < out.index(f"## {shipped} (shipped with pairgen)")
    assert f"ok; hidden by the entry in {user}" in out
    assert "contact: no entries of its own; entries tuned on nvidia-h200 (same architecture, sm_90) apply" in out
    assert "readout: no entries for this GPU or its architecture; else the op's default parameters" in out
    assert tune_cli.main(["--explain", "--op", "contact", "--shape", "B=1,N=70,P=64,H=32",
                          "--gpu", "nvidia-h100", "--arch", "sm_90"]) == 0
    out = capsys.readouterr().out
    assert "thread_per_pair(chunk=8, symmetric=True, threads=64, weights_smem=True) from tuned on nvidia-h200 " \
           "(same architecture, sm_90), measured 10.0 us when tuned" in out
    assert str(user / "nvidia-h200" / "contact.json") in out


# ---- the wheel, installed in a fresh environment ---------------------------------------------------

def _build_isolation_needed() -> bool:
    """True unless this environment can build the wheel itself (setuptools with bdist_wheel)."""
    try:
        version = tuple(int(part) for part in metadata.version("setuptools").split(".")[:2])
    except (metadata.PackageNotFoundError, ValueError):
        return True
    if version >= (70, 1):
        return False
    try:
        metadata.version("wheel")
    except metadata.PackageNotFoundError:
        return True
    return version < (68, 0)


def _run(args, **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run(args, capture_output=True, text=True, timeout=600, **kwargs)
    assert result.returncode == 0, f"{args}: exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    return result


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """What the build reads (pyproject.toml, the readme, the package and the folders mapped into
    it), copied: a build in the checkout would leave build/ behind, and setuptools puts whatever a
    stale build/ holds into the next wheel. The copy's tuned/ gets one more GPU, whose entry is
    fresh against today's templates, for the installed --explain."""
    project = pyproject()
    src = tmp_path_factory.mktemp("source")
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.lock", "*.tmp", "*.corrupt-*")
    for name in ["pyproject.toml", project["project"]["readme"], "pairgen",
                 *project["tool"]["setuptools"]["package-dir"].values()]:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=ignore)
        else:
            shutil.copy2(ROOT / name, src / name)
    TunedDB("contact", "ci-gpu", src / "tuned").upsert(entry(64), arch="sm_90")
    return src


@pytest.fixture(scope="module")
def wheel(source, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    isolation = [] if _build_isolation_needed() else ["--no-build-isolation"]
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-cache-dir", "-q", *isolation, "-w", str(out),
          str(source)])
    (built,) = out.glob("pairgen-*.whl")
    return built


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory) -> Path:
    """A fresh venv holding only the wheel; it reuses this environment's packages (torch, NVRTC, ...)
    as a --system-site-packages venv reuses the system's: a .pth adds this environment's
    site-packages to sys.path and its prefix to site.PREFIXES (where cuda.pathfinder looks for
    the NVRTC wheel's library). pip installs into it with --python (pip 22.3+)."""
    venv = tmp_path_factory.mktemp("venv") / "fresh"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    python = venv / "bin" / "python"
    purelib = _run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip()
    ours = dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib"))
    lines = [*ours, f"import site; site.PREFIXES.append({sys.prefix!r})"]
    (Path(purelib) / "_pairgen_test_deps.pth").write_text("\n".join(lines) + "\n")
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index",
          "--no-cache-dir", "-q", str(wheel)])
    return venv


def test_the_wheel_holds_the_templates_the_tuned_results_and_the_commands(wheel, source):
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {f"pairgen/_templates/{p.relative_to(source / 'templates').as_posix()}"
                for p in (source / "templates").rglob("*") if p.is_file()}
    expected |= {f"pairgen/_tuned/{p.relative_to(source / 'tuned').as_posix()}"
                 for p in (source / "tuned").glob("*/*.json")}
    expected |= {p.relative_to(source).as_posix() for p in (source / "pairgen").rglob("*.py")}
    assert "pairgen/_tuned/nvidia-h200/contact.json" in expected and "pairgen/_templates/common/pairgen.cuh" in expected
    assert not expected - names, f"missing from the wheel: {sorted(expected - names)}"
    assert not [n for n in names if n.startswith(("templates/", "tuned/"))], "top-level folders in site-packages"
    (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "pairgen-tune = pairgen.tuning.tune_cli:main" in text and "pairgen-bench = pairgen.tuning.bench_cli:main" in text


def test_the_installed_commands_run_outside_the_checkout(venv, tmp_path):
    """From a folder outside the checkout: the installed package's templates compile (--dry-run),
    --status lists the user folder and the shipped results, --explain finds the shipped entry, and
    nothing comes from the checkout."""
    work = tmp_path / "elsewhere"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PAIRGEN_TUNED_DIR", "PYTHONPATH")}
    env.update(XDG_DATA_HOME=str(tmp_path / "xdg"), PAIRGEN_ARCH="sm_90")
    bin_dir = venv / "bin"

    def run(*args) -> str:
        out = _run([str(bin_dir / args[0]), *args[1:]], cwd=work, env=env).stdout
        assert str(ROOT) not in out, f"the installed {args[0]} used the checkout:\n{out}"
        return out

    where = json.loads(run("python", "-c", "import json, pairgen; from pairgen import codegen, config; print(json.dumps("
                           "[pairgen.__file__, str(codegen.TEMPLATES_DIR), [str(d) for d in config.tuned_read_dirs()], "
                           "str(config.tuned_write_dir())]))"))
    package = Path(where[0]).parent
    user = tmp_path / "xdg" / "pairgen" / "tuned"
    assert package.is_relative_to(venv) and "site-packages" in package.parts
    assert where[1:] == [str(package / "_templates"), [str(user), str(package / "_tuned")], str(user)]

    out = run("pairgen-tune", "--dry-run", "--op", "contact", "--preset", "seed")
    assert "rendered and compiled for sm_90" in out and "FAILED" not in out
    out = run("pairgen-tune", "--status")
    assert f"## {user} (the user's, written by tuning)" in out and f"## {package / '_tuned'} (shipped with pairgen)" in out
    assert "| nvidia-h200 | contact |" in out and "| ci-gpu | contact | B1 N64 P64 H32 | float32 | thread_per_pair |" in out
    out = run("pairgen-tune", "--explain", "--op", "contact", "--shape", "B=2,N=60,P=64,H=32",
              "--gpu", "ci-gpu-nvl", "--arch", "sm_90")
    assert "from tuned on ci-gpu (same architecture, sm_90), measured 10.0 us when tuned" in out
    assert str(package / "_tuned" / "ci-gpu" / "contact.json") in out
    out = run("pairgen-bench", "--dry-run", "--op", "contact", "--preset", "seed")
    assert "would measure contact" in out
    assert not user.exists(), "nothing here writes the user folder"

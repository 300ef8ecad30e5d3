"""pairgen-tune --status lists the malformed entries of the tuned files (the file, the entry's index
and why), next to the stale ones: lookups skip them, and a warning on stderr was all that said so."""
from __future__ import annotations

import json

import pytest

from pairgen import codegen
from pairgen.ops import get_op, render
from pairgen.tuned import make_key
from pairgen.tuning import tune_cli


@pytest.mark.filterwarnings("ignore::pairgen.tuned.TunedDBWarning")  # its stderr line, as before
def test_status_lists_a_malformed_entry_with_its_file_index_and_reason(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PAIRGEN_TUNED_DIR", str(tmp_path))
    widths = {"P": 64, "H": 32}
    strategy, params = get_op("contact").default_points[0]
    good = {"key": make_key("float32", widths, 64), "shape": {"B": 4, "N": 64, **widths}, "strategy": strategy,
            "params": dict(params), "us": 5.0, "template_sha256": codegen.template_hash("contact", strategy),
            "source_sha256": render("contact", strategy, params, widths).source_sha256}
    bad = dict(good, key={"dtype": "float32", "widths": widths, "n_bucket": 48})  # not a power of two
    path = tmp_path / "some-gpu" / "contact.json"
    path.parent.mkdir()
    path.write_text(json.dumps({"schema": 1, "op": "contact", "gpu": "some-gpu", "entries": [good, bad]}))
    assert tune_cli.main(["--status"]) == 0
    out = capsys.readouterr().out
    (row,) = [line for line in out.splitlines() if "MALFORMED" in line]
    assert "| some-gpu | contact | entry 1 |" in row and str(path) in row
    assert "key.n_bucket" in row and "48" in row and "power of two" in row
    assert any("B4 N64" in line and "| ok |" in line for line in out.splitlines())
    assert "1 malformed entry" in out


def test_status_says_what_a_module_runs_where_the_entrys_kernel_was_timed_slower(tmp_path, monkeypatch, capsys):
    """An entry whose kernel lost to what a module runs without it (the closed form, else the
    PyTorch reference, in the tuner's same run) is kept, and --status says what runs instead."""
    monkeypatch.setenv("PAIRGEN_TUNED_DIR", str(tmp_path))
    widths = {"P": 64, "H": 32}
    strategy, params = get_op("contact").default_points[0]
    entries = [{"key": make_key("float32", widths, n), "shape": {"B": 4, "N": n, **widths}, "strategy": strategy,
                "params": dict(params), "us": 5.0, "baselines_us": baselines,
                "template_sha256": codegen.template_hash("contact", strategy),
                "source_sha256": render("contact", strategy, params, widths).source_sha256}
               for n, baselines in [(64, {"eager": 4.0}), (128, {"eager": 9.0})]]
    path = tmp_path / "some-gpu" / "contact.json"
    path.parent.mkdir()
    path.write_text(json.dumps({"schema": 1, "op": "contact", "gpu": "some-gpu", "entries": entries}))
    assert tune_cli.main(["--status"]) == 0
    rows = capsys.readouterr().out.splitlines()
    assert any("B4 N64 " in row and "| ok; a module runs the PyTorch reference (4.0 µs) |" in row for row in rows)
    assert any("B4 N128 " in row and "| ok |" in row for row in rows)

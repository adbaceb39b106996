"""bench/tables.py: the generated tables of the README and docs equal what their committed result
files give (a doc cannot drift from its numbers), and the paired intervals are the t intervals."""
import importlib.util
import json
import lzma
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]


def _tables():
    spec = importlib.util.spec_from_file_location("tables", ROOT / "bench" / "tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_generated_table_matches_its_result_files(capsys):
    assert _tables().main(["--check"]) == 0, capsys.readouterr().out


def test_a_case_renders_paired_differences_and_a_stale_doc_is_caught(tmp_path, monkeypatch):
    tables = _tables()
    monkeypatch.setattr(tables, "RESULTS", tmp_path / "results")
    scores = {"fedamole": [10.0, 12.0, 14.0], "fedmole": [11.0, 12.5, 16.0]}
    for m, xs in scores.items():
        for seed, x in zip((1, 2, 3), xs):
            d = tmp_path / "results" / "c" / f"seed{seed}" / m
            d.mkdir(parents=True)
            (d / "results.json").write_text(json.dumps({"method": m, "mean": x}))
            with lzma.open(d / "server.jsonl.xz", "wt") as fh:
                fh.write("")
    (tmp_path / "results" / "c" / "case.json").write_text(json.dumps(
        {"kind": "ablation", "command": "cmd", "machine": "m", "date": "d", "order": ["fedamole", "fedmole"]}))
    out = tables.table("c")
    # differences 1, 0.5, 2: mean 1.1667, sd 0.7638, half-width 4.303 * 0.7638 / sqrt(3) = 1.8975
    assert "| fedmole | 13.17 (2.09) | 11.00 / 12.50 / 16.00 | +1.17 [-0.73, +3.06] | - |" in out
    assert tables.paired_interval([1, 0.5, 2]) == pytest.approx((7 / 6, 4.303 * 0.763763 / 3 ** 0.5), rel=1e-4)
    doc = tmp_path / "doc.md"
    doc.write_text("x\n<!-- table: c -->\nold\n<!-- end table -->\n")
    monkeypatch.setattr(tables, "DOCS", [doc])
    monkeypatch.setattr(tables, "ROOT", tmp_path)
    assert tables.main(["--check"]) == 1
    assert tables.main([]) == 0 and tables.main(["--check"]) == 0 and "+1.17 [-0.73, +3.06]" in doc.read_text()

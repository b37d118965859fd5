"""benchmarks/real_model.py's tables, rendered from the committed run's JSON."""
from __future__ import annotations

import json
from pathlib import Path

from benchmarks.real_model import render_tables, write_table

ROOT = Path(__file__).resolve().parents[2]


def test_the_committed_tables_are_the_committed_json_rendered(tmp_path):
    committed = ROOT / "docs" / "results" / "real_model.json"
    result = json.loads(committed.read_text())
    assert (ROOT / "docs" / "results" / "real_model.md").read_text() == render_tables(result)
    copy = tmp_path / "real_model.json"
    copy.write_text(committed.read_text())
    write_table(copy)
    table = (tmp_path / "real_model.md").read_text()
    ours = result["throughput"]["1"]["ours"]["decode_tok_s"]
    assert f"| 1 | {result['throughput']['1']['hf']['decode_tok_s']:.1f} | {ours:.1f} |" in table
    assert "| sft | 0.52 | 0.78 |" in table and not list(tmp_path.glob("*.tmp"))

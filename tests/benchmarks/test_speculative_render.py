"""benchmarks/speculative.py's result table, rendered from its JSON."""
from __future__ import annotations

import json

from benchmarks.speculative import VARIANTS, render, write_results


def row(temperature: float, batch: int) -> dict:
    out = {"temperature": temperature, "batch": batch, "plain_tok_s": 100.0}
    for i, v in enumerate(VARIANTS):
        out.update({f"{v}_tok_s": 150.0 + i, f"{v}_accept": 3.5, f"{v}_round_ms": 6.25, f"{v}_speedup": 1.5 + i / 100})
        if temperature == 0:
            out[f"{v}_equal_to_plain"] = v != "external"
    return out


def test_the_table_is_rendered_from_the_json(tmp_path):
    args = {"layers": 12, "target": "upscaled", "seed_steps": 300, "seed_lr": 3e-4, "prompts": 16,
            "max_new_tokens": 96, "threads": 1, "repeats": 3, "fixed_k": 6}
    evals = {"before": {"n": 100, "accuracy": 0.42, "seed/mean_accepted": 1.14},
             "after": {"n": 100, "accuracy": 0.76, "seed/mean_accepted": 3.6}}
    first = dict(row(0.0, 1), hf_plain_tok_s=50.0, hf_assist_tok_s=60.0, hf_assist_speedup_vs_hf=1.2)
    report = {"model": "m", "evals": evals, "args": args, "rows": [first, row(1.0, 8)]}
    write_results(report, str(tmp_path))
    assert json.loads((tmp_path / "speculative.json").read_text()) == report
    table = (tmp_path / "speculative.md").read_text()
    assert table == render(report)
    lines = table.splitlines()
    assert lines[-1] == ("HF `generate` at batch 1, the same prompts: T 0: plain 50.0 tok/s, with the external "
                         "drafter as assistant 60.0 (1.20x).")
    lines = lines[:-2]
    assert "0.420 -> 0.760" in table and "1.14 -> 3.60" in table
    assert lines[-2] == ("| 0 | 1 | 100.0 | 150.0 | 3.50 | 6.25 | 1.50x | 151.0 | 3.50 | 6.25 | 1.51x | "
                         "152.0 | 3.50 | 6.25 | 1.52x | False |")
    assert lines[-1].startswith("| 1 | 8 | 100.0 |") and lines[-1].endswith("| 1.52x |  |")
    assert not list(tmp_path.glob("*.tmp"))

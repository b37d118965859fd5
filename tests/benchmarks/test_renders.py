"""The result tables of benchmarks/generate.py, skipper.py and attuner.py, rendered from their JSON:
hand-made reports in, the exact lines out."""
from __future__ import annotations

from benchmarks import attuner, generate, skipper

META = {"date": "2026-12-06", "command": "python benchmarks/x.py", "cores": 2, "cpu": "AVX512", "machine": "x86_64",
        "torch": "2.13.0+cpu", "commit": "abc1234"}


def test_generate_table():
    case = {"hf_tok_s": 100.0, "ours_tok_s": 250.0, "ours_hf_path_tok_s": 150.0, "speedup": 2.5, "speedup_hf_path": 1.5,
            "identical": True, "min_len": 3, "max_len": 128}
    report = {"model": "tiny-qwen3", "params_m": 1.06, "lean": True, "compile": False, "new_tokens": 128, "threads": 1,
              "repeats": 5, "meta": META, "batch1": case, "batch32": dict(case, identical=False)}
    lines = generate.render(report).splitlines()
    assert lines[2].startswith("*Measured 2026-12-06 on 2 x86_64 cores (AVX512)")
    assert lines[-2] == "| batch 1 | 100 | 250 | 150 | 2.50x | 1.50x | True | 3..128 |"
    assert lines[-1] == "| batch 32, variable lengths | 100 | 250 | 150 | 2.50x | 1.50x | False | 3..128 |"


def test_skipper_tables():
    args = {"layers": 12, "steps": 300, "lr": 2e-3, "extra": [], "new_tokens": 40, "repeats": 3, "eval_examples": 100,
            "batches": [1, 8], "fractions": [0.5, 1.0]}
    entry = {"accuracy": 0.44, "n": 100, "skip_ratio": 0.55, "layer_skip_ratio": 0.275, "per_layer": {"6": 0.9},
             "wide_agreement": 1.0,
             "tokens_per_s": {"1": {"dense": 20.0, "naive": 18.0, "routed": 25.0, "auto": 24.0},
                              "8": {"dense": 80.0, "naive": 80.0, "routed": 88.0, "auto": 84.0}},
             "decode": {"1": {"skip_ratio": 0.5, "auto_executed": {"branch": 240}},
                        "8": {"skip_ratio": 0.25, "auto_executed": {"routed": 3, "uniform": 5}}}}
    synthetic = {"1": {"speedup": {"masked@0.5": 0.9, "routed@0.5": 1.3, "auto@0.5": 1.2, "masked@1.0": 0.8,
                                   "routed@1.0": 1.6, "auto@1.0": 1.5}, "break_even_f": 0.22}}
    report = {"base_accuracy": 0.455, "widen": 4, "args": args, "meta": META, "targets": {"0.5": entry},
              "synthetic": synthetic}
    text = skipper.render(report)
    assert "at lr 0.002 (`otherwise defaults`)" in text and "Base held-out accuracy 0.455" in text
    assert "Held-out accuracy 0.440 (n=100) against the base's 0.455; skipped 55.0% of routed layer-tokens (27.5% of all)" in text
    assert "| batch 1 | 20.0 | 18.0 (x0.90) | 25.0 (x1.25) | 24.0 (x1.20) | 50.0% | branch 240 |" in text
    assert "| batch 8 | 80.0 | 80.0 (x1.00) | 88.0 (x1.10) | 84.0 (x1.05) | 25.0% | routed 3, uniform 5 |" in text
    assert text.splitlines()[-1] == "| 1 | x1.30 | x1.60 | x0.90 | x0.80 | 0.22 |"


def test_attuner_tables():
    cells = ["select/test", "select/test_ood"]
    res = {"name": "tiny", "config": [], "extra": [], "meta": META, "steps": 200, "seeds": 2, "n_per_cell": 100,
           "table": {"full": {"select/test": 0.95, "select/test_ood": 0.93},
                     "pic": {"select/test": 0.85, "select/test_ood": 0.93},
                     "attuner": {"select/test": 0.9, "select/test_ood": 0.92},
                     "attuner_std": {"select/test": 0.01, "select/test_ood": 0.0}},
           "gap_recovered": {"select/test": 0.5, "select/test_ood": None},
           "distribution_gap": {"pic": {c: [0.2, 0.75] for c in cells},
                                "attuner_s0": {c: [0.05, 0.9] for c in cells}},
           "kl_gap_closed": {"select/test": 0.75, "select/test_ood": None}}
    lines = attuner.render_accuracy(res).splitlines()
    assert "| mode | select | select, held-out |" in lines
    assert "| pic | 0.85 | 0.93 |" in lines
    assert "| attuner (2 seeds, mean ± std) | 0.90 ± 0.01 | 0.92 ± 0.00 |" in lines
    assert "| share of the full-vs-PIC accuracy gap recovered (gap ≥ 0.05 only) | 0.50 | — |" in lines
    assert "| attuner_s0 | 5.0e-02 (0.900) | 5.0e-02 (0.900) |" in lines
    assert lines[-1] == "| share of PIC's KL removed (KL ≥ 0.001 only) | 0.75 | — |"
    shape = {"shape": "tiny", "params_m": 1.06, "encode_all_ms": 20.0, "probe_kl": 1.6e-7,
             "by_count": {"8": {"context_tokens": 512, "ms": dict(zip(attuner.TTFT_MODES, (24.0, 2.0, 1.5, 8.0, 12.0))),
                                "speedup_vs_full": dict(zip(attuner.TTFT_MODES, (1.0, 12.0, 16.0, 3.0, 2.0)))}}}
    ttft = {"meta": META, "threads": 1, "repeats": 7, "artifact_tokens": 64, "query_tokens": 16, "shapes": [shape]}
    assert attuner.render_ttft(ttft).splitlines()[-1] == (
        "| 8 | 512 | 24.00 | 2.00 | 1.50 | 8.00 | 12.00 | 12.00x | 16.00x | 3.00x | 2.00x |")


def renderers():
    """{result file stem (or stem prefix ending in '-'): the render that turns its JSON into its .md}."""
    from benchmarks import (compose, distill_memory, grpo_skip, grpo_update, lowbit_matmul, mass_teachers, qad,
                            real_model, selfdistill_tokens, serve_load, speculative)

    return {"compose": compose.render, "distill_memory": distill_memory.render, "grpo_skip-": grpo_skip.render,
            "grpo_update": grpo_update.render, "lowbit_matmul": lowbit_matmul.render, "mass_teachers": mass_teachers.render,
            "qad": qad.render, "real_model": real_model.render_tables, "selfdistill_tokens-": selfdistill_tokens.render,
            "serve_load": serve_load.render,
            "speculative": speculative.render, "generate": generate.render, "skipper": skipper.render, "skipper-": skipper.render,
            "attuner_ttft": attuner.render_ttft, "attuner_accuracy-": attuner.render_accuracy}


def test_committed_result_tables_are_their_json_rendered():
    """No committed table of these benchmarks was typed or edited by hand: each .md is its .json rendered."""
    import json
    from pathlib import Path

    results = Path(__file__).resolve().parents[2] / "docs" / "results"
    checked = []
    for stem, render in renderers().items():
        paths = sorted(results.glob(stem + "*.json")) if stem.endswith("-") else [results / (stem + ".json")]
        for path in [p for p in paths if p.exists()]:
            md = path.with_suffix(".md")
            assert md.exists(), f"{path.name} has no rendered {md.name}"
            rendered = render(json.loads(path.read_text()))
            assert md.read_text().rstrip("\n") == rendered.rstrip("\n"), f"{md.name} is not {path.name} rendered"
            checked.append(path.name)
    assert len(checked) >= 10, checked  # the committed ones at least


def test_attuner_recovers_only_gaps_beyond_noise():
    import pytest

    table = {"full": {"a": 0.95, "b": 0.14}, "pic": {"a": 0.85, "b": 0.11}, "attuner": {"a": 0.90, "b": 0.13}}
    rec = attuner.gap_recovered(table)
    assert rec["a"] == pytest.approx(0.5) and rec["b"] is None  # b: a 0.03 gap is noise at n=100


def test_per_run_files_of_other_settings_are_kept_apart():
    from argparse import Namespace

    base = dict(config=[], extra=[], steps=200, eval_examples=100)
    assert attuner.results_name(Namespace(**base)) == "tiny"
    other = {attuner.results_name(Namespace(**{**base, **change}))
             for change in ({"eval_examples": 2}, {"steps": 3}, {"extra": ["trainer.lr=1e-3"]})}
    assert len(other) == 3 and all(n.startswith("cfg-") for n in other)
    defaults = dict(eval_examples=100, new_tokens=40, repeats=3, batches=[1, 8, 32], fractions=[0.25, 0.5, 0.75, 1.0])
    assert skipper.measure_tag(Namespace(**defaults)) == ""
    assert skipper.measure_tag(Namespace(**{**defaults, "batches": [1, 2]})).startswith("-m")

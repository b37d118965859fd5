"""benchmarks/qad.py at toy size: one result file per finished run, a rerun that skips them, and the
tables rendered from the JSON."""
from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.slow

ARGS = ["--formats", "W8A8", "--seeds", "0", "--steps", "2", "--batch-size", "4", "--eval-n", "4",
        "--max-new-tokens", "8", "--no-fp-sft", "--wide-hidden", "64", "--wide-layers", "1", "--prefill-len", "32",
        "--decode-tokens", "4", "--repeats", "1"]


def test_runs_are_kept_and_a_rerun_skips_them(tmp_path, capsys, monkeypatch):
    from benchmarks import qad

    results = tmp_path / "results" / "qad"
    assert qad.main([*ARGS, "--results", str(results)]) == 0
    first = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    [acc_dir] = results.glob("accuracy-*")
    [speed_dir] = results.glob("speed-*")
    names = sorted(p.name for p in acc_dir.glob("*.json"))
    assert names == sorted(["fp.json", "W8A8-ptq-s0.json", "W8A8-qat-s0.json", "W8A8-qad-s0.json",
                            "W8A8-theseus-s0.json", "W8A8-theseus_qat-s0.json"])
    assert [p.name for p in speed_dir.glob("*.json")] == ["W8A8.json"]
    assert first["accuracy"]["formats"]["W8A8"]["QAD"]["acc"] == [json.loads((acc_dir / "W8A8-qad-s0.json").read_text())["acc"]]
    table = (tmp_path / "results" / "qad.md").read_text()
    assert table == qad.render(json.loads((tmp_path / "results" / "qad.json").read_text()))
    assert "| W8A8 |" in table and not list(tmp_path.rglob("*.tmp"))

    def no_training(*args, **kwargs):
        raise AssertionError("a finished run was trained again")

    monkeypatch.setattr(qad, "train_and_export", no_training)
    monkeypatch.setattr("models.quant_export.export_compressed", no_training)
    assert qad.main([*ARGS, "--results", str(results)]) == 0
    again = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert again["accuracy"] == first["accuracy"] and again["speed"] == first["speed"]
    # every reused run keeps the provenance it was measured with (command, date, commit), not the rerun's
    assert again["runs"] == first["runs"] and set(first["runs"]) == {n.removesuffix(".json") for n in names} | {"W8A8"}
    assert all(meta["command"] for meta in first["runs"].values())

"""benchmarks/results_io.py: result files written aside, per-run results kept and reused, provenance."""
from __future__ import annotations

import json
import sys

import pytest

from benchmarks.results_io import kept_runs_lines, provenance, provenance_line, remembered, write_files


def test_write_files_leaves_whole_files_and_no_temporaries(tmp_path):
    write_files(tmp_path / "out", {"a.json": "{}", "a.md": "# a\n"})
    assert (tmp_path / "out" / "a.json").read_text() == "{}"
    assert (tmp_path / "out" / "a.md").read_text() == "# a\n"
    write_files(tmp_path / "out", {"a.md": "# b\n"})
    assert (tmp_path / "out" / "a.md").read_text() == "# b\n"
    assert not list((tmp_path / "out").glob("*.tmp"))


def test_remembered_runs_once_then_reads_the_file(tmp_path):
    calls = []

    def run():
        calls.append(1)
        return {"accuracy": 0.5, "n": len(calls)}

    path = str(tmp_path / "runs" / "seed0.json")
    first: dict = {}
    assert remembered(path, run, first) == {"accuracy": 0.5, "n": 1}
    assert json.loads(open(path).read()) == {"accuracy": 0.5, "n": 1}
    assert first["seed0"]["command"] and "commit" in first["seed0"]
    stamped = dict(first["seed0"], commit="abc1234", date="2026-01-02")  # as if measured at another commit
    (tmp_path / "runs" / "seed0.json.meta").write_text(json.dumps(stamped))
    again: dict = {}
    assert remembered(path, run, again) == {"accuracy": 0.5, "n": 1}  # read back, not recomputed
    assert len(calls) == 1
    assert again == {"seed0": stamped}  # the reused run keeps its own provenance, not today's
    assert "- `abc1234` (2026-01-02): seed0" in kept_runs_lines(again)
    assert remembered(None, run) == {"accuracy": 0.5, "n": 2}  # None: computed each time, kept nowhere
    assert len(calls) == 2


def test_an_interrupted_run_keeps_nothing(tmp_path):
    path = tmp_path / "r.json"

    def boom():
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        remembered(str(path), boom)
    assert not path.exists() and not list(tmp_path.iterdir())


def test_provenance_names_the_command_date_and_machine(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["benchmarks/generate.py", "--repeats", "3"])
    meta = provenance()
    assert meta["command"] == "python benchmarks/generate.py --repeats 3"
    assert len(meta["date"]) == 10 and meta["date"][4] == "-"
    assert meta["cores"] >= 1 and meta["cpu"] and meta["torch"]
    line = provenance_line({**meta, "date": "2026-12-06", "cores": 2, "machine": "x86_64", "cpu": "AVX512",
                            "torch": "2.13.0+cpu", "commit": "abc1234"})
    assert line == ("*Measured 2026-12-06 on 2 x86_64 cores (AVX512), torch 2.13.0+cpu at commit abc1234: "
                    "`python benchmarks/generate.py --repeats 3`*")
    assert provenance_line(None) == ""

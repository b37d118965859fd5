"""benchmarks/compare.py: the paired difference of two sets of runs, from hand-made result files."""
from __future__ import annotations

import json
import random
import sys

import pytest

from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import compare as bench  # noqa: E402


def write(path, seed, bits, commit="abc1234"):
    path.write_text(json.dumps({"seed": seed, "outcomes": "".join(map(str, bits)), "final": sum(bits) / len(bits),
                                "meta": {"commit": commit}}))


def test_a_known_difference_is_measured_and_its_interval_covers_it(tmp_path):
    rng = random.Random(1)
    n = 400
    for seed in (0, 1, 2):
        b = [int(rng.random() < 0.6) for _ in range(n)]
        a = list(b)
        flipped = [i for i, x in enumerate(a) if x == 0][:40]  # A answers 40 more questions right: +0.100
        for i in flipped:
            a[i] = 1
        write(tmp_path / f"a-s{seed}.json", seed, a)
        write(tmp_path / f"b-s{seed}.json", seed, b, commit="def5678")
    write(tmp_path / "b-s3.json", 3, [0] * n)  # a seed A did not run: left out
    result = bench.compare(bench.side(str(tmp_path / "a-s*.json")), bench.side(str(tmp_path / "b-s*.json")))
    assert result["seeds"] == [0, 1, 2] and result["questions"] == n
    assert result["difference"] == pytest.approx(0.1)
    assert result["a_mean"] - result["b_mean"] == pytest.approx(0.1)
    lo, hi = result["interval"]
    assert lo < 0.1 < hi and lo > 0.0  # the known difference inside, and clearly above 0
    assert [f["commit"] for f in result["b"]] == ["def5678"] * 3


def test_no_difference_gives_an_interval_around_zero(tmp_path):
    rng = random.Random(2)
    for seed in (0, 1):
        write(tmp_path / f"a-s{seed}.json", seed, [int(rng.random() < 0.5) for _ in range(300)])
        write(tmp_path / f"b-s{seed}.json", seed, [int(rng.random() < 0.5) for _ in range(300)])
    result = bench.compare(bench.side(str(tmp_path / "a-*.json")), bench.side(str(tmp_path / "b-*.json")))
    lo, hi = result["interval"]
    assert lo < 0 < hi


def test_runs_that_cannot_pair_are_refused(tmp_path):
    write(tmp_path / "a-s0.json", 0, [1, 0, 1])
    write(tmp_path / "b-s0.json", 0, [1, 0])
    write(tmp_path / "c-s1.json", 1, [1, 0, 1])
    with pytest.raises(SystemExit, match="different numbers of questions"):
        bench.compare(bench.side(str(tmp_path / "a-*.json")), bench.side(str(tmp_path / "b-*.json")))
    with pytest.raises(SystemExit, match="no seed on both sides"):
        bench.compare(bench.side(str(tmp_path / "a-*.json")), bench.side(str(tmp_path / "c-*.json")))
    write(tmp_path / "a-s0-again.json", 0, [1, 1, 1])
    with pytest.raises(SystemExit, match="a second run of seed 0"):
        bench.side(str(tmp_path / "a-*.json"))
    with pytest.raises(SystemExit, match="no result files match"):
        bench.side(str(tmp_path / "none-*.json"))

"""Attuner as a user runs it: `torchrun --nproc_per_node=2 train.py +algo=attuner data=artifacts`, then
the export served over the position-independent cache by `python -m inference --adapter --artifacts`."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT, torchrun_train

pytestmark = pytest.mark.slow  # torchrun with 2 ranks, then the CLI

ATTUNER = ["data=artifacts", "trainer.max_steps=2", "trainer.batch_size=4", "trainer.micro_batch_size=2",
           "trainer.eval_every=2", "trainer.eval_examples=4", "trainer.eval_max_new_tokens=16"]


def test_torchrun_two_ranks_end_to_end_and_served_over_the_cache(tmp_path, subprocess_env):
    out = tmp_path / "run"
    records = torchrun_train(out, subprocess_env, *ATTUNER, algo="attuner")
    lines, stdout = records[:-1], records[-1]["text"]
    train = [x for x in lines if x["split"] == "train"]
    assert [x["step"] for x in train] == [1, 2]
    assert all(x["attuner/kl"] >= 0 and 0 <= x["attuner/student_top1_agree"] <= 1 for x in train)
    evals = [x for x in lines if x["split"] == "eval"]
    assert [x["step"] for x in evals] == [0, 2]
    assert all({"accuracy", "attuner/full_prefill_accuracy", "attuner/naive_pic_accuracy"} <= set(x) for x in evals)
    assert "full-prefill accuracy of the frozen base" in stdout
    final = out / "final"
    spec = json.loads((final / "attuner.json").read_text())
    assert spec["targets"] == ["q_proj"] and (final / "adapter_config.json").exists()
    # the export's base is the tiny model of the run; save it and serve the adapter over the cache
    base = tmp_path / "base"
    script = ("import sys; from tests.conftest import tiny_config; from trainer.setup import load_model; "
              "from trainer.distributed import World; "
              f"cfg = tiny_config({str(tmp_path / 'x')!r}, 'data=artifacts', algo='attuner'); "
              "m, t = load_model(cfg.model, World()); m.save_pretrained(sys.argv[1]); t.save_pretrained(sys.argv[1])")
    subprocess.run([sys.executable, "-c", script, str(base)], env=subprocess_env, cwd=ROOT, check=True, timeout=120)
    (tmp_path / "tables.jsonl").write_text('"[kiwo]\\nda=17\\nfo=83\\n"\n"[lema]\\nda=12\\nfo=40\\n"\n')
    proc = subprocess.run([sys.executable, "-m", "inference", str(base), "--adapter", str(final), "--artifacts",
                           str(tmp_path / "tables.jsonl"), "--prompt", "q: kiwo fo?\na: ", "--max-new-tokens", "8"],
                          env=subprocess_env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "[pic pic] 2 artifacts" in proc.stderr and f"adapter {final}" in proc.stderr

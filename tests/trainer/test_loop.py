"""The shared loop end to end on a tiny model: outputs, export, resume equivalence, atomic
checkpoints, non-finite loss, graceful stop, and the rollout-vs-trainer log-prob gap metric."""
from __future__ import annotations

import json
import os
import signal

import pytest
import torch

from tests.conftest import tiny_config
from trainer import checkpoint
from trainer.distributed import World
from trainer.loop import NonFiniteLossError, fit
from trainer.setup import build_session, export_final


def _run(cfg):
    session = build_session(cfg, World())
    status = fit(session)
    session.tracker.close()
    return session, status


def _records(out_dir, split="train"):
    with open(os.path.join(out_dir, "metrics.jsonl")) as fh:
        return [r for r in map(json.loads, fh) if r["split"] == split]


@pytest.mark.slow  # end-to-end train run: 1.5 s
def test_run_writes_config_metrics_checkpoint_and_final(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "run"
    cfg = tiny_config(out, "trainer.max_steps=3", "trainer.eval_every=3", "trainer.save_every=2")
    session, status = _run(cfg)
    final = export_final(session)
    assert status == "done"
    assert (out / "config.yaml").exists()
    train, evals = _records(out), _records(out, "eval")
    assert [r["step"] for r in train] == [1, 2, 3]
    assert all(r["loss"] > 0 and r["tokens_per_s"] > 0 for r in train)
    assert [r["step"] for r in evals] == [0, 3]  # before training, then at eval_every
    assert all(0.0 <= r["accuracy"] <= 1.0 and r["n"] == 8 for r in evals)
    assert [s for s, _ in checkpoint.complete_checkpoints(str(out))] == [2, 3]
    loaded = AutoModelForCausalLM.from_pretrained(final)
    tok = AutoTokenizer.from_pretrained(final)
    ids = torch.tensor([tok("q: 12+3?\na: ").input_ids])
    trained = session.backend.full_model().eval()
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, trained(ids).logits)


@pytest.mark.slow  # two end-to-end train runs: 4.9 s
def test_resume_matches_uninterrupted_run(tmp_path):
    straight = tmp_path / "straight"
    _run(tiny_config(straight, "trainer.max_steps=6", "trainer.resume=never"))
    split = tmp_path / "split"
    _run(tiny_config(split, "trainer.max_steps=6", "trainer.save_every=3"))
    # Simulate a stop after step 3: drop the later checkpoint and rerun with resume=auto.
    for step, path in checkpoint.complete_checkpoints(str(split)):
        if step > 3:
            import shutil

            shutil.rmtree(path)
    session, _ = _run(tiny_config(split, "trainer.max_steps=6", "trainer.save_every=3"))
    a, b = _records(straight), _records(split)
    assert [r["step"] for r in b] == [1, 2, 3, 4, 5, 6]
    for ra, rb in zip(a, b):
        assert abs(ra["loss"] - rb["loss"]) < 1e-6, (ra, rb)
        assert abs(ra["grad_norm"] - rb["grad_norm"]) < 1e-6


def test_crash_mid_save_leaves_no_checkpoint_resume_would_pick(tmp_path, monkeypatch):
    out = tmp_path / "run"
    session = build_session(tiny_config(out, "trainer.max_steps=2", "trainer.save_every=1"), World())
    fit(session)
    assert checkpoint.latest_checkpoint(str(out)).endswith("step_2")

    def crash(path):
        open(os.path.join(path, "model.pt"), "w").write("half")
        raise OSError("disk full")

    monkeypatch.setattr(session.backend, "save", crash)
    with pytest.raises(OSError):
        checkpoint.save_checkpoint(str(out), 3, session.backend, World(), {"step": 3}, keep_last=5)
    assert checkpoint.latest_checkpoint(str(out)).endswith("step_2")
    assert not (out / "checkpoints" / "step_3").exists()


def test_keep_last_prunes_old_checkpoints(tmp_path):
    out = tmp_path / "run"
    _run(tiny_config(out, "trainer.max_steps=4", "trainer.save_every=1", "trainer.keep_last=2"))
    assert [s for s, _ in checkpoint.complete_checkpoints(str(out))] == [3, 4]
    assert sorted(os.listdir(out / "checkpoints")) == ["step_3", "step_4"]


def test_nonfinite_loss_stops_with_step_and_keeps_last_checkpoint(tmp_path):
    out = tmp_path / "run"
    session = build_session(tiny_config(out, "trainer.max_steps=4", "trainer.save_every=1"), World())
    real_loss = session.algo.loss

    def poisoned(model, micro, normaliser):
        result = real_loss(model, micro, normaliser)
        if session.step == 3:
            result.loss = result.loss * float("nan")
        return result

    session.algo.loss = poisoned
    with pytest.raises(NonFiniteLossError, match="step 3, micro-batch 0 \\(examples arith-train"):
        fit(session)
    assert checkpoint.latest_checkpoint(str(out)).endswith("step_2")


def test_sigterm_checkpoints_and_stops(tmp_path):
    out = tmp_path / "run"
    before = signal.getsignal(signal.SIGTERM)
    session = build_session(tiny_config(out, "trainer.max_steps=10"), World())
    real = session.algo.make_batch

    def make_batch(examples, ctx):
        if session.step == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return real(examples, ctx)

    session.algo.make_batch = make_batch
    assert fit(session) == "stopped"
    assert checkpoint.latest_checkpoint(str(out)).endswith("step_2")
    assert session.step == 2
    assert signal.getsignal(signal.SIGTERM) is before  # handlers restored after the loop


class _SampleAndImitate:
    """A minimal on-policy algorithm for the gap metric: sample with the engine, then NLL on the samples."""

    name = "sample"

    def __init__(self, temperature):
        from algorithms.sft import SFT, SFTConfig

        self.temperature = temperature
        self.sft = SFT(SFTConfig())

    def __getattr__(self, item):
        return getattr(self.sft, item)

    def make_batch(self, examples, ctx):
        from algorithms.base import Batch, pad_right
        from inference import SamplingParams

        tok = ctx.tokenizer
        prompts = [tok(ctx.task.prompt(ex), add_special_tokens=False).input_ids for ex in examples]
        params = SamplingParams(max_new_tokens=12, temperature=self.temperature, stop_token_ids=(tok.eos_token_id,))
        outs = ctx.engine.generate(prompts, params, ctx.generator)
        ids, attn = pad_right([p + o.tokens for p, o in zip(prompts, outs)], tok.pad_token_id, ctx.device)
        mask, rollout = torch.zeros_like(ids), torch.zeros(ids.shape)
        for i, (p, o) in enumerate(zip(prompts, outs)):
            mask[i, len(p) : len(p) + len(o.tokens)] = 1
            rollout[i, len(p) : len(p) + len(o.tokens)] = torch.tensor(o.logprobs)
        return Batch(ids, attn, mask, rollout_logprobs=rollout, uids=[e.uid for e in examples])

    def loss(self, model, micro, normaliser):
        from algorithms import losses
        from algorithms.base import StepOutput

        logits = model(input_ids=micro.input_ids, attention_mask=micro.attention_mask).logits
        logp = losses.token_logprobs(logits, micro.input_ids, self.temperature)
        loss, metrics = losses.nll_loss(logp, micro.loss_mask, normaliser)
        return StepOutput(loss, metrics, token_logprobs=logp)


def test_rollout_logprob_gap_is_logged_and_small(tmp_path):
    out = tmp_path / "run"
    session = build_session(tiny_config(out, "trainer.max_steps=2"), World())
    session.algo = _SampleAndImitate(temperature=0.7)
    fit(session)
    gaps = [r["rollout/logprob_gap"] for r in _records(out)]
    assert len(gaps) == 2 and all(0 <= g < 1e-4 for g in gaps), gaps
    # The metric is live: trainer log-probs at a different temperature than the sampler's show a gap.
    session2 = build_session(tiny_config(tmp_path / "run2", "trainer.max_steps=1"), World())
    session2.algo = _SampleAndImitate(temperature=0.7)
    real_loss = session2.algo.loss
    session2.algo.temperature = 0.7

    def mismatched(model, micro, normaliser):
        session2.algo.temperature = 1.3
        return real_loss(model, micro, normaliser)

    session2.algo.loss = mismatched
    fit(session2)
    assert _records(tmp_path / "run2")[0]["rollout/logprob_gap"] > 1e-2


@pytest.mark.slow  # train run + offline W&B: 3.9 s
def test_wandb_offline_without_key_writes_run_files(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc key
    from trainer.tracking import wandb_mode

    assert wandb_mode() == "offline"
    out = tmp_path / "run"
    session, _ = _run(tiny_config(out, "trainer.max_steps=1", "logging.wandb=true"))
    runs = list((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and any(runs[0].rglob("*.wandb"))


@pytest.mark.slow  # two short runs
def test_engine_keys_reach_rollouts_and_eval(tmp_path):
    """trainer.engine_use_lean=false runs every rollout and eval on the HF forward: the same greedy
    tokens as the lean decoder, so the same eval figures and, for an on-policy algorithm, the same
    rollouts and losses."""
    runs = {}
    for name, extra in (("lean", []), ("hf", ["trainer.engine_use_lean=false"])):
        out = tmp_path / name
        cfg = tiny_config(out, "trainer.max_steps=2", "trainer.eval_every=2", "trainer.max_new_tokens=16",
                          "algo.num_generations=2", "trainer.batch_size=4", *extra, algo="grpo")
        session, status = _run(cfg)
        assert status == "done" and session.cfg.trainer.engine_use_lean is (None if name == "lean" else False)
        runs[name] = (_records(out), _records(out, "eval"))
    (lean_train, lean_eval), (hf_train, hf_eval) = runs["lean"], runs["hf"]
    assert [(r["accuracy"], r["step_accuracy"]) for r in lean_eval] == [(r["accuracy"], r["step_accuracy"]) for r in hf_eval]
    assert [r["rollout/length"] for r in lean_train] == [r["rollout/length"] for r in hf_train]
    assert [r["loss"] for r in hf_train] == pytest.approx([r["loss"] for r in lean_train], rel=1e-4, abs=1e-6)


def test_engine_keys_build_the_engine_config(tmp_path):
    from inference import EngineConfig
    from trainer.loop import engine_config

    t = tiny_config(tmp_path, "trainer.engine_use_lean=true", "trainer.engine_compile=true").trainer
    assert engine_config(t) == EngineConfig(use_lean=True, compile=True)


@pytest.mark.slow  # torch.compile: tens of seconds on CPU
def test_engine_compile_key_runs_eval_through_the_compiled_decoder(tmp_path):
    evals = {}
    for name, extra in (("eager", []), ("compiled", ["trainer.engine_compile=true"])):
        out = tmp_path / name
        session, status = _run(tiny_config(out, "trainer.max_steps=1", "trainer.eval_examples=4",
                                           "trainer.eval_max_new_tokens=16", *extra))
        assert status == "done"
        evals[name] = [(r["accuracy"], r["step_accuracy"], r["n"]) for r in _records(out, "eval")]
    assert evals["compiled"] == evals["eager"] and len(evals["eager"]) == 2


@pytest.mark.slow  # 2-rank torchrun: a few seconds
def test_metrics_some_ranks_lack_are_averaged_over_the_ranks_that_report_them(subprocess_env):
    """A diagnostic may be missing on one rank (e.g. paths/agree_*_off when that rank's rollouts never
    leave the reference's path): the ranks must not stack different key lists into one reduction."""
    import json
    import subprocess
    import sys

    from tests.conftest import ROOT

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "tests" / "trainer" / "mean_worker.py")]
    proc = subprocess.run(cmd, env=subprocess_env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert rows[0] == {"loss": 1.5, "shared": 15.0, "only_0": 5.0, "only_1": 6.0, "extra": 7.0}


def test_metric_mean_in_one_process_is_the_value():
    from trainer.distributed import World
    from trainer.loop import _mean_over_ranks

    assert _mean_over_ranks(World(), {"b": torch.tensor(2.5), "a": 1.0}) == {"a": 1.0, "b": 2.5}
    assert _mean_over_ranks(World(), {}) == {}


def test_extra_eval_gets_the_configured_number_of_examples(tmp_path):
    """trainer.extra_eval_examples sets how many held-out examples an algorithm's extra eval sees
    (seed's acceptance, skipper's skip ratios, attuner's references); its metrics join the eval record."""
    import dataclasses

    from trainer.loop import run_eval

    cfg = tiny_config(tmp_path, "trainer.eval_examples=8", "trainer.extra_eval_examples=3",
                      "trainer.eval_max_new_tokens=4", algo="skipper")
    session = build_session(cfg, World())
    seen = []

    def spy(model, tokenizer, task, examples, max_new_tokens):
        seen.append((len(examples), max_new_tokens))
        return {"skipper/skip_ratio": 0.25}

    session.caps = dataclasses.replace(session.caps, extra_eval=spy)
    result = run_eval(session)
    session.tracker.close()
    assert seen == [(3, 4)] and result["skipper/skip_ratio"] == 0.25 and result["n"] == 8

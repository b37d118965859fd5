"""SEED: the batched decoder pass equals a slow per-position reference through Hugging Face's own
layers and KV cache; block alignment; the loss is (L_full + lam L_dec) / (1 + lam) by hand and plain
SFT at lam = 0; every parameter gets gradient; gradient accumulation invariance; the export and the
self-generated data; a train.py smoke run."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from transformers import DynamicCache

from algorithms import losses
from algorithms.seed import SEED, SEEDConfig, block_starts, decoder_pass, full_forward
from algorithms.sft import SFT, SFTConfig
from models.loading import TinySpec, build_tiny
from tests.algorithms.selfdistill_helpers import arith, ctx, grads
from tests.conftest import ROOT, tiny_overrides

SPEC = TinySpec(hidden_size=32, num_layers=4, num_heads=2, intermediate_size=64)


def tiny():
    return build_tiny(SPEC, seed=0)


def _batch(algo, model, tok, task, n=4, start=0):
    return algo.make_batch(task.train_examples()[start: start + n], ctx(model, tok, task))


@torch.no_grad()
def _reference_hidden(model, ids, t, s, k):
    """Decoder state for position t of one row, built slowly: the full model's cache of positions < s
    (a plain prefix forward), then HF's own top-k layer modules on the embeddings of tokens s..t at
    positions s..t, causal, appending to that cache; final norm of the last position."""
    inner = model.model
    if s > 0:
        cache = model(input_ids=ids[:, :s], use_cache=True).past_key_values
    else:
        cache = DynamicCache(config=model.config)
    h = inner.embed_tokens(ids[:, s: t + 1])  # (1, m, H)
    m = h.shape[1]
    pos = torch.arange(s, t + 1)[None]
    rope = inner.rotary_emb(h, pos)
    allowed = torch.arange(s + m)[None, :] <= (s + torch.arange(m))[:, None]  # (m, s + m)
    mask = torch.zeros(1, 1, m, s + m).masked_fill(~allowed, torch.finfo(torch.float32).min)
    for layer in inner.layers[len(inner.layers) - k:]:
        h = layer(h, attention_mask=mask, position_ids=pos, cache=cache, use_cache=True,
                  position_embeddings=rope)
        h = h[0] if isinstance(h, tuple) else h
    return inner.norm(h[:, -1])[0]  # (H,)


@torch.no_grad()
def _batched_hidden(model, batch, block_size, k):
    _, full_inputs = full_forward(model, batch.input_ids, batch.attention_mask, k)
    starts = block_starts(batch.loss_mask, block_size)
    return decoder_pass(model, batch.input_ids, batch.attention_mask, full_inputs, starts), starts


def test_block_starts_alignment():
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 0, 0, 0], [0] * 8])
    starts = block_starts(mask, 2)
    assert starts.tolist() == [[0, 1, 2, 3, 3, 5, 5, 7], [0, 1, 1, 3, 3, 5, 5, 7], list(range(8))]
    assert block_starts(mask, 1).tolist() == [list(range(8))] * 3


@pytest.mark.parametrize("block_size,k", [(4, 2), (3, 1)])
def test_decoder_pass_matches_slow_reference(block_size, k):
    model, tok = tiny()
    task = arith()
    algo = SEED(SEEDConfig(block_size=block_size, decoder_layers=k))
    batch = _batch(algo, model, tok, task)  # 4 right-padded rows of different lengths
    hidden, starts = _batched_hidden(model, batch, block_size, k)
    for b in range(len(batch)):
        n = int(batch.attention_mask[b].sum())
        first = int(batch.loss_mask[b].float().argmax())
        ids = batch.input_ids[b: b + 1, :n]
        # the last position, the first and second of a block, and a prompt position
        for t in sorted({n - 1, first, first + 1, first + block_size, first - 2}):
            s = int(starts[b, t])
            ref = _reference_hidden(model, ids, t, s, k)
            assert torch.allclose(hidden[b, t], ref, atol=1e-5, rtol=1e-4), (b, t, s)


def test_block_size_one_sees_full_prefix_and_itself():
    model, tok = tiny()
    task = arith()
    batch = _batch(SEED(SEEDConfig()), model, tok, task, n=2)
    hidden, starts = _batched_hidden(model, batch, 1, 2)
    assert torch.equal(starts[0], torch.arange(batch.input_ids.shape[1]))
    n = int(batch.attention_mask[0].sum())
    ids = batch.input_ids[:1, :n]
    for t in range(n - 6, n):
        assert torch.allclose(hidden[0, t], _reference_hidden(model, ids, t, t, 2), atol=1e-5, rtol=1e-4)
    # and a later token of the row never changes the decoder state at t (causality)
    changed = batch.input_ids.clone()
    changed[0, n - 1] = (changed[0, n - 1] + 1) % tok.vocab_size
    batch.input_ids = changed
    hidden2, _ = _batched_hidden(model, batch, 1, 2)
    assert torch.allclose(hidden[0, : n - 1], hidden2[0, : n - 1], atol=1e-6)


def test_loss_by_hand_and_lam_zero_is_sft():
    model, tok = tiny()
    task = arith()
    lam = 0.7
    algo = SEED(SEEDConfig(lam=lam, block_size=4))
    batch = _batch(algo, model, tok, task)
    norm = batch.num_targets().float()
    out = algo.loss(model, batch, norm)
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        lp_full = losses.token_logprobs(logits, batch.input_ids)  # (B, T) log p(x_t | x_<t)
        l_full = -(lp_full * batch.loss_mask).sum()
        hidden, _ = _batched_hidden(model, batch, 4, 2)
        lp_dec = losses.token_logprobs(model.lm_head(hidden), batch.input_ids)
        # the decoder predicts every target but the first of each row
        first = batch.loss_mask.float().argmax(1)
        dec_mask = batch.loss_mask.clone()
        dec_mask[torch.arange(len(batch)), first] = 0
        l_dec = -(lp_dec * dec_mask).sum()
    expected = (l_full + lam * l_dec) / ((1 + lam) * norm)
    assert torch.allclose(out.loss.detach(), expected, rtol=1e-5)
    assert torch.allclose(out.metrics["seed/loss_full"], l_full / batch.loss_mask.sum(), rtol=1e-5)
    assert torch.allclose(out.metrics["seed/loss_dec"], l_dec / dec_mask.sum(), rtol=1e-5)
    assert 0.0 <= float(out.metrics["seed/dec_accuracy"]) <= 1.0

    zero = SEED(SEEDConfig(lam=0.0)).loss(model, batch, norm).loss
    sft = SFT(SFTConfig()).loss(model, batch, norm).loss
    assert torch.allclose(zero, sft, rtol=1e-5)


def test_every_parameter_gets_gradient_even_with_large_lam():
    for lam in (1.0, 1e4):
        model, tok = tiny()
        task = arith()
        algo = SEED(SEEDConfig(lam=lam))
        model = algo.prepare_model(model)
        batch = _batch(algo, model, tok, task)
        algo.loss(model, batch, batch.num_targets().float()).loss.backward()
        missing = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
        assert not missing, (lam, missing)


def test_grad_accumulation_invariance():
    model, tok = tiny()
    task = arith()
    algo = SEED(SEEDConfig())
    batch = _batch(algo, model, tok, task, n=8)
    full = grads(model, algo, batch, 8)
    accumulated = grads(model, algo, batch, 2)
    assert full.keys() == accumulated.keys()
    for name in full:
        assert torch.allclose(full[name], accumulated[name], atol=1e-6, rtol=1e-4), name


def test_prepare_model_checks_split():
    model, _ = tiny()
    with pytest.raises(ValueError, match="algo.decoder_layers=4"):
        SEED(SEEDConfig(decoder_layers=4)).prepare_model(model)
    with pytest.raises(ValueError, match="algo.data_source"):
        SEEDConfig(data_source="nope").validate()
    with pytest.raises(ValueError, match="algo.block_size"):
        SEEDConfig(block_size=0).validate()


def test_export_writes_drafter_spec(tmp_path):
    model, tok = tiny()
    algo = SEED(SEEDConfig(decoder_layers=3, block_size=5, draft_len=6, confidence=0.5, adaptive=False))
    algo.export(model, tok, str(tmp_path))
    spec = json.loads((tmp_path / "seed_drafter.json").read_text())
    assert spec == {"decoder_layers": 3, "block_size": 5, "draft_len": 6, "confidence": 0.5, "adaptive": False}
    assert (tmp_path / "model.safetensors").exists()


def test_self_data_uses_sampled_completions(caplog):
    model, tok = tiny()
    task = arith()
    with caplog.at_level("WARNING", logger="algorithms.seed"):
        SEED(SEEDConfig(data_source="self", self_anchor=False)).prepare_model(model)
    assert "self_anchor=false" in caplog.text  # CE on own tokens was measured to destroy accuracy
    caplog.clear()
    algo = SEED(SEEDConfig(data_source="self"))
    with caplog.at_level("WARNING", logger="algorithms.seed"):
        algo.prepare_model(model)
        SEED(SEEDConfig()).prepare_model(model)
    assert "self_anchor" not in caplog.text
    examples = task.train_examples()[:3]
    c = ctx(model, tok, task, max_new_tokens=8)
    batch = algo.make_batch(examples, c)
    again = c.engine.generate([tok(task.prompt(ex), add_special_tokens=False).input_ids for ex in examples],
                              __import__("inference").SamplingParams(max_new_tokens=8, temperature=0.0,
                                                                     stop_token_ids=(tok.eos_token_id,)))
    for b, out in enumerate(again):  # greedy: the batch's completions are the model's own greedy text
        assert batch.input_ids[b][batch.loss_mask[b].bool()].tolist() == list(out.tokens)
    assert "seed/sample_length" in batch.metrics
    assert torch.isfinite(algo.loss(model, batch, batch.num_targets().float().clamp(min=1)).loss)


def test_self_anchor_is_forward_kl_to_the_starting_weights():
    """data_source=self: L_full = sum over the full model's trained positions of KL(p_start || p_model),
    checked against the two models' plain HF logits; 0 at the start; the reference survives a
    checkpoint round trip."""
    model, tok = tiny()
    task = arith()
    algo = SEED(SEEDConfig(data_source="self", self_temperature=1.0))
    c = ctx(model, tok, task, max_new_tokens=10)
    batch = algo.make_batch(task.train_examples()[:4], c)  # the reference copy is taken here
    assert batch.loss_mask.sum() > 4 and batch.teacher is not None
    assert algo.terms(model, batch)["full"].abs() < 1e-5  # the model is still the starting model
    start = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    with torch.no_grad():
        logp = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits.log_softmax(-1)
        ref_model, _ = tiny()
        ref_model.load_state_dict(start)
        ref_logp = ref_model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits.log_softmax(-1)
    expected = 0.0
    for b in range(batch.input_ids.shape[0]):
        for t in range(batch.input_ids.shape[1] - 1):
            if batch.loss_mask[b, t + 1]:  # logits at t predict the completion token t + 1
                expected += (ref_logp[b, t].exp() * (ref_logp[b, t] - logp[b, t])).sum().item()
    full = algo.terms(model, batch)["full"]
    assert expected > 1e-3
    torch.testing.assert_close(full.item(), expected, rtol=1e-4, atol=1e-5)
    with pytest.MonkeyPatch.context() as mp:  # a sharded head (ZeRO-3): the model's own lm_head module
        mp.setattr("algorithms.seed.output_head", lambda m: None)
        torch.testing.assert_close(algo.terms(model, batch)["full"].item(), expected, rtol=1e-4, atol=1e-5)
    # Resume: a fresh algorithm restored from the checkpoint state keeps the starting weights.
    resumed = SEED(SEEDConfig(data_source="self", self_temperature=1.0))
    resumed.load_state_dict(algo.state_dict())
    batch2 = resumed.make_batch(task.train_examples()[:4], ctx(model, tok, task, max_new_tokens=10))
    torch.testing.assert_close(resumed.terms(model, batch2)["full"], algo.terms(model, batch2)["full"])
    assert resumed.terms(model, batch2)["full"] > 1e-3
    assert SEED(SEEDConfig()).state_dict() == {}


@pytest.mark.slow  # train.py subprocess: 11.5 s
def test_train_smoke_writes_drafter(tmp_path, subprocess_env):
    out = tmp_path / "run"
    args = tiny_overrides(out, "model.num_layers=4", "trainer.max_steps=2", algo="seed")
    proc = subprocess.run([sys.executable, str(ROOT / "train.py"), *args], env=subprocess_env,
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    spec = json.loads((out / "final" / "seed_drafter.json").read_text())
    assert spec["decoder_layers"] == 2 and spec["block_size"] == 4
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert any("seed/loss_dec" in r for r in records)
    evals = [r for r in records if r["split"] == "eval"]  # the trainer's eval reports the acceptance length
    assert [r["step"] for r in evals] == [0, 2] and all(r["seed/mean_accepted"] >= 1.0 for r in evals)
    assert "mean accepted length (greedy, tokens per verify forward): step 0" in proc.stdout


@pytest.mark.slow  # train.py subprocesses: 26 s
def test_self_anchor_resume_matches_an_uninterrupted_run(tmp_path, subprocess_env):
    """data_source=self through train.py: 4 steps, then the step-4 checkpoint removed and the run
    resumed from step 2 gives the same steps 3-4 (the anchor's starting weights are checkpointed,
    not re-taken from the resumed model)."""
    import shutil

    from trainer import checkpoint

    out = tmp_path / "run"
    args = tiny_overrides(out, "model.num_layers=4", "trainer.max_steps=4", "trainer.save_every=2",
                          "trainer.eval_every=100", "trainer.max_new_tokens=16", "algo.data_source=self",
                          "algo.self_temperature=1.0", algo="seed")

    def run():
        proc = subprocess.run([sys.executable, str(ROOT / "train.py"), *args], env=subprocess_env,
                              capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert proc.returncode == 0, proc.stderr[-3000:]
        rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: (r["loss"], r["seed/loss_full"]) for r in rows if r["split"] == "train"}

    whole = run()
    for step, path in checkpoint.complete_checkpoints(str(out)):
        if step > 2:
            shutil.rmtree(path)
    metrics = out / "metrics.jsonl"  # keep steps <= 2, so steps 3-4 can only come from the resumed run
    metrics.write_text("".join(line + "\n" for line in metrics.read_text().splitlines()
                               if json.loads(line)["step"] <= 2))
    resumed = run()
    assert whole[4][1] > 0  # the model moved away from its start, so the anchor is live
    for step in (3, 4):
        assert resumed[step] == pytest.approx(whole[step], rel=1e-5, abs=1e-7)


def test_extra_eval_reports_mean_accepted(monkeypatch):
    model, tok = tiny()
    task = arith()
    algo = SEED(SEEDConfig())
    result = algo.extra_eval(model, tok, task, task.test_examples()[:2], max_new_tokens=8)
    assert set(result) == {"seed/mean_accepted"} and result["seed/mean_accepted"] >= 1.0
    assert model.training == build_tiny(SPEC, seed=0)[0].training  # train/eval mode restored
    # A training engine's forward hooks (DeepSpeed ZeRO-1/2): the eval decodes a hook-free copy, same result.
    calls = []
    handle = model.model.layers[0].register_forward_pre_hook(lambda *args: calls.append(1))
    assert algo.extra_eval(model, tok, task, task.test_examples()[:2], max_new_tokens=8) == result
    handle.remove()
    assert calls == []  # the hooked model itself was not run
    peft_like = type("Wrapped", (torch.nn.Module,), {})()  # an architecture the runtime cannot run: skipped
    peft_like.config, peft_like.lm = model.config, torch.nn.Linear(2, 2)
    monkeypatch.setattr("algorithms.seed.causal_lm", lambda m: m)
    assert algo.extra_eval(peft_like, tok, task, task.test_examples()[:2], max_new_tokens=8) == {}
    monkeypatch.undo()
    monkeypatch.setitem(sys.modules, "inference.speculative", None)  # runtime missing: skipped, no error
    assert algo.extra_eval(model, tok, task, task.test_examples()[:2], max_new_tokens=8) == {}


def test_training_decoder_pass_drafts_like_the_runtime(monkeypatch):
    """Round 1 of the runtime's SEED drafting (x = the first emitted token at position P, drafts
    d_1..d_m) equals the argmax of the training decoder pass on prompt + [x, d_1..d_m-1], whose
    first block starts at P."""
    from inference import SamplingParams
    from inference import speculative

    model, tok = tiny()
    task = arith()
    prompt = tok(task.prompt(task.test_examples()[0]), add_special_tokens=False).input_ids
    rounds, logits = [], []
    original, original_logits = speculative._Run._draft, speculative._Run._draft_logits

    def record(self, x, pos, cap, K):
        out = original(self, x, pos, cap, K)
        rounds.append((x.clone(), pos.clone(), out[0].clone()))  # drafts (n, m)
        return out

    def record_logits(self, token, positions, slot):
        out = original_logits(self, token, positions, slot)
        logits.append(out.clone())
        return out

    monkeypatch.setattr(speculative._Run, "_draft", record)
    monkeypatch.setattr(speculative._Run, "_draft_logits", record_logits)
    dec = speculative.SpeculativeDecoder(model, mode="seed", decoder_layers=2, draft_len=4, adaptive=False)
    dec.generate([prompt], SamplingParams(max_new_tokens=12, temperature=0.0))
    x, pos, drafts = rounds[0]
    assert int(pos[0]) == len(prompt) and drafts.shape[1] == 4
    row = prompt + [int(x[0])] + drafts[0, :-1].tolist()
    ids = torch.tensor([row])
    attn = torch.ones_like(ids)
    loss_mask = torch.zeros_like(ids)
    loss_mask[0, len(prompt):] = 1
    with torch.no_grad():
        _, full_inputs = full_forward(model, ids, attn, 2)
        hidden = decoder_pass(model, ids, attn, full_inputs, block_starts(loss_mask, 4))
        mine = model.lm_head(hidden[0, len(prompt):])  # (4, V)
    runtime = torch.cat(logits[:4])  # (4, V): the first round's four drafting steps
    assert torch.allclose(mine, runtime.float(), atol=1e-4, rtol=1e-4)
    mine = mine.argmax(-1)
    assert mine.tolist() == drafts[0].tolist()

"""Engine tests on tiny random models: HF parity, logprobs, stopping, compaction, fallback."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from inference import Completion, Engine, SamplingParams
from inference.lean import lean_unsupported_reason

NEW = 16
GREEDY = SamplingParams(max_new_tokens=NEW, temperature=0.0)


def hf_greedy(model, prompt: list[int], new_tokens: int = NEW) -> list[int]:
    """Reference: HF generate on this one row, no stop token."""
    ids = torch.tensor([prompt])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new_tokens,
        eos_token_id=None, pad_token_id=0, top_k=None, top_p=None, temperature=None,
    )
    return out[0, len(prompt):].tolist()


def full_forward_logprobs(model, prompt: list[int], completion: list[int], temperature: float):
    """What a trainer computes: log_softmax(logits / T) of one plain forward, at the completion."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()  # (T, V)
    logprobs = (logits / temperature).log_softmax(-1)[len(prompt) - 1: -1]  # (N, V)
    return logprobs.gather(-1, torch.tensor(completion)[:, None]).squeeze(-1)


def first_index(seq: list[int], sub: list[int]) -> int:
    """End index (exclusive) of the first occurrence of `sub` in `seq`."""
    for end in range(len(sub), len(seq) + 1):
        if seq[end - len(sub): end] == sub:
            return end
    raise AssertionError("sub-sequence not found")


# ----------------------------------------------------------------------------- HF parity


@pytest.mark.parametrize(
    "arch,use_lean", [("qwen3", True), ("qwen3", False), ("llama", True), ("qwen2", True)]
)
def test_greedy_batch1_matches_hf_generate(make_model, prompts, arch, use_lean):
    model = make_model(arch)
    assert lean_unsupported_reason(model) is None
    engine = Engine(model, use_lean=use_lean)
    assert engine.lean_active() == use_lean
    [out] = engine.generate([prompts[0]], GREEDY)
    assert out.tokens == hf_greedy(model, prompts[0])
    assert out.finish_reason == "length" and len(out.logprobs) == NEW


@pytest.mark.parametrize("arch,use_lean", [("qwen3", True), ("qwen3", False), ("llama", True)])
def test_greedy_padded_batch_matches_hf_per_row(make_model, prompts, arch, use_lean):
    model = make_model(arch)
    outs = Engine(model, use_lean=use_lean).generate(prompts, GREEDY)
    for prompt, out in zip(prompts, outs):
        assert out.tokens == hf_greedy(model, prompt)


@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen2"])
def test_bf16_lean_matches_hf_path(make_model, prompts, arch):
    """bf16 rounds the RoPE inv_freq buffer too; the lean tables read it, so paths still agree."""
    model = make_model(arch).to(torch.bfloat16)
    lean = Engine(model, use_lean=True).generate(prompts, GREEDY)
    hf = Engine(model, use_lean=False).generate(prompts, GREEDY)
    assert [o.tokens for o in lean] == [o.tokens for o in hf]


def test_outputs_are_not_trivial(qwen3, prompts):
    """Guard for the parity tests: the random model must not just repeat one token."""
    outs = Engine(qwen3).generate(prompts, GREEDY)
    assert all(len(set(o.tokens)) > 3 for o in outs)


# ----------------------------------------------------------------------------- logprobs


@pytest.mark.parametrize("use_lean", [True, False])
def test_logprobs_match_full_forward(qwen3, prompts, use_lean):
    temperature = 0.7
    params = SamplingParams(max_new_tokens=NEW, temperature=temperature, top_k=20, top_p=0.9)
    outs = Engine(qwen3, use_lean=use_lean).generate(prompts, params, torch.Generator().manual_seed(3))
    for prompt, out in zip(prompts, outs):
        expected = full_forward_logprobs(qwen3, prompt, out.tokens, temperature)
        torch.testing.assert_close(torch.tensor(out.logprobs), expected, atol=1e-4, rtol=0)


def test_greedy_logprobs_use_temperature_one(qwen3, prompts):
    [out] = Engine(qwen3).generate([prompts[0]], GREEDY)
    expected = full_forward_logprobs(qwen3, prompts[0], out.tokens, 1.0)
    torch.testing.assert_close(torch.tensor(out.logprobs), expected, atol=1e-4, rtol=0)


# ----------------------------------------------------------------------------- stopping


def test_stop_token_ends_rows_early_and_is_included(qwen3, prompts):
    free = Engine(qwen3).generate(prompts, GREEDY)
    stop = free[0].tokens[3]  # row 0 stops at step <= 3; other rows wherever they emit it
    outs = Engine(qwen3).generate(prompts, SamplingParams(max_new_tokens=NEW, temperature=0.0,
                                                          stop_token_ids=(stop, 999)))
    for full, out in zip(free, outs):
        if stop in full.tokens:
            cut = full.tokens.index(stop) + 1
            assert out.tokens == full.tokens[:cut] and out.finish_reason == "stop"
            assert out.logprobs == pytest.approx(full.logprobs[:cut], abs=1e-5)
        else:
            assert out.tokens == full.tokens and out.finish_reason == "length"
    assert len({len(o.tokens) for o in outs}) > 1, "rows should finish at different lengths"


def test_stop_sequence_ends_row_at_first_occurrence(qwen3, prompts):
    free = Engine(qwen3).generate(prompts, GREEDY)
    seq = tuple(free[1].tokens[4:6])
    params = SamplingParams(max_new_tokens=NEW, temperature=0.0, stop_sequences=(seq, (61, 61, 61, 61)))
    outs = Engine(qwen3).generate(prompts, params)
    assert outs[1].tokens == free[1].tokens[: first_index(free[1].tokens, list(seq))]
    assert outs[1].finish_reason == "stop" and tuple(outs[1].tokens[-2:]) == seq


def test_max_new_tokens_respected(qwen3, prompts):
    outs = Engine(qwen3).generate(prompts, SamplingParams(max_new_tokens=5, temperature=1.0),
                                  torch.Generator().manual_seed(0))
    assert all(len(o.tokens) == 5 and o.finish_reason == "length" for o in outs)
    assert all(isinstance(o, Completion) for o in outs)


def test_max_seq_len_caps_the_completion(qwen3, prompts):
    outs = Engine(qwen3, max_seq_len=12).generate(prompts, GREEDY)
    longest = max(map(len, prompts))
    assert all(len(o.tokens) == 12 - longest and o.finish_reason == "length" for o in outs)
    with pytest.raises(ValueError, match="max_seq_len"):
        Engine(qwen3, max_seq_len=9).generate(prompts, GREEDY)


# ----------------------------------------------------------------------------- compaction


@pytest.mark.parametrize("use_lean", [True, False])
def test_compacted_batch_equals_rows_alone(qwen3, prompts, use_lean):
    engine = Engine(qwen3, use_lean=use_lean)
    free = engine.generate(prompts, GREEDY)
    # Stop on tokens each row emits at a different step, so rows leave the batch one by one.
    stops = tuple({o.tokens[i] for i, o in zip((1, 5, 9, 13), free)})
    params = SamplingParams(max_new_tokens=NEW, temperature=0.0, stop_token_ids=stops)
    together = engine.generate(prompts, params)
    assert len({len(o.tokens) for o in together}) > 2
    for prompt, out in zip(prompts, together):
        [alone] = engine.generate([prompt], params)
        assert out.tokens == alone.tokens and out.finish_reason == alone.finish_reason
        assert out.logprobs == pytest.approx(alone.logprobs, abs=1e-5)


# ----------------------------------------------------------------------------- sampling


def test_top_k_one_equals_greedy(qwen3, prompts):
    greedy = Engine(qwen3).generate(prompts, GREEDY)
    top1 = Engine(qwen3).generate(prompts, SamplingParams(max_new_tokens=NEW, temperature=0.9, top_k=1),
                                  torch.Generator().manual_seed(5))
    assert [o.tokens for o in top1] == [o.tokens for o in greedy]


def test_seeded_sampling_is_reproducible(qwen3, prompts):
    params = SamplingParams(max_new_tokens=NEW, temperature=1.0, top_p=0.95)
    engine = Engine(qwen3)
    a = engine.generate(prompts, params, torch.Generator().manual_seed(7))
    b = engine.generate(prompts, params, torch.Generator().manual_seed(7))
    c = engine.generate(prompts, params, torch.Generator().manual_seed(8))
    assert [o.tokens for o in a] == [o.tokens for o in b]
    assert [o.tokens for o in a] != [o.tokens for o in c]


# ----------------------------------------------------------------------------- fallback


class PlainSubclassLinear(nn.Linear):
    """A Linear subclass that computes exactly what nn.Linear does (a stand-in for later wrappers)."""


class ShiftedLinear(nn.Linear):
    """A Linear subclass with its own math (like a LoRA or fake-quant linear)."""

    def forward(self, x):
        return super().forward(x) + 0.5


def swap_q_proj(model, cls: type[nn.Linear]):
    old = model.model.layers[0].self_attn.q_proj
    new = cls(old.in_features, old.out_features, bias=old.bias is not None)
    new.load_state_dict(old.state_dict())
    model.model.layers[0].self_attn.q_proj = new
    return model


def test_linear_subclass_falls_back_with_equal_results(make_model, prompts):
    model = swap_q_proj(make_model("qwen3"), PlainSubclassLinear)
    engine = Engine(model)
    assert not engine.lean_active()
    lean = Engine(make_model("qwen3"), use_lean=True).generate(prompts, GREEDY)
    assert [o.tokens for o in engine.generate(prompts, GREEDY)] == [o.tokens for o in lean]
    with pytest.raises(ValueError, match="PlainSubclassLinear"):
        Engine(model, use_lean=True)


def test_fallback_runs_the_modules_own_forward(make_model, prompts):
    model = swap_q_proj(make_model("qwen3"), ShiftedLinear)
    outs = Engine(model).generate(prompts, GREEDY)
    for prompt, out in zip(prompts, outs):
        assert out.tokens == hf_greedy(model, prompt)
    plain = Engine(make_model("qwen3")).generate(prompts, GREEDY)
    assert [o.tokens for o in outs] != [o.tokens for o in plain]


def test_peft_wrapped_model_falls_back(make_model, prompts, recwarn):
    from peft import LoraConfig, get_peft_model

    wrapped = get_peft_model(make_model("qwen3"), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    engine = Engine(wrapped)
    assert not engine.lean_active()
    outs = engine.generate(prompts, GREEDY)  # LoRA B starts at zero: same function as the base
    plain = Engine(make_model("qwen3")).generate(prompts, GREEDY)
    assert [o.tokens for o in outs] == [o.tokens for o in plain]
    assert not [w for w in recwarn if "past_key_values" in str(w.message)]


def test_rope_scaling_falls_back_to_hf(make_model, prompts):
    model = make_model("llama", rope_scaling={"rope_type": "linear", "factor": 2.0})
    assert "rope_type" in lean_unsupported_reason(model)
    [out] = Engine(model).generate([prompts[2]], GREEDY)
    assert out.tokens == hf_greedy(model, prompts[2])


def test_lean_and_hf_paths_agree_with_sampling(qwen3, prompts):
    params = SamplingParams(max_new_tokens=NEW, temperature=0.8, top_p=0.9, stop_token_ids=(7,))
    lean = Engine(qwen3, use_lean=True).generate(prompts, params, torch.Generator().manual_seed(1))
    hf = Engine(qwen3, use_lean=False).generate(prompts, params, torch.Generator().manual_seed(1))
    assert [o.tokens for o in lean] == [o.tokens for o in hf]


# ----------------------------------------------------------------------------- live model


def test_reads_live_weights_and_restores_train_mode(qwen3, prompts):
    engine = Engine(qwen3)
    before = engine.generate(prompts, GREEDY)
    qwen3.train()
    with torch.no_grad():
        qwen3.model.layers[1].mlp.down_proj.weight.mul_(-3.0)  # a "trainer update" in place
    after = engine.generate(prompts, GREEDY)
    assert qwen3.training and all(m.training for m in qwen3.modules())
    assert [o.tokens for o in after] != [o.tokens for o in before]
    for prompt, out in zip(prompts, after):
        assert out.tokens == hf_greedy(qwen3.eval(), prompt)


def test_bad_prompts_are_rejected(qwen3):
    with pytest.raises(ValueError, match="empty"):
        Engine(qwen3).generate([[1, 2], []], GREEDY)
    with pytest.raises(ValueError, match="outside"):
        Engine(qwen3).generate([[1, 62]], GREEDY)
    assert Engine(qwen3).generate([], GREEDY) == []


@pytest.mark.slow  # torch.compile: ~10 s warm, longer with a cold inductor cache
def test_compiled_lean_path_matches_eager(qwen3, prompts):
    """compile=True (torch.compile of the cache-free layer halves) gives the same tokens."""
    params = SamplingParams(max_new_tokens=6, temperature=0.0, stop_token_ids=(7,))
    eager = Engine(qwen3).generate(prompts, params)
    compiled = Engine(qwen3, compile=True).generate(prompts, params)
    assert [o.tokens for o in compiled] == [o.tokens for o in eager]

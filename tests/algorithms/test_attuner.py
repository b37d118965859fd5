"""Attuner: the position-independent cache against full prefill and against an unbatched reference,
the adapter's reach (query tokens only), the loss by hand, what trains (by hand and through the
trainer), gradient accumulation, the export and its reload, the trainable fraction against real
parameter counts, and bad input."""
from __future__ import annotations

import copy
import json
import random

import pytest
import torch
from transformers import DynamicCache

from algorithms.attuner import Attuner, AttunerConfig
from algorithms.base import RolloutContext, pad_right
from algorithms.pic_forward import SegmentIds, encode_context, segment_ids, split_rows, student_hidden
from inference.relocate import relocate_keys, rope_layout
from models.loading import meta_model, qwen3_config, random_qwen3
from models.query_adapter import (
    QueryAdapterError, apply_query_lora, base_parameters, check_query_only, lora_modules, query_lora_parameters,
    trainable_fraction,
)
from models.tokenizer import build_char_tokenizer
from tasks import DataError
from tasks.base import Example, Segments, VerifyResult, answers_equal, extract_answer, split_lines
from tests.conftest import tiny_config, tiny_overrides

VOCAB = len(build_char_tokenizer())


class ToyArtifacts:
    """Prompts that need one of 2-3 artifacts: "facts:\\n" + notes "note a: k=3.\\n" + "q: what is k?\\na: "."""

    name = "toy_artifacts"
    mask_token = "_"

    def __init__(self, n_train: int = 16, n_test: int = 4, seed: int = 0, prefix: str = "facts:\n",
                 with_artifacts: bool = True):
        rng = random.Random(seed)
        self.prefix = prefix
        examples = []
        for i in range(n_train + n_test):
            names = rng.sample("kmpqxyz", rng.choice([2, 3]))
            values = [rng.randrange(10, 99) for _ in names]
            notes = tuple(f"note {chr(97 + j)}: {v}={x}.\n" for j, (v, x) in enumerate(zip(names, values)))
            pick = rng.randrange(len(names))
            answer = str(values[pick])
            examples.append(Example(question=f"q: what is {names[pick]}?\na: ", solution=f"{answer}\n#### {answer}",
                                    answer=answer, uid=f"toy-{i}", artifacts=notes if with_artifacts else ()))
        self._train, self._test = examples[:n_train], examples[n_train:]

    def train_examples(self):
        return self._train

    def test_examples(self):
        return self._test

    def segments(self, ex: Example) -> Segments:
        return Segments(self.prefix, ex.artifacts, ex.question)

    def prompt(self, ex: Example) -> str:
        return self.segments(ex).text()

    def teacher_prompt(self, ex: Example, reference: str) -> str:
        return self.prompt(ex) + reference

    def verify(self, ex: Example, completion: str) -> VerifyResult:
        got = extract_answer(completion)
        return VerifyResult(answers_equal(got, ex.answer), got)

    def solution_spans(self, solution: str) -> list[str]:
        return split_lines(solution)


def tiny_model(seed: int = 0):
    """A random tiny Qwen3 with grouped K/V heads (4 query heads, 2 K/V heads) and the char tokenizer."""
    tok = build_char_tokenizer()
    model = random_qwen3(VOCAB, seed=seed, hidden_size=32, num_layers=2, num_heads=4, kv_heads=2, head_dim=8,
                         intermediate_size=64, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    return model.eval(), tok


def prepared(seed: int = 0, **keys):
    """(algo, the prepared peft model, an untouched copy of the base, tokenizer)."""
    model, tok = tiny_model(seed)
    base = copy.deepcopy(model)
    algo = Attuner(AttunerConfig(**keys))
    return algo, algo.prepare_model(model), base, tok


def randomize_lora(model, seed: int = 1, scale: float = 0.3):
    """lora_B starts at zero (a fresh adapter changes nothing); give every adapter weight a value."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora_" in n:
                p.copy_(torch.randn(p.shape, generator=gen) * scale)


def ctx(model, tok, task, max_new_tokens: int = 12):
    return RolloutContext(task, tok, torch.Generator().manual_seed(0), torch.device("cpu"), max_new_tokens,
                          policy_fn=lambda: model)


def rows_of(tok, task, examples) -> list[SegmentIds]:
    return [segment_ids(tok, task.segments(ex)) for ex in examples]


def reference_hidden(model, row: SegmentIds, new: list[int]) -> torch.Tensor:
    """The slow reference: one row, no padding, plain HF caches. The prefix through the frozen base;
    each artifact through the frozen base on its own right after the prefix (positions P..), its keys
    relocated to its place; then the new tokens through `model` as it is over that cache, with the
    model's default positions (after the cache). (T, H) final hidden states."""
    lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    rope = rope_layout(lm)
    off = model.disable_adapter() if hasattr(model, "disable_adapter") else torch.no_grad()
    P = len(row.prefix)
    with torch.no_grad(), off:
        prefix = DynamicCache(config=lm.config)
        if P:
            lm(input_ids=torch.tensor([row.prefix]), cache=prefix, use_cache=True)
        layers = [([layer.keys], [layer.values]) if P else ([], []) for layer in prefix.layers]
        for art, start in zip(row.artifacts, row.starts()):
            cache = DynamicCache(config=lm.config)
            for i, layer in enumerate(prefix.layers if P else []):
                cache.update(layer.keys.clone(), layer.values.clone(), i)
            lm(input_ids=torch.tensor([art]), position_ids=torch.arange(P, P + len(art))[None], cache=cache,
               use_cache=True)
            for i, layer in enumerate(cache.layers):
                layers[i][0].append(relocate_keys(layer.keys[:, :, P:], P, start, rope))
                layers[i][1].append(layer.values[:, :, P:])
    cache = DynamicCache(config=lm.config)
    for i, (ks, vs) in enumerate(layers):
        cache.update(torch.cat(ks, 2), torch.cat(vs, 2), i)
    out = lm.model(input_ids=torch.tensor([new]), cache=cache, use_cache=True)
    return out.last_hidden_state[0]


def batched_hidden(model, rows: list[SegmentIds], news: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    kv = encode_context(model, rows, batch_size=2)  # 2 artifacts per encoding forward: several forwards
    ids, mask = pad_right(news, 0, torch.device("cpu"))
    return student_hidden(model, kv, ids, mask), mask


# --- the cache ---------------------------------------------------------------------------------------------


def test_one_artifact_at_position_zero_is_full_prefill():
    """PIC of one artifact at position 0 with no prefix is full prefill: the student (a fresh adapter)
    gives the base's full-prefill logits at every query token, batched with padding."""
    _, model, base, tok = prepared()
    rows = [segment_ids(tok, Segments("", ("note a: k=31.\n",), "q: what is k?\na: 31")),
            segment_ids(tok, Segments("", ("x=5.\n",), "q: x?\na: 5\n#### 5"))]
    with torch.no_grad():
        hidden, mask = batched_hidden(model, rows, [list(r.query) for r in rows])
        got = base.lm_head(hidden)
        for b, r in enumerate(rows):
            want = base(input_ids=torch.tensor([r.prompt()])).logits[0, len(r.context()):]
            assert torch.allclose(got[b, : len(r.query)], want, atol=1e-5, rtol=0), b


def test_batched_student_equals_the_unbatched_reference():
    """Rows with and without a prefix, different prefixes, 1-3 artifacts (one shared by two rows at
    different places), contexts and queries of different lengths: every real new token's state equals
    the one-row, no-padding reference, with a non-zero adapter."""
    _, model, _, tok = prepared()
    randomize_lora(model)
    rows = [segment_ids(tok, Segments("facts:\n", ("note a: k=31.\n", "note b: m=7.\n"), "q: what is m?\na: ")),
            segment_ids(tok, Segments("facts:\n", ("note b: m=7.\n",), "q: m?\na: 7")),
            segment_ids(tok, Segments("", ("z=1.\n", "y=22.\n", "note b: m=7.\n"), "q: y?\na: ")),
            segment_ids(tok, Segments("other:\n", ("y=22.\n",), "q: y?\na: 22\n#### 22"))]
    news = [list(r.query) for r in rows]
    with torch.no_grad():
        hidden, _ = batched_hidden(model, rows, news)
        for b, (r, new) in enumerate(zip(rows, news)):
            want = reference_hidden(model, r, new)
            assert torch.allclose(hidden[b, : len(new)], want, atol=1e-5, rtol=0), b


def test_split_rows_recovers_the_segments_from_the_labels():
    tok = build_char_tokenizer()
    row = segment_ids(tok, Segments("p:", ("ab", "c"), "q?"))
    assert row.starts() == [2, 4] and row.labels() == [0, 0, 1, 1, 2, -1, -1]
    ids = torch.tensor([row.prompt() + [7, 8, 0]])
    labels = torch.tensor([row.labels() + [-1, -1, -1]])
    (ctx_row,), (new,) = split_rows(ids, labels, torch.tensor([[1] * 9 + [0]]))
    assert ctx_row == SegmentIds(row.prefix, row.artifacts, ()) and new == list(row.query) + [7, 8]


def test_the_adapter_is_active_on_the_query_tokens_only():
    """The cache K/V are bytewise the base's with a non-zero adapter on; the student's logits change."""
    _, model, base, tok = prepared()
    randomize_lora(model)
    assert sorted(lora_modules(model)) == [f"base_model.model.model.layers.{i}.self_attn.q_proj" for i in range(2)]
    check_query_only(model)
    task = ToyArtifacts()
    rows = rows_of(tok, task, task.train_examples()[:3])
    with torch.no_grad():
        adapted, plain = encode_context(model, rows), encode_context(base, rows)
        assert torch.equal(adapted.keys, plain.keys) and torch.equal(adapted.values, plain.values)
        ids, mask = pad_right([list(r.query) for r in rows], 0, torch.device("cpu"))
        with_adapter = base.lm_head(student_hidden(model, adapted, ids, mask))
        without = base.lm_head(student_hidden(base, plain, ids, mask))
    assert not torch.allclose(with_adapter[mask.bool()], without[mask.bool()], atol=1e-3)


def test_an_adapter_off_the_query_projection_is_refused():
    model, _ = tiny_model()
    with pytest.raises(QueryAdapterError, match="only query projections"):
        apply_query_lora(model, 2, 4.0, 0.0, targets=("q_proj", "v_proj"))
    from peft import LoraConfig, get_peft_model

    other = get_peft_model(tiny_model()[0], LoraConfig(r=2, target_modules=["q_proj", "k_proj"]))
    with pytest.raises(QueryAdapterError, match="k_proj"):
        check_query_only(other)


# --- the loss ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("beta", [0.0, 0.5])
def test_the_loss_by_hand_on_one_row(beta):
    """KL(p_T || p_S) (beta 0) or the JSD(beta) from full softmaxes at temperature 2, summed over the
    target tokens, over the normaliser: teacher = the base's full-prefill logits, student = the
    reference forward over the row's cache."""
    algo, model, base, tok = prepared(beta=beta, kd_temperature=2.0)
    randomize_lora(model, scale=0.5)
    task = ToyArtifacts()
    ex = task.train_examples()[0]
    batch = algo.make_batch([ex], ctx(model, tok, task))
    row = segment_ids(tok, task.segments(ex))
    target = tok(ex.solution, add_special_tokens=False).input_ids + [tok.eos_token_id]
    assert batch.input_ids[0].tolist() == row.prompt() + target
    out = algo.loss(model, batch, torch.tensor(7.0))
    C, Q = len(row.context()), len(row.query)
    with torch.no_grad():
        teacher = base(input_ids=batch.input_ids).logits[0]  # (T, V)
        student = base.lm_head(reference_hidden(model, row, list(row.query) + target))  # (Q + len(target), V)
    # target token j sits at full position C + Q + j; it is predicted at full position C + Q + j - 1,
    # which is new-token position Q + j - 1
    t_logp = torch.log_softmax(teacher[C + Q - 1: C + Q - 1 + len(target)] / 2.0, -1)
    s_logp = torch.log_softmax(student[Q - 1: Q - 1 + len(target)] / 2.0, -1)
    if beta == 0.0:
        per_token = (t_logp.exp() * (t_logp - s_logp)).sum(-1)
    else:
        mix = (beta * t_logp.exp() + (1 - beta) * s_logp.exp()).log()
        per_token = (beta * (t_logp.exp() * (t_logp - mix)).sum(-1)
                     + (1 - beta) * (s_logp.exp() * (s_logp - mix)).sum(-1))
    assert torch.allclose(out.loss, per_token.sum() / 7.0, rtol=1e-4, atol=1e-7)
    assert out.loss > 0
    assert torch.isclose(out.metrics["attuner/kl"], per_token.sum() / len(target), rtol=1e-4)
    agree = (t_logp.argmax(-1) == s_logp.argmax(-1)).float().mean()
    assert torch.isclose(out.metrics["attuner/student_top1_agree"], agree)


def test_teacher_completions_are_the_full_prefill_bases_greedy_outputs():
    from inference import Engine, SamplingParams

    algo, model, base, tok = prepared(completions="teacher")
    randomize_lora(model)  # the adapted model would decode differently
    task = ToyArtifacts()
    examples = task.train_examples()[:3]
    batch = algo.make_batch(examples, ctx(model, tok, task, max_new_tokens=8))
    prompts = [tok(task.prompt(ex), add_special_tokens=False).input_ids for ex in examples]
    params = SamplingParams(max_new_tokens=8, temperature=0.0, stop_token_ids=(tok.eos_token_id,))
    expected = [p + list(o.tokens) for p, o in zip(prompts, Engine(base).generate(prompts, params))]
    for row, ids, mask in zip(expected, batch.input_ids.tolist(), batch.attention_mask.tolist()):
        assert ids[: sum(mask)] == row


def test_gradient_accumulation_invariance():
    """Micro-batches of different context widths: 1 vs 3 micro-batches give the same gradient."""
    algo, model, _, tok = prepared()
    randomize_lora(model)
    task = ToyArtifacts()
    batch = algo.make_batch(task.train_examples()[:6], ctx(model, tok, task))
    normaliser = batch.num_targets().float()

    def grads(size):
        model.zero_grad()
        for micro in batch.micro_batches(size):
            algo.loss(model, micro, normaliser).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    whole, split = grads(6), grads(2)
    assert whole.keys() == split.keys() and len(whole) == 4  # lora_A, lora_B on 2 layers
    for n in whole:
        assert whole[n].abs().sum() > 0, n
        assert torch.allclose(whole[n], split[n], atol=1e-6, rtol=1e-5), n


# --- what trains ----------------------------------------------------------------------------------------------


def test_two_steps_change_every_adapter_weight_and_nothing_else():
    algo, model, _, tok = prepared()
    task = ToyArtifacts()
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert sorted(trainable) == sorted(f"base_model.model.model.layers.{i}.self_attn.q_proj.lora_{ab}.default.weight"
                                       for i in range(2) for ab in "AB")
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    before = {n: p.detach().clone() for n, p in trainable.items()}
    opt = torch.optim.Adam(trainable.values(), lr=1e-2)
    for step in range(2):
        batch = algo.make_batch(task.train_examples()[step * 4: step * 4 + 4], ctx(model, tok, task))
        for micro in batch.micro_batches(2):
            algo.loss(model, micro, batch.num_targets().float()).loss.backward()
        opt.step()
        opt.zero_grad()
    assert not [n for n, p in trainable.items() if torch.equal(p.detach(), before[n])]
    assert all(torch.equal(p.detach(), frozen[n]) for n, p in model.named_parameters() if n in frozen)


TRAIN = ["trainer.max_steps=2", "trainer.batch_size=4", "trainer.micro_batch_size=2", "trainer.eval_examples=2",
         "trainer.eval_max_new_tokens=4", "trainer.max_new_tokens=8"]


def test_two_trainer_steps_change_every_trainable_parameter_and_no_other(tmp_path):
    from trainer.distributed import World
    from trainer.loop import fit
    from trainer.setup import build_session, export_final

    out = tmp_path / "run"
    session = build_session(tiny_config(out, *TRAIN, algo="attuner"), World(), task=ToyArtifacts())
    model = session.backend.train_model
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".q_proj.lora_" in n for n in trainable)
    assert fit(session) == "done"
    session.tracker.close()
    changed = {n for n, p in model.named_parameters() if not torch.equal(p.detach(), before[n])}
    assert changed == trainable
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in records if r["split"] == "train"]
    assert [r["step"] for r in train_rows] == [1, 2]
    assert all(r["attuner/kl"] >= 0 and 0 <= r["attuner/student_top1_agree"] <= 1 for r in train_rows)
    final = export_final(session)
    assert json.loads(open(f"{final}/attuner.json").read())["lora_rank"] == 8


# --- export --------------------------------------------------------------------------------------------------


def test_export_is_a_peft_adapter_dir_that_reloads_to_the_same_student(tmp_path):
    from peft import PeftModel

    algo, model, base, tok = prepared(lora_rank=4)
    randomize_lora(model)
    algo.export(model, tok, str(tmp_path))
    names = {p.name for p in tmp_path.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "attuner.json", "README.md"} <= names
    spec = json.loads((tmp_path / "attuner.json").read_text())
    assert spec["kind"] == "attuner" and spec["lora_rank"] == 4 and spec["targets"] == ["q_proj"]
    assert spec["base"] == {"num_layers": 2, "hidden_size": 32, "num_heads": 4, "num_kv_heads": 2, "head_dim": 8,
                            "vocab_size": VOCAB}
    loaded = PeftModel.from_pretrained(copy.deepcopy(base), str(tmp_path)).eval()
    task = ToyArtifacts()
    rows = rows_of(tok, task, task.test_examples()[:2])
    news = [list(r.query) for r in rows]
    with torch.no_grad():
        want, _ = batched_hidden(model, rows, news)
        got, _ = batched_hidden(loaded, rows, news)
    assert torch.equal(got, want)


# --- the trainable fraction ----------------------------------------------------------------------------------


@pytest.mark.parametrize("extra", [{}, {"kv_heads": 2}, {"tie_word_embeddings": False, "head_dim": 8}])
def test_trainable_fraction_matches_a_real_peft_model(extra):
    model = random_qwen3(VOCAB, hidden_size=32, num_layers=3, num_heads=4, intermediate_size=64, **extra)
    config = model.config
    peft_model = apply_query_lora(model, 3, 6.0, 0.0, seed=0)
    trainable, total = peft_model.get_nb_trainable_parameters()
    assert query_lora_parameters(config, 3) == trainable
    assert base_parameters(config) + trainable == total
    assert trainable_fraction(config, 3) == trainable / total


def test_qwen3_4b_shapes():
    config = qwen3_config(151936, hidden_size=2560, num_layers=36, num_heads=32, kv_heads=8, head_dim=128,
                          intermediate_size=9728)
    assert base_parameters(config) == sum(p.numel() for p in meta_model(config).parameters()) == 4_022_468_096
    assert query_lora_parameters(config, 8) == 36 * 8 * (2560 + 32 * 128) == 1_916_928
    assert trainable_fraction(config, 8) == pytest.approx(1_916_928 / (4_022_468_096 + 1_916_928))
    assert trainable_fraction(config, 8) < 0.0005


# --- bad input -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("override,message", [
    ("algo.completions=base", "algo.completions=base is not one of solutions, teacher"),
    ("algo.lora_rank=0", "algo.lora_rank=0 must be >= 1"),
    ("algo.lora_alpha=0", "algo.lora_alpha=0.0 must be > 0"),
    ("algo.lora_dropout=1.0", "algo.lora_dropout=1.0 must be in [0, 1)"),
    ("algo.beta=1.5", "algo.beta=1.5 must be in [0, 1]"),
    ("algo.kd_temperature=0", "algo.kd_temperature=0.0 must be > 0"),
    ("algo.loss_chunk_tokens=-1", "algo.loss_chunk_tokens=-1 must be >= 0"),
    ("algo.teacher_batch_size=0", "algo.teacher_batch_size=0 must be > 0"),
    ("backend=fsdp", "backend=fsdp: algo attuner does not run under FSDP2"),
])
def test_bad_input_is_one_config_error_naming_it(tmp_path, override, message):
    from algorithms import config_schemas
    from trainer.config import ConfigError, load_config

    with pytest.raises(ConfigError) as info:
        load_config(tiny_overrides(tmp_path / "run", override, algo="attuner"), config_schemas())
    assert message in str(info.value) and "\n" not in str(info.value)


def test_check_task_refuses_a_task_without_artifacts():
    from tasks import build_task

    algo = Attuner(AttunerConfig())
    arith = build_task("arith", seed=0, n_train=4, n_test=2, digits=2, steps=1)
    with pytest.raises(DataError, match="task arith has no segments"):
        algo.check_task(arith)
    with pytest.raises(DataError, match=r"task toy_artifacts has 16 of 16 training examples without any \(e.g. toy-0\)"):
        algo.check_task(ToyArtifacts(with_artifacts=False))
    algo.check_task(ToyArtifacts())


def test_build_session_runs_check_task(tmp_path):
    from trainer.distributed import World
    from trainer.setup import build_session

    with pytest.raises(DataError, match="toy_artifacts"):
        build_session(tiny_config(tmp_path / "run", algo="attuner"), World(), task=ToyArtifacts(with_artifacts=False))

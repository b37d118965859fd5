"""Chat templates and the one prompt-ids contract (models/prompts.py, tasks/chat_template.py, conversational rows).

The independent truth is transformers' own `apply_chat_template` on the same messages, and
hand-written id lists for the BOS rule."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from tokenizers import Tokenizer, decoders, processors
from tokenizers.models import BPE
from transformers import PreTrainedTokenizerFast

from models.prompts import (
    ChatTemplateError,
    adds_bos,
    chat_mode,
    chat_parts,
    continuation_ids,
    prompt_ids,
    render,
    use_chat,
)
from models.tokenizer import CHARSET, build_char_tokenizer
from tasks import DataError, build_task
from tasks.chat_template import TemplatedTask, with_chat

# A template over the char tokenizer's alphabet (no capitals): "<role>\ncontent\n" per turn, then the cue.
TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>\n{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>\n{% endif %}")
BOS_TEMPLATE = "{{ bos_token }}" + TEMPLATE  # a template that writes the BOS itself (as Llama 3's does)


def chat_tokenizer(template: str = TEMPLATE):
    tok = build_char_tokenizer()
    tok.chat_template = template
    return tok


def bos_tokenizer(template: str | None = None):
    """The char alphabet plus a <bos> the tokenizer puts before plain text (a BOS-adding tokenizer)."""
    vocab = {t: i for i, t in enumerate(("<pad>", "<eos>", "<unk>", "<bos>") + tuple(CHARSET))}
    core = Tokenizer(BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    core.decoder = decoders.Fuse()
    core.post_processor = processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A <bos> $B",
                                                        special_tokens=[("<bos>", 3)])
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>",
                                  bos_token="<bos>")
    if template:
        tok.chat_template = template
    return tok


def ids_of(tok, text):
    return [tok.convert_tokens_to_ids(c) for c in text]


# ---------------------------------------------------------------------------------------------
# The BOS rule


def test_prompt_ids_put_exactly_one_bos_where_the_tokenizer_adds_one():
    plain, bos = build_char_tokenizer(), bos_tokenizer()
    assert not adds_bos(plain) and adds_bos(bos)
    assert prompt_ids(plain, "ab") == ids_of(plain, "ab")  # no BOS token in this vocabulary
    assert prompt_ids(bos, "ab") == [3] + ids_of(bos, "ab")
    assert prompt_ids(bos, "<bos>ab") == [3] + ids_of(bos, "ab")  # a template that wrote it: not doubled
    assert prompt_ids(bos, "") == [3]
    assert continuation_ids(bos, "ab") == ids_of(bos, "ab")  # solutions and completions never get one


@pytest.mark.parametrize("template", [TEMPLATE, BOS_TEMPLATE])
def test_templated_prompt_ids_equal_transformers_apply_chat_template(template):
    for tok in (chat_tokenizer(template), bos_tokenizer(template)):
        messages = [{"role": "system", "content": "be brief."}, {"role": "user", "content": "q: 12+7?"}]
        expected = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        text = render(tok, "q: 12+7?", (("system", "be brief."),), chat=True)
        got = prompt_ids(tok, text)
        if adds_bos(tok) and template == TEMPLATE:
            # transformers renders without adding special tokens; our rule adds the BOS the tokenizer
            # puts before plain text, once
            assert got == [tok.bos_token_id] + list(expected)
        else:
            assert got == list(expected)
        assert got.count(3 if adds_bos(tok) else -1) <= 1


def test_chat_parts_cut_the_template_around_the_content():
    tok = chat_tokenizer()
    head, tail = chat_parts(tok, (("system", "hi"),))
    assert head == "<system>\nhi\n<user>\n" and tail == "\n<assistant>\n"
    assert head + "x y" + tail == render(tok, "x y", (("system", "hi"),), chat=True)


def test_chat_mode_spellings_and_requirements():
    assert [chat_mode(v) for v in ("auto", True, "True", "false", False, "yes", "off")] == \
        ["auto", "true", "true", "false", "false", "true", "false"]
    with pytest.raises(ValueError, match="maybe"):
        chat_mode("maybe")
    plain = build_char_tokenizer()
    assert use_chat(chat_tokenizer(), "auto") and not use_chat(plain, "auto") and not use_chat(chat_tokenizer(), "false")
    with pytest.raises(ChatTemplateError, match="no chat template"):
        use_chat(plain, "true")


# ---------------------------------------------------------------------------------------------
# TemplatedTask


def test_chat_task_renders_student_and_teacher_prompts_in_the_user_turn():
    tok = chat_tokenizer()
    arith = build_task("arith", seed=0, n_train=8, n_test=4, digits=2, steps=1)
    task = with_chat(arith, tok, "auto")
    assert isinstance(task, TemplatedTask)
    ex = task.train_examples()[0]
    assert task.prompt(ex) == "<user>\n" + arith.prompt(ex) + "\n<assistant>\n"
    teacher = task.teacher_prompt(ex, ex.solution)
    assert teacher == "<user>\n" + arith.teacher_prompt(ex, ex.solution) + "\n<assistant>\n"
    assert ex.solution in teacher  # the privileged reference sits inside the user turn
    # everything else is the wrapped task's
    assert task.verify(ex, ex.solution).correct and task.mask_token == arith.mask_token
    assert task.solution_spans(ex.solution) == arith.solution_spans(ex.solution)
    assert not hasattr(task, "segments")  # arith has no artifacts, so neither has its chat view
    assert with_chat(arith, build_char_tokenizer(), "auto") is arith
    assert with_chat(arith, tok, "false") is arith


def test_chat_task_segments_keep_text_equal_to_the_prompt():
    tok = chat_tokenizer()
    task = with_chat(build_task("artifacts", seed=0, n_train=8, n_test=4, n_library=40, n_library_ood=10), tok, "true")
    ex = task.train_examples()[0]
    seg = task.segments(ex)
    assert seg.text() == task.prompt(ex) and seg.prefix.startswith("<user>\n") and seg.query.endswith("<assistant>\n")
    assert seg.artifacts == ex.artifacts and len(seg.artifacts) > 0


def test_clm_is_never_wrapped():
    clm = build_task("clm", seed=0, n_train=2, n_test=2)
    assert with_chat(clm, chat_tokenizer(), "auto") is clm
    with pytest.raises(ChatTemplateError, match="own prompts"):
        with_chat(clm, chat_tokenizer(), "true")


# ---------------------------------------------------------------------------------------------
# Conversational rows (data=text)


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_conversational_rows_in_both_dataset_formats(tmp_path):
    rows = [
        {"messages": [{"role": "system", "content": "be brief."}, {"role": "user", "content": "what is 2+3?"},
                      {"role": "assistant", "content": "2+3=5\n#### 5"}]},
        {"prompt": [{"role": "user", "content": "what is 4+4?"}],
         "completion": [{"role": "assistant", "content": "4+4=8. the answer is 8"}]},
        {"prompt": [{"role": "user", "content": "what is 1+1?"}], "completion": "1+1=2 so 2"},
        {"question": "plain 3+3?", "solution": "6", "answer": "6"},
    ]
    task = build_task("text", path=_write(tmp_path / "conv.jsonl", rows), test_fraction=0.25,
                      prompt_template="{question}", teacher_template="{question} ref: {reference}")
    examples = {ex.question: ex for ex in task.train_examples() + task.test_examples()}
    first = examples["what is 2+3?"]
    assert first.turns == (("system", "be brief."),) and first.solution == "2+3=5\n#### 5" and first.answer == "5"
    second = examples["what is 4+4?"]
    assert second.turns == () and second.answer == "8" and second.solution == "4+4=8. the answer is 8"  # as written
    assert examples["what is 1+1?"].answer == "2"
    assert examples["plain 3+3?"].turns == ()
    # without a template the earlier turns are plain text before the question
    assert task.prompt(first) == "be brief.\nwhat is 2+3?"
    assert task.teacher_prompt(first, "r") == "be brief.\nwhat is 2+3? ref: r"
    # with one, the row's own messages rendered by transformers are the prompt
    tok = chat_tokenizer()
    chat = with_chat(task, tok, "true")
    expected = tok.apply_chat_template(rows[0]["messages"][:-1], add_generation_prompt=True, tokenize=False)
    assert chat.prompt(first) == expected
    assert chat.segments(first).text() == expected


@pytest.mark.parametrize("row, message", [
    ({"messages": [{"role": "assistant", "content": "hi"}]}, "last prompt turn must be the user's"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "role 'wizard'"),
    ({"messages": [{"role": "user", "content": ""}]}, "non-empty text content"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "non-empty text content"),
    ({"prompt": [{"role": "user", "content": "q?"}],
      "completion": [{"role": "user", "content": "x"}]}, "one assistant turn"),
])
def test_bad_conversational_rows_name_the_row(tmp_path, row, message):
    good = {"question": "q?", "solution": "#### 1", "answer": "1"}
    path = _write(tmp_path / "bad.jsonl", [good, row])
    with pytest.raises(DataError, match=rf"bad.jsonl: row 2: .*{message}"):
        build_task("text", path=path, test_fraction=0.5)


# ---------------------------------------------------------------------------------------------
# One prompt-ids function: training, eval, rollouts and the CLI build the same ids


@pytest.mark.parametrize("make_tok, chat", [(bos_tokenizer, False), (lambda: bos_tokenizer(TEMPLATE), True),
                                             (lambda: chat_tokenizer(), True), (build_char_tokenizer, False)])
def test_training_eval_rollouts_and_cli_build_identical_prompt_ids(make_tok, chat):
    import torch

    import trainer.evaluation as evaluation
    from algorithms.rollouts import encode_prompt
    from algorithms.sft import SFT, SFTConfig
    from algorithms.base import RolloutContext
    from inference.__main__ import encode_cli_prompt
    from trainer.distributed import World

    tok = make_tok()
    arith = build_task("arith", seed=0, n_train=8, n_test=4, digits=2, steps=1)
    task = with_chat(arith, tok, "auto")
    assert isinstance(task, TemplatedTask) == chat
    examples = task.train_examples()[:3]

    # training (SFT's rows: the prompt part)
    batch = SFT(SFTConfig()).make_batch(examples, RolloutContext(task, tok, None, torch.device("cpu"), 8))
    train_prompts = [row[:mask.tolist().index(1)] for row, mask in zip(batch.input_ids.tolist(), batch.loss_mask)]

    # eval (what the engine is asked to complete)
    seen = []

    class Recorder:
        def generate(self, prompts, params):
            seen.extend(prompts)
            return [SimpleNamespace(tokens=[], finish_reason="stop") for _ in prompts]

    evaluation.evaluate(None, tok, task, examples, World(), 4, engine=Recorder())

    rollouts = [encode_prompt(tok, task.prompt(ex)) for ex in examples]
    cli = [encode_cli_prompt(tok, arith.prompt(ex), None) for ex in examples]  # the user types the plain prompt
    assert train_prompts == seen == rollouts == cli
    if adds_bos(tok):  # one BOS, first, whether the text or the tokenizer supplied it
        assert all(p[0] == tok.bos_token_id and p.count(tok.bos_token_id) == 1 for p in cli)

"""data=chat: rows in TRL's formats, read through `datasets`, tokenized as TRL's SFTTrainer tokenizes them.

The independent truth is TRL 1.16 itself: `SFTTrainer` prepares the same rows with the same tokenizer,
and its `input_ids` and `labels` (-100 = not in the loss) must equal our ids and loss mask. On a
template without `{% generation %}` markers (Qwen2.5's, shipped with TRL) TRL swaps in its own
marked training template, so the agreement there checks our prefix-render method against TRL's
hand-marked one."""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest

from models.tokenizer import build_char_tokenizer
from tasks import DataError, task_config
from tasks.chat import row_tokens, parse_row
from tasks.chat_template import with_chat

MARKED = ("{% for m in messages %}{% if m['role'] == 'assistant' %}<|im_start|>assistant\n{% generation %}"
          "{{ m['content'] }}<|im_end|>\n{% endgeneration %}{% else %}<|im_start|>{{ m['role'] }}\n"
          "{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# A template that writes every earlier assistant turn differently once a later turn follows (it drops the
# previous reply's text), so renders of the prefixes are not prefixes of the conversation.
NOT_PREFIX = ("{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last %}<|im_start|>assistant\n"
              "<|im_end|>\n{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}"
              "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

CONVERSATIONS = [
    {"messages": [{"role": "system", "content": "be kind."}, {"role": "user", "content": "hi"},
                  {"role": "assistant", "content": "hello there"}, {"role": "user", "content": "bye"},
                  {"role": "assistant", "content": "see you"}]},
    {"messages": [{"role": "system", "content": "answer in one word."}, {"role": "user", "content": "sky?"},
                  {"role": "assistant", "content": "blue"}]},
]
PROMPT_COMPLETION = [{"prompt": "the sky is", "completion": " blue."}, {"prompt": "grass is", "completion": " green."}]
CONV_PROMPT_COMPLETION = [
    {"prompt": [{"role": "system", "content": "be brief."}, {"role": "user", "content": "sky?"}],
     "completion": [{"role": "assistant", "content": "blue"}]},
    {"prompt": [{"role": "system", "content": "be brief."}, {"role": "user", "content": "grass?"}],
     "completion": [{"role": "assistant", "content": "green"}]},
]
TEXTS = [{"text": "the sky is blue."}, {"text": "grass is green."}]


def chatml_tokenizer(template: str | None = None):
    """The char tokenizer plus ChatML's two special tokens, with `template` (default: Qwen2.5's, as TRL ships it)."""
    import trl

    tok = build_char_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = template or (Path(trl.__file__).parent / "chat_templates" / "qwen2_5.jinja").read_text()
    return tok


def trl_rows(rows, tok, **config):
    """TRL SFTTrainer's prepared (input_ids, loss mask) of `rows`."""
    from datasets import Dataset
    from transformers import Qwen3Config, Qwen3ForCausalLM
    from trl import SFTConfig, SFTTrainer

    cfg = Qwen3Config(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    args = SFTConfig(output_dir=tempfile.mkdtemp(), report_to=[], max_length=None, use_cpu=True, **config)
    trainer = SFTTrainer(model=Qwen3ForCausalLM(cfg), args=args, train_dataset=Dataset.from_list(rows),
                         processing_class=tok)
    return [(r["input_ids"], [int(x != -100) for x in r["labels"]]) for r in trainer.train_dataset]


def ours(rows, tok, tmp_path, loss_on="assistant", chat_template="auto"):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = with_chat(task_config("chat", path=str(path), loss_on=loss_on).build(), tok, chat_template)
    return [task.row_tokens(ex) for ex in task.train_examples()]


def shown(tok, ids, mask):
    """The loss tokens as text, the rest as '~' per token (a character outside the tokenizer's alphabet)."""
    return "".join(tok.decode([i]) if m else "~" for i, m in zip(ids, mask))


# ---------------------------------------------------------------------------------------------
# Equal to TRL


def test_conversational_rows_equal_trl_assistant_only_loss_on_a_marked_template(tmp_path):
    tok = chatml_tokenizer(MARKED)
    assert ours(CONVERSATIONS, tok, tmp_path) == trl_rows(CONVERSATIONS, tok, assistant_only_loss=True)


def test_unmarked_template_masks_equal_trls_patched_template_but_the_cues_newline(tmp_path):
    """Qwen2.5's template has no markers; TRL swaps in its hand-marked copy, whose generation block starts
    at the newline of the assistant cue `<|im_start|>assistant\n`. That newline is part of the prompt at
    inference (the cue is written, never generated), so the prefix renders leave it out: the one token
    per reply by which the masks differ, and nothing else."""
    tok = chatml_tokenizer()
    newline = tok.convert_tokens_to_ids("\n")
    for (ids, mask), (trl_ids, trl_mask) in zip(ours(CONVERSATIONS, tok, tmp_path),
                                                 trl_rows(CONVERSATIONS, tok, assistant_only_loss=True)):
        assert ids == trl_ids
        differ = [i for i, (a, b) in enumerate(zip(mask, trl_mask)) if a != b]
        replies = sum(m["role"] == "assistant" for m in CONVERSATIONS[0]["messages"]) if len(ids) > 60 else 1
        assert len(differ) == replies
        for i in differ:  # TRL trains the cue's newline; we do not; the token before it ends the cue
            assert trl_mask[i] == 1 and mask[i] == 0 and ids[i] == newline
            assert tok.decode(ids[i - 9:i]) == "assistant"


def test_prompt_completion_rows_equal_trl_completion_only_loss(tmp_path):
    tok = chatml_tokenizer()
    for rows in (PROMPT_COMPLETION, CONV_PROMPT_COMPLETION):
        got = ours(rows, tok, tmp_path)
        assert got == trl_rows(rows, tok, completion_only_loss=True), shown(tok, *got[0])


def test_all_tokens_equal_trl_without_masking(tmp_path):
    tok = chatml_tokenizer()
    for rows in (CONVERSATIONS, PROMPT_COMPLETION, TEXTS):
        assert ours(rows, tok, tmp_path, loss_on="all") == trl_rows(rows, tok, completion_only_loss=False)


def test_text_rows_train_every_token_with_eos(tmp_path):
    tok = chatml_tokenizer()
    [(ids, mask)] = ours(TEXTS[:1], tok, tmp_path)
    assert tok.decode(ids) == "the sky is blue.<eos>" and all(mask)


# ---------------------------------------------------------------------------------------------
# Masks, by hand


def test_multi_turn_rows_mask_every_user_and_system_turn(tmp_path):
    tok = chatml_tokenizer()
    ids, mask = ours(CONVERSATIONS[:1], tok, tmp_path)[0]
    # exactly the two replies, each with its end of turn; no system, user or generation-cue token
    assert shown(tok, ids, mask).replace("~", "") == "hello there<|im_end|>\nsee you<|im_end|>\n"
    trained = [tok.decode([i]) for i, m in zip(ids, mask) if m]
    assert "<|im_start|>" not in trained


def test_plain_rendering_without_a_template_masks_the_replies_and_their_eos(tmp_path):
    tok = build_char_tokenizer()  # the embedded tiny model's tokenizer: no chat template
    ids, mask = ours(CONVERSATIONS[:1], tok, tmp_path)[0]
    assert tok.decode(ids) == "be kind.\nhi\nhello there\nbye\nsee you\n<eos>"
    assert shown(tok, ids, mask) == "~" * len("be kind.\nhi\n") + "hello there\n" + "~" * len("bye\n") + "see you\n<eos>"


def test_loss_on_completion_trains_only_the_trailing_reply(tmp_path):
    tok = chatml_tokenizer()
    ids, mask = ours(CONVERSATIONS[:1], tok, tmp_path, loss_on="completion")[0]
    assert shown(tok, ids, mask).replace("~", "") == "see you<|im_end|>\n"


def test_a_template_that_rewrites_earlier_turns_is_refused_in_one_line(tmp_path):
    tok = chatml_tokenizer(NOT_PREFIX)
    with pytest.raises(DataError, match=r"rows.jsonl:1: the chat template does not render") as err:
        ours(CONVERSATIONS[:1], tok, tmp_path)
    assert "\n" not in str(err.value)


def test_prompts_are_the_rows_as_written_with_the_generation_cue(tmp_path):
    tok = chatml_tokenizer(MARKED)
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in CONVERSATIONS))
    task = with_chat(task_config("chat", path=str(path)).build(), tok, "auto")
    first = task.train_examples()[0]
    expected = tok.apply_chat_template(CONVERSATIONS[0]["messages"][:4], tokenize=False, add_generation_prompt=True)
    assert task.prompt(first) == expected and first.solution == "see you"
    assert "####" not in task.prompt(first) and first.answer == ""


def test_string_prompts_are_never_templated(tmp_path):
    tok = chatml_tokenizer(MARKED)
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in PROMPT_COMPLETION))
    task = with_chat(task_config("chat", path=str(path)).build(), tok, "auto")
    assert task.prompt(task.train_examples()[0]) == "the sky is"


# ---------------------------------------------------------------------------------------------
# Sources


def test_a_save_to_disk_set_with_two_configs_loads_the_one_hub_config_names(tmp_path):
    from datasets import Dataset, DatasetDict

    for config, word in (("main", "blue"), ("other", "red")):
        rows = [{"prompt": f"q{i}", "completion": f" {word}"} for i in range(4)]
        DatasetDict({"train": Dataset.from_list(rows), "test": Dataset.from_list(rows[:2])}).save_to_disk(
            str(tmp_path / config))
    task = task_config("chat", path=str(tmp_path), hub_config="other").build()
    assert [ex.solution for ex in task.train_examples()] == [" red"] * 4
    assert len(task.test_examples()) == 2
    with pytest.raises(DataError, match=r"holds the saved data sets main, other; pick one with data.hub_config$"):
        task_config("chat", path=str(tmp_path)).build()
    with pytest.raises(DataError, match=r"one saved data set, without configs; leave data.hub_config unset"):
        task_config("chat", path=str(tmp_path / "main"), hub_config="main").build()


def test_split_slices_cut_files_and_saved_sets_alike(tmp_path):
    from datasets import Dataset, DatasetDict

    rows = [{"prompt": f"q{i}", "completion": f" a{i}"} for i in range(10)]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    DatasetDict({"train": Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "saved"))
    for source in (path, tmp_path / "saved"):
        for split, expected in (("train[:30%]", ["q0", "q1", "q2"]), ("train[-2:]", ["q8", "q9"])):
            task = task_config("chat", path=str(source), train_split=split).build()
            assert [ex.question for ex in task.train_examples()] == expected


def test_parquet_and_csv_files_read_like_jsonl(tmp_path):
    from datasets import Dataset

    Dataset.from_list(PROMPT_COMPLETION).to_parquet(str(tmp_path / "rows.parquet"))
    Dataset.from_list(PROMPT_COMPLETION).to_csv(str(tmp_path / "rows.csv"), index=False)
    for name in ("rows.parquet", "rows.csv"):
        task = task_config("chat", path=str(tmp_path / name)).build()
        assert [(ex.question, ex.solution) for ex in task.train_examples()] == [
            (r["prompt"], r["completion"]) for r in PROMPT_COMPLETION]


def test_every_column_of_a_row_is_kept_for_reward_functions(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"prompt": "2+2?", "tests": ["assert f() == 4"], "level": 3}) + "\n")
    [ex] = task_config("chat", path=str(path)).build().train_examples()
    assert ex.columns == {"prompt": "2+2?", "tests": ["assert f() == 4"], "level": 3}
    assert ex.row.format == "prompt" and ex.solution == ""


# ---------------------------------------------------------------------------------------------
# Bad input: one line naming the file and row


@pytest.mark.parametrize("rows, message", [
    ([{"messages": [{"role": "user", "content": "hi"}, {"role": "robot", "content": "x"}]}],
     r"rows.jsonl:1: 'messages' message 1 has role 'robot'"),
    ([{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x"}]}, {"messages": None}],
     r"rows.jsonl:2: 'messages' must be a non-empty list"),
    ([{"prompt": "a", "completion": "b"}, {"prompt": None, "completion": "c"}], r"rows.jsonl:2: missing 'prompt'"),
    ([{"question": "a"}], r"expected a 'messages', 'prompt' .* or 'text' column"),
])
def test_bad_rows_are_one_line_naming_the_row(rows, message, tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DataError, match=message) as err:
        task_config("chat", path=str(path)).build()
    assert "\n" not in str(err.value)


def test_a_conversation_without_an_assistant_turn_has_nothing_to_train(tmp_path):
    with pytest.raises(DataError, match=r"rows.jsonl:1: no token is in the loss .*no assistant turn"):
        ours([{"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]}],
             chatml_tokenizer(), tmp_path)


def test_an_unreadable_file_is_one_line_naming_it(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"prompt": "a", "completion": "b"}\n{not json\n')
    with pytest.raises(DataError, match=r"rows.jsonl: could not read split 'train'") as err:
        task_config("chat", path=str(path)).build()
    assert "\n" not in str(err.value)


def test_parse_row_keeps_the_trailing_assistant_turns_as_the_completion():
    row = parse_row(CONVERSATIONS[0], "messages")
    assert [m["role"] for m in row.prompt] == ["system", "user", "assistant", "user"]
    assert [m["content"] for m in row.completion] == ["see you"]
    with pytest.raises(DataError, match="prompt-only row has no completion"):
        row_tokens(parse_row({"prompt": "a"}, "prompt"), build_char_tokenizer(), False, "assistant")

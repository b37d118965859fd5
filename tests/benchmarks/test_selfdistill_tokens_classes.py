"""benchmarks/selfdistill_tokens.py's token classes on hand-built completions: on the reference's path,
the first wrong token (where the student errs), and everything after it (off the path)."""
from __future__ import annotations

from benchmarks.selfdistill_tokens import classes_of
from models.tokenizer import build_char_tokenizer

TOK = build_char_tokenizer()


def ids(text: str) -> list[int]:
    return TOK(text, add_special_tokens=False).input_ids + [TOK.eos_token_id]


def test_the_first_wrong_token_is_its_own_class_and_the_rest_is_off():
    reference = ids("12+3=15\n#### 15")
    got = classes_of(TOK, reference, ids("12+3=16\n#### 16"))
    assert got == ["working, on"] * 6 + ["first error, on"] + ["off"] * 9


def test_an_error_in_the_answer_line_and_a_right_completion():
    reference = ids("12+3=15\n#### 15")
    assert classes_of(TOK, reference, reference) == ["working, on"] * 8 + ["answer line, on"] * 7 + ["end, on"]
    got = classes_of(TOK, reference, ids("12+3=15\n#### 14"))
    assert got == ["working, on"] * 8 + ["answer line, on"] * 6 + ["first error, on", "off"]  # "#### 1" was right
    longer = classes_of(TOK, reference, ids("12+3=15\n#### 150"))  # a token past the reference's end
    assert longer[-3:] == ["answer line, on", "first error, on", "off"]

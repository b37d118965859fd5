"""data=chat through train.py: conversational rows trained as written on the tiny model, the held-out loss as
the eval figure, and a bad row refused in one line before anything is written."""
from __future__ import annotations

import json

import pytest

from tests.conftest import tiny_config, tiny_overrides

NAMES = ["ann", "bob", "cat", "dan", "eve", "fay", "gus", "hal", "ivy", "jon", "kim", "lou", "max", "ned",
         "oli", "pam", "quin", "rex", "sue", "tom", "uma", "vic", "wes", "xia"]


def conversations(path, names=NAMES):
    """Replies with no number in them: nothing for an answer extractor to find."""
    rows = [{"messages": [{"role": "system", "content": "be kind."},
                          {"role": "user", "content": f"greet {n}."},
                          {"role": "assistant", "content": f"hello {n}, nice to meet you!"}]} for n in names]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def records(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_sft_on_chat_rows_lowers_the_held_out_loss_and_reports_no_accuracy(tmp_path, capsys):
    from trainer.distributed import World
    from trainer.loop import fit
    from trainer.setup import build_session

    data = conversations(tmp_path / "chat.jsonl")
    cfg = tiny_config(tmp_path / "run", "data=chat", f"data.path={data}", "data.test_fraction=0.25",
                      "trainer.max_steps=30", "trainer.eval_every=30", "trainer.lr=1e-2")
    session = build_session(cfg, World())
    ex = session.task.train_examples()[0]
    ids, mask = session.task.row_tokens(ex)
    trained = session.tokenizer.decode([i for i, m in zip(ids, mask) if m])
    assert trained == ex.solution + "\n<eos>" and "####" not in trained  # the reply as written, then EOS
    assert fit(session) == "done"
    evals = [r for r in records(tmp_path / "run") if r["split"] == "eval"]
    assert [r["step"] for r in evals] == [0, 30]
    assert all("accuracy" not in r and r["n"] == 6 for r in evals)
    assert evals[-1]["loss"] < 0.7 * evals[0]["loss"], evals


def test_train_py_summarises_the_held_out_loss(tmp_path, capsys):
    import train

    data = conversations(tmp_path / "chat.jsonl")
    code = train.main(tiny_overrides(tmp_path / "run", "data=chat", f"data.path={data}", "data.test_fraction=0.25",
                                     "trainer.max_steps=2", "trainer.eval_every=2"))
    assert code == 0
    assert "held-out loss (n=6, " in capsys.readouterr().out
    import evaluate  # the export evaluated the same way: its held-out loss, no accuracy without answers

    assert evaluate.main([f"model.path={tmp_path / 'run' / 'final'}", "data=chat", f"data.path={data}",
                          "data.test_fraction=0.25"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(result) == {"loss", "loss_tokens", "n"} and result["n"] == 6
    last = [r for r in records(tmp_path / "run") if r["split"] == "eval"][-1]  # the same weights, rows and split
    assert result["loss"] == pytest.approx(last["loss"], rel=1e-4) and result["loss_tokens"] == last["loss_tokens"]


@pytest.mark.parametrize("row, message", [
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "narrator", "content": "x"}]},
     "chat.jsonl:25: 'messages' message 1 has role 'narrator'; expected one of system, user, assistant, tool"),
    ({"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]},
     "chat.jsonl:25: no token is in the loss (data.loss_on=assistant): the row has no assistant turn"),
])
def test_a_bad_row_exits_3_with_one_line_and_writes_nothing(tmp_path, capsys, row, message):
    import train

    data = conversations(tmp_path / "chat.jsonl")
    data.write_text(data.read_text() + json.dumps(row) + "\n")
    out = tmp_path / "run"
    code = train.main(tiny_overrides(out, "data=chat", f"data.path={data}", "data.test_fraction=0.25",
                                     "data.seed=3", "trainer.max_steps=2"))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 3 and err[-1] == f"data error: {message}"
    assert not out.exists()

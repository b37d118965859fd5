"""The OpenAI-compatible server (inference/server.py) live on 127.0.0.1, spoken to with the official
`openai` client: greedy answers equal the CLI's, streamed chunks join to the whole text, chat goes through
the tokenizer's template, concurrent requests equal their sequential answers, echoed log-probabilities are
the model's own, every bad input is a 4xx naming its field while the server keeps serving, and SIGTERM
lets a request in flight finish and exits 0."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch

from tests.conftest import ROOT

pytestmark = pytest.mark.slow  # live servers in subprocesses: about 50 s in all
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(model_dir, *extra: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "inference.server", str(model_dir), "--port", str(port),
                             "--served-model-name", "tiny", "--device", "cpu", *extra],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while time.time() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited {proc.returncode}: {proc.stderr.read()[-3000:]}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if json.load(r) == {"status": "ok"}:
                    return proc, url
        except (urllib.error.URLError, ConnectionError, OSError):
            time.sleep(0.3)
    proc.kill()
    raise AssertionError("server did not come up in 120 s")


def stop(proc: subprocess.Popen) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory, model_dir):
    """The tiny export with a chat template on its tokenizer."""
    import shutil

    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("chat")
    shutil.copytree(model_dir, path, dirs_exist_ok=True)
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def live(chat_dir):
    proc, url = start(chat_dir)
    yield url, openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    assert stop(proc) == 0


def cli(model_dir, prompt: str, *flags: str) -> str:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-m", "inference", str(model_dir), "--prompt", prompt, "--device", "cpu",
                          *flags], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout[:-1]  # print's newline


def post(url: str, path: str, body, raw: bytes | None = None) -> tuple[int, dict]:
    data = raw if raw is not None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as err:
        return err.code, json.load(err)


def test_greedy_completion_and_chat_equal_the_cli(live, chat_dir):
    url, client = live
    assert [m.id for m in client.models.list().data] == ["tiny"]
    out = client.completions.create(model="tiny", prompt="12+7=", max_tokens=24, temperature=0)
    assert out.choices[0].text == cli(chat_dir, "12+7=", "--no-chat", "--max-new-tokens", "24")
    assert out.usage.prompt_tokens == 5 and out.usage.completion_tokens <= 24
    assert out.choices[0].finish_reason in ("stop", "length")
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi there"}],
                                          max_tokens=24, temperature=0)
    assert chat.choices[0].message.content == cli(chat_dir, "hi there", "--chat", "--max-new-tokens", "24")
    assert chat.choices[0].message.role == "assistant"


def test_streamed_chunks_join_to_the_whole_text(live):
    url, client = live
    whole = client.completions.create(model="tiny", prompt="ab", max_tokens=30, temperature=0).choices[0]
    chunks = list(client.completions.create(model="tiny", prompt="ab", max_tokens=30, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == whole.text
    assert chunks[-1].choices[0].finish_reason == whole.finish_reason
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "q"}], max_tokens=20,
                                          temperature=0)
    parts = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "q"}],
                                                max_tokens=20, temperature=0, stream=True))
    assert "".join(p.choices[0].delta.content or "" for p in parts) == chat.choices[0].message.content


def test_stop_strings_seeds_and_n(live):
    url, client = live
    whole = client.completions.create(model="tiny", prompt="xy", max_tokens=30, temperature=0).choices[0].text
    assert len(whole) > 3
    stop = whole[2:4]  # a string the greedy text contains: the answer ends just before it
    cut = client.completions.create(model="tiny", prompt="xy", max_tokens=30, temperature=0, stop=[stop]).choices[0]
    assert cut.text == whole[:whole.find(stop)] and cut.finish_reason == "stop"
    a = client.completions.create(model="tiny", prompt="xy", max_tokens=20, temperature=1.0, seed=3, n=3)
    b = client.completions.create(model="tiny", prompt="xy", max_tokens=20, temperature=1.0, seed=3, n=3)
    assert [c.text for c in a.choices] == [c.text for c in b.choices] and len(a.choices) == 3  # the seed decides


def test_concurrent_requests_each_equal_their_sequential_answer(live):
    url, client = live
    prompts = [f"{i}+{i * 3}=" for i in range(16)]
    alone = [client.completions.create(model="tiny", prompt=p, max_tokens=16, temperature=0).choices[0].text
             for p in prompts]
    together: list[str | None] = [None] * 16

    def ask(i: int) -> None:
        together[i] = client.completions.create(model="tiny", prompt=prompts[i], max_tokens=16,
                                                temperature=0).choices[0].text

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert together == alone


def test_echoed_prompt_logprobs_are_the_models_own(live, chat_dir):
    from transformers import AutoModelForCausalLM

    url, client = live
    ids = [5, 9, 14, 3, 22, 7]
    out = client.completions.create(model="tiny", prompt=ids, max_tokens=0, echo=True, logprobs=2, temperature=0)
    lp = out.choices[0].logprobs
    model = AutoModelForCausalLM.from_pretrained(chat_dir).eval()
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    assert lp.token_logprobs[0] is None and len(lp.token_logprobs) == len(ids)
    for t in range(1, len(ids)):
        assert lp.token_logprobs[t] == pytest.approx(ref[t - 1, ids[t]].item(), abs=1e-4)
        assert max(lp.top_logprobs[t].values()) == pytest.approx(ref[t - 1].max().item(), abs=1e-4)
    gen = client.completions.create(model="tiny", prompt=ids, max_tokens=5, logprobs=0, temperature=0).choices[0]
    assert len(gen.logprobs.token_logprobs) == len(gen.logprobs.tokens) >= 1
    assert all(x <= 0 for x in gen.logprobs.token_logprobs)


@pytest.mark.parametrize("path,body,status,param", [
    ("/v1/completions", {"model": "tiny", "prompt": "a", "max_tokens": "many"}, 400, "max_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": "a", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": "a", "max_tokens": 1000}, 400, "max_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": "a" * 300, "max_tokens": 1}, 400, "prompt"),
    ("/v1/completions", {"model": "other", "prompt": "a"}, 404, "model"),
    ("/v1/completions", {"model": "tiny", "prompt": "a", "n": 99}, 400, "n"),
    ("/v1/completions", {"model": "tiny", "prompt": "a", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"model": "tiny", "prompt": "a", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"model": "tiny", "prompt": "a", "presence_penalty": 1.0}, 400, "presence_penalty"),
    ("/v1/completions", {"model": "tiny", "prompt": [1, "x"]}, 400, "prompt"),
    ("/v1/completions", {"model": "tiny"}, 400, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": [99999]}, 400, "prompt"),
    ("/v1/chat/completions", {"model": "tiny", "messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": 3}]}, 400,
     "messages[0].content"),
])
def test_bad_input_is_a_4xx_naming_the_field_and_the_server_keeps_serving(live, path, body, status, param):
    url, client = live
    code, answer = post(url, path, body)
    assert code == status, answer
    assert answer["error"]["param"] == param and param.split("[")[0] in answer["error"]["message"]
    assert set(answer["error"]) == {"message", "type", "param", "code"}
    assert client.completions.create(model="tiny", prompt="ok", max_tokens=2, temperature=0).choices[0].text is not None


def test_malformed_json_and_a_template_less_model(live, model_dir):
    url, _ = live
    code, answer = post(url, "/v1/completions", None, raw=b"{not json")
    assert code == 400 and "malformed JSON" in answer["error"]["message"]
    proc, plain = start(model_dir)  # the char tokenizer without a chat template
    try:
        code, answer = post(plain, "/v1/chat/completions", {"model": "tiny", "messages": [
            {"role": "user", "content": "hi"}]})
        assert code == 400 and "no chat template" in answer["error"]["message"]
        assert post(plain, "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2})[0] == 200
    finally:
        assert stop(proc) == 0


def test_sigterm_lets_the_request_in_flight_finish_and_exits_0(model_dir):
    proc, url = start(model_dir)
    answer = {}

    def long_request() -> None:
        answer["reply"] = post(url, "/v1/completions", {"model": "tiny", "prompt": "go", "max_tokens": 200,
                                                        "n": 16, "temperature": 1.0, "seed": 0})

    t = threading.Thread(target=long_request)
    t.start()
    time.sleep(1.0)
    assert stop(proc) == 0
    t.join(60)
    code, body = answer["reply"]
    assert code == 200 and len(body["choices"]) == 16


class HeldServer:
    """A stand-in for the door's Server: its first engine call waits until released, every call is recorded."""

    def __init__(self, tok):
        from inference.engine import EngineConfig
        from types import SimpleNamespace

        self.tokenizer, self.calls, self.release = tok, [], threading.Event()
        self.model = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=256))
        self.options = SimpleNamespace(engine=EngineConfig(), device="cpu")

    def params(self, **fields):
        from inference.sampling import SamplingParams

        return SamplingParams(**fields)

    def generate(self, rows, params, generator=None):
        from inference.rollout import Completion

        self.calls.append((len(rows), params.temperature))
        self.release.wait(30)
        return [Completion(tokens=list(r[-2:]), logprobs=[0.0, 0.0], finish_reason="length") for r in rows]


def test_requests_waiting_while_a_batch_decodes_share_the_next_engine_call():
    from inference.server import Backend, Sampling
    from models.tokenizer import build_char_tokenizer

    held = HeldServer(build_char_tokenizer())
    backend = Backend(held, "tiny", max_batch=8)
    greedy = Sampling(max_tokens=4, temperature=0.0, top_p=1.0, n=1, stop=[], seed=None, stream=False, logprobs=None)
    seeded = Sampling(max_tokens=4, temperature=1.0, top_p=1.0, n=2, stop=[], seed=7, stream=False, logprobs=None)
    first = backend.submit([[5, 6, 7]], greedy)
    deadline = time.time() + 10
    while not held.calls and time.time() < deadline:  # the engine thread holds the first request
        time.sleep(0.01)
    waiting = [backend.submit([[5, 6, 7 + i]], greedy) for i in range(10)]  # 10 rows: 8 fit the next call
    alone = backend.submit([[9, 9]], seeded)  # a seeded sample never shares its call
    assert backend.waiting == 11
    held.release.set()
    answers = [f.result(30) for f in [first, *waiting, alone]]
    assert held.calls == [(1, 0.0), (8, 0.0), (2, 0.0), (2, 1.0)]  # oldest first; the rest in order, max_batch 8
    assert [a[0]["tokens"] for a in answers[1:11]] == [[6, 7 + i] for i in range(10)]  # each its own rows back
    assert len(answers[11]) == 2 and backend.batches == 4 and backend.served == 12


def test_a_streamed_request_whose_client_leaves_frees_its_rows_for_the_rest_of_the_batch(make_model):
    """Backend level, on the real engine: a streamed request gets its tokens as they decode; once its client
    is gone its rows end at the next step (finish reason abort) while the greedy request sharing its engine
    call decodes on to the answer it gets alone."""
    from concurrent.futures import Future

    from inference.server import Backend, Job, Sampling
    from inference.serving import serve_model
    from models.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    model = make_model("qwen3", vocab_size=len(tok))
    backend = Backend(serve_model(model, tokenizer=tok), "tiny")
    greedy = Sampling(max_tokens=40, temperature=0.0, top_p=1.0, n=1, stop=[], seed=None, stream=False, logprobs=None)
    prompt = tok("q: 12+7?", add_special_tokens=False).input_ids
    alone = backend.submit([prompt], greedy).result(60)[0]
    assert alone["finish_reason"] == "length" and len(alone["tokens"]) == 40  # the precondition: no early stop
    got: list[list[int]] = []
    job = Job([prompt], Sampling(**{**greedy.__dict__, "stream": True}), Future())

    def push(index: int, tokens: list[int]) -> None:
        got.append(tokens)
        job.cancelled = len(got) >= 3  # the client reads three chunks, then goes away

    job.push = push
    beside = Job([prompt], greedy, Future())
    with backend.ready:  # both queued before the engine thread looks: one engine call
        backend.jobs.extend([job, beside])
        backend.ready.notify()
    streamed, other = job.future.result(60)[0], beside.future.result(60)[0]
    assert backend.batches == 2  # the lone request, then the two together
    # the client saw three tokens; the step decoding when it left ran on, and its row ended right after
    assert sum(got, []) == alone["tokens"][:3] and backend.aborted == 1
    assert streamed["finish_reason"] == "abort" and streamed["tokens"] == alone["tokens"][:4]
    assert other["tokens"] == alone["tokens"] and other["finish_reason"] == "length"


def test_a_client_that_disconnects_mid_stream_ends_its_request(live):
    """Over HTTP: a streamed request of 16 long rows whose client reads its first chunk and closes the
    connection is ended mid-decode (/metrics `aborted`), and the server answers the next request."""
    import http.client
    from urllib.parse import urlparse

    url, client = live
    before = post_get(url, "/metrics")["aborted"]
    where = urlparse(url)
    conn = http.client.HTTPConnection(where.hostname, where.port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps({"model": "tiny", "prompt": "go", "max_tokens": 200, "n": 16,
                                                        "temperature": 1.0, "seed": 0, "stream": True}),
                 {"content-type": "application/json"})
    reply = conn.getresponse()
    assert reply.status == 200 and reply.readline().startswith(b"data: {")
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    deadline = time.time() + 60
    while post_get(url, "/metrics")["aborted"] == before and time.time() < deadline:
        time.sleep(0.2)
    assert post_get(url, "/metrics")["aborted"] == before + 1
    out = client.completions.create(model="tiny", prompt="ab", max_tokens=8, temperature=0)
    assert out.choices[0].finish_reason in ("stop", "length")


def post_get(url: str, path: str) -> dict:
    with urllib.request.urlopen(url + path, timeout=30) as r:
        return json.load(r)

"""An OpenAI-compatible HTTP server over the serving door: `python -m inference.server DIR`.

DIR opens through `load_served` exactly as `python -m inference DIR` opens it (a full model, a LoRA
adapter dir, a quantized export on the low-bit path, an export with a layer skipper; `--adapter`,
`--skipper`, `--speculative seed|external`, `--drafter`, `--skip-mode`, `--dtype`), so every request
decodes with the export's fast paths. Endpoints:

- `GET /health`, `GET /v1/models`, `GET /metrics` (the door's stats: completions, tokens, tokens/s, the
  speculative acceptance length, the skipped share of routed layer-tokens; requests served, waiting);
- `POST /v1/completions`: `prompt` (a string, a list of strings, token ids, or a list of token-id lists),
  `max_tokens` (default 16), `temperature` (default 1), `top_p`, `stop` (a string or up to 16), `seed`, `n`,
  `stream`, `logprobs` (0-5 alternatives per token) and `echo` (the prompt's tokens and, with `logprobs`,
  their log-probabilities; `max_tokens=0` with `echo` scores the prompt alone, what log-likelihood
  harnesses send);
- `POST /v1/chat/completions`: `messages` rendered by the tokenizer's chat template (400 when it has
  none), `max_tokens` / `max_completion_tokens`, the same sampling fields, `logprobs` + `top_logprobs`.

Completion text is the decoded tokens without special tokens, cut before the first `stop` string
(finish_reason `stop`; `length` when `max_tokens` ran out). Log-probabilities are the model's own
(`log_softmax` of its logits, temperature 1) from one forward of the prompt and completion, the
trainer's log-prob contract. `stream=true` sends OpenAI's server-sent-event chunks as the tokens decode
(the text held back only where a stop string or a half-decoded character may still be forming), then
`data: [DONE]`; a client that disconnects mid-stream ends its rows at the next decode step, freeing their
place in the batch (finish reason `abort`, counted under `/metrics` `aborted`). A stream that asks for
`logprobs` is sent after its tokens are scored, one chunk per token.

One thread calls the engine. Requests queue (at most `--max-waiting`; more: 503), and each engine call
decodes the oldest one together with every waiting request that can share the call (greedy ones with the
same `max_tokens` and `stop`; sampled ones without a seed and with the same sampling fields), up to
`--max-batch` rows: requests that arrive while a batch decodes form the next batch. Bad input -- malformed JSON, a wrong type or value, a prompt or
`max_tokens` past the model's positions, `n` above `--max-n`, an unsupported sampling field -- is a 400
in OpenAI's error JSON (`{"error": {"message", "type", "param", "code"}}`) naming the field, an unknown
model a 404; the server keeps serving. SIGTERM stops accepting, lets requests in flight finish (up to
`--graceful-s` seconds) and exits 0. It binds 127.0.0.1 unless `--host` says otherwise.

    python -m inference.server runs/x/final --port 8000
    python -m inference.server runs/x/final --speculative seed --served-model-name tiny
    curl -s 127.0.0.1:8000/v1/completions -H 'content-type: application/json' \\
        -d '{"model": "runs/x/final", "prompt": "12+7=", "max_tokens": 16, "temperature": 0}'
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import signal
import sys
import threading
import time
import uuid
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Iterator

import torch
import uvicorn
from fastapi import FastAPI, Request  # module level: the handlers' annotations must resolve here
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

EXIT_USAGE = 2
MAX_STOP = 16  # stop strings per request (OpenAI allows 4; harnesses send more, as vLLM allows)
MAX_LOGPROBS = 5  # OpenAI's limit on alternatives per token (completions)
MAX_TOP_LOGPROBS = 20  # chat's top_logprobs limit
UNSUPPORTED = (("presence_penalty", 0), ("frequency_penalty", 0), ("logit_bias", None), ("suffix", None),
               ("tools", None), ("functions", None), ("response_format", None))  # fields we cannot honour, neutral values


class APIError(Exception):
    """A request the server refuses: HTTP `status`, OpenAI's error fields."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def bad(param: str, message: str) -> APIError:
    return APIError(400, f"{param}: {message}", param)


# ----------------------------------------------------------------------------- request fields


def _field(body: dict, name: str, kinds: tuple, default: Any = None, what: str = "") -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in kinds:  # JSON true is no number
        raise bad(name, f"expected {what or kinds[0].__name__}, got a boolean")
    if not isinstance(value, kinds):
        raise bad(name, f"expected {what or kinds[0].__name__}, got {type(value).__name__}")
    return value


@dataclass
class Sampling:
    """The sampling fields of one request, checked."""

    max_tokens: int
    temperature: float
    top_p: float
    n: int
    stop: list[str]
    seed: int | None
    stream: bool
    logprobs: int | None  # alternatives per token; None: no log-probabilities
    echo: bool = False


def parse_sampling(body: dict, max_n: int, chat: bool) -> Sampling:
    for name, neutral in UNSUPPORTED:
        if name in body and body[name] not in (neutral, None, {}, []):
            raise bad(name, f"not supported by this server (send {neutral!r} or leave it out)")
    if chat:
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        max_name = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
        default_max = 256
    else:
        max_tokens, max_name, default_max = body.get("max_tokens"), "max_tokens", 16
    max_tokens = _field({max_name: max_tokens}, max_name, (int,), default_max, "an integer")
    temperature = float(_field(body, "temperature", (int, float), 1.0, "a number"))
    if not 0.0 <= temperature <= 2.0 or math.isnan(temperature):
        raise bad("temperature", f"must be in [0, 2], got {temperature}")
    top_p = float(_field(body, "top_p", (int, float), 1.0, "a number"))
    if not 0.0 < top_p <= 1.0:
        raise bad("top_p", f"must be in (0, 1], got {top_p}")
    n = _field(body, "n", (int,), 1, "an integer")
    if not 1 <= n <= max_n:
        raise bad("n", f"must be in [1, {max_n}] on this server, got {n}")
    best_of = _field(body, "best_of", (int,), n, "an integer")
    if best_of != n:
        raise bad("best_of", f"only best_of = n ({n}) is supported, got {best_of}")
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    elif not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise bad("stop", "expected a string or a list of strings")
    if len(stop) > MAX_STOP or any(not s for s in stop):
        raise bad("stop", f"at most {MAX_STOP} non-empty strings, got {stop!r}")
    seed = _field(body, "seed", (int,), None, "an integer")
    stream = _field(body, "stream", (bool,), False, "a boolean")
    if chat:
        wants = _field(body, "logprobs", (bool,), False, "a boolean")
        top = _field(body, "top_logprobs", (int,), 0, "an integer")
        if not 0 <= top <= MAX_TOP_LOGPROBS:
            raise bad("top_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got {top}")
        if top and not wants:
            raise bad("top_logprobs", "needs logprobs=true")
        logprobs, echo = (top if wants else None), False
    else:
        logprobs = _field(body, "logprobs", (int,), None, "an integer")
        if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
            raise bad("logprobs", f"must be in [0, {MAX_LOGPROBS}], got {logprobs}")
        echo = _field(body, "echo", (bool,), False, "a boolean")
    if max_tokens < 0 or (max_tokens == 0 and not echo):
        raise bad(max_name, f"must be >= 1 (0 only with echo=true), got {max_tokens}")
    if echo and stream:
        raise bad("echo", "echo with stream is not supported")
    return Sampling(max_tokens, temperature, top_p, n, stop, seed, stream, logprobs, echo)


def parse_prompts(body: dict) -> list[Any]:
    """`prompt` as a list of prompts, each a string or a list of token ids."""
    if "prompt" not in body:
        raise bad("prompt", "required")
    prompt = body["prompt"]
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(x, int) and not isinstance(x, bool) for x in prompt):
            return [prompt]
        if all(isinstance(x, str) for x in prompt):
            return list(prompt)
        if all(isinstance(x, list) and x and all(isinstance(t, int) and not isinstance(t, bool) for t in x)
               for x in prompt):
            return list(prompt)
    raise bad("prompt", "expected a non-empty string, list of strings, list of token ids or list of token-id lists")


def parse_messages(body: dict) -> list[dict[str, str]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "expected a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad(f"messages[{i}]", "expected an object with a string role")
        content = m.get("content")
        if isinstance(content, list):  # content parts: only text ones
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise bad(f"messages[{i}].content", "only text content parts are supported")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise bad(f"messages[{i}].content", "expected a string or a list of text parts")
        out.append({"role": m["role"], "content": content})
    return out


# ----------------------------------------------------------------------------- the model side


def model_logprobs(model: torch.nn.Module, ids: list[int], top: int) -> tuple[list[float | None], list[list]]:
    """Per position of `ids`: the model's log-probability of that token given the ones before it (None for
    the first) and its `top` most likely alternatives there [(token id, logprob), ...] (the trainer's
    log-prob contract: log_softmax of one forward's logits, fp32)."""
    device = next(model.parameters()).device
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids], device=device)).logits[0, :-1].float()
    logp = torch.log_softmax(logits, dim=-1)  # (T-1, V): position t predicts ids[t + 1]
    target = torch.tensor(ids[1:], device=device)
    picked = logp.gather(-1, target[:, None])[:, 0].tolist()
    alts: list[list] = [[]]
    if top:
        values, index = logp.topk(top, dim=-1)
        alts += [list(zip(i, v)) for i, v in zip(index.tolist(), values.tolist())]
    else:
        alts += [[] for _ in picked]
    return [None, *picked], alts


class Backend:
    """The served model behind one engine thread: requests queue (at most `max_waiting`), and each engine
    call decodes the oldest one together with every waiting request that can share the call."""

    def __init__(self, server: Any, name: str, max_n: int = 16, max_waiting: int = 64, max_batch: int = 64):
        self.server, self.name, self.max_n, self.max_waiting = server, name, max_n, max_waiting
        self.tokenizer = server.tokenizer
        self.max_batch = max_batch
        self.jobs: deque[Job] = deque()
        self.ready = threading.Condition()
        self.served = 0  # requests answered
        self.batches = 0  # engine calls
        self.aborted = 0  # streamed requests ended mid-decode because their client went away
        threading.Thread(target=self._loop, name="engine", daemon=True).start()
        self.rng = torch.Generator().manual_seed(int(time.time_ns() % (2**31)))
        config = getattr(server.model, "config", None)
        known = [p for p in (getattr(config, "max_position_embeddings", None), server.options.engine.max_seq_len)
                 if isinstance(p, int) and p > 0]
        self.positions = min(known) if known else None  # the model's positions, or the engine's cap if lower

    def encode(self, prompt: Any) -> list[int]:
        from models.prompts import prompt_ids

        return list(prompt) if isinstance(prompt, list) else prompt_ids(self.tokenizer, prompt)

    def chat_prompt(self, messages: list[dict[str, str]]) -> list[int]:
        from models.prompts import has_chat_template, prompt_ids

        if not has_chat_template(self.tokenizer):
            raise bad("messages", f"model {self.name!r} has no chat template: use /v1/completions with a prompt")
        try:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as err:  # the template's own refusal (e.g. roles out of order)
            raise bad("messages", f"the chat template refused them: {err}") from None
        return prompt_ids(self.tokenizer, text)

    def check(self, prompts: list[list[int]], s: Sampling, param: str) -> None:
        vocab = len(self.tokenizer)
        for ids in prompts:
            if not ids:
                raise bad(param, "a prompt is empty")
            if any(not 0 <= t < vocab for t in ids):
                raise bad(param, f"token ids must be in [0, {vocab})")
            if self.positions is not None and len(ids) + s.max_tokens > self.positions:
                if len(ids) >= self.positions:
                    raise bad(param, f"{len(ids)} tokens: longer than the model's {self.positions} positions")
                raise bad("max_tokens", f"{len(ids)} prompt tokens + max_tokens {s.max_tokens} exceed the model's "
                          f"{self.positions} positions")

    def submit(self, prompts: list[list[int]], s: Sampling) -> Future:
        """Queue a request (each prompt completed n times); its future gives one dict per choice with the
        completion's token ids, text, finish reason and, when asked, log-probabilities. APIError 503 past
        `max_waiting` queued requests."""
        return self.enqueue(Job(prompts, s, Future())).future

    def enqueue(self, job: "Job") -> "Job":
        """Queue `job` (a streamed one: its `push` gets each choice's tokens as they decode); APIError 503 past
        `max_waiting` queued requests."""
        with self.ready:
            if len(self.jobs) >= self.max_waiting:
                raise APIError(503, f"server busy: {len(self.jobs)} requests waiting (--max-waiting "
                               f"{self.max_waiting}); retry later", kind="server_error", code="overloaded")
            self.jobs.append(job)
            self.ready.notify()
        return job

    @property
    def waiting(self) -> int:
        return len(self.jobs)

    def _loop(self) -> None:
        """The one thread that calls the engine: each round takes the oldest request and every waiting one
        that can share its engine call (`batch_key`), up to `max_batch` rows, and decodes them together."""
        while True:
            with self.ready:
                while not self.jobs:
                    self.ready.wait()
                first = self.jobs.popleft()
                batch, rows, key = [first], len(first.prompts) * first.sampling.n, batch_key(first.sampling)
                if key is not None:
                    for job in list(self.jobs):
                        more = len(job.prompts) * job.sampling.n
                        if batch_key(job.sampling) == key and rows + more <= self.max_batch:
                            self.jobs.remove(job)
                            batch.append(job)
                            rows += more
            try:
                results = self._run(batch)
            except Exception as err:  # one bad round fails its requests, not the server
                for job in batch:
                    job.future.set_exception(err)
                continue
            for job, result in zip(batch, results):
                self.aborted += any(c["finish_reason"] == "abort" for c in result)  # ended mid-decode
                job.future.set_result(result)

    def _run(self, batch: list["Job"]) -> list[list[dict]]:
        tok = self.tokenizer
        s = batch[0].sampling
        rows = [ids for job in batch for ids in job.prompts for _ in range(job.sampling.n)]
        if s.max_tokens > 0:
            params = self.server.params(
                max_new_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p,
                stop_sequences=tuple(ids for ids in (tuple(tok(x, add_special_tokens=False).input_ids) for x in s.stop)
                                     if ids))
            seed = s.seed if s.seed is not None else int(torch.randint(0, 2**31 - 1, (1,), generator=self.rng))
            generator = torch.Generator(device=self.server.options.device).manual_seed(seed)
            owners = [(job, i) for job in batch for i in range(len(job.prompts) * job.sampling.n)]
            if any(job.push is not None for job in batch):
                completions = self.server.generate(rows, params, generator, on_round=self._watch(owners))
            else:
                completions = self.server.generate(rows, params, generator)
        else:
            completions = [None] * len(rows)
        self.batches += 1
        out, at = [], 0
        for job in batch:
            k = len(job.prompts) * job.sampling.n
            out.append(self._choices(rows[at:at + k], completions[at:at + k], job.sampling))
            at += k
            self.served += 1
        return out

    @staticmethod
    def _watch(owners: list[tuple["Job", int]]) -> Callable:
        """The engine's per-round hook for a batch with streamed requests: each streamed row's new tokens go
        to its job's `push`; the rows of a job whose client went away end now."""
        sent = [0] * len(owners)

        def on_round(run) -> set[int]:
            ended = set()
            for row, count in enumerate(run.progress()):
                job, index = owners[row]
                if job.cancelled:
                    ended.add(row)
                elif job.push is not None and count > sent[row]:
                    job.push(index, run.emitted(row, sent[row], count))
                    sent[row] = count
            return ended

        return on_round

    def _choices(self, rows: list[list[int]], completions: list, s: Sampling) -> list[dict]:
        tok = self.tokenizer
        choices = []
        for i, (ids, c) in enumerate(zip(rows, completions)):
            tokens = list(c.tokens) if c is not None else []
            text = tok.decode(tokens, skip_special_tokens=True)
            reason = c.finish_reason if c is not None else "length"
            cut = min((text.find(x) for x in s.stop if x in text), default=-1)
            if cut >= 0:  # OpenAI: the stop string ends the text and is not part of it
                text, reason = text[:cut], "stop"
                tokens = _tokens_within(tok, tokens, cut)
            choice = {"index": i, "tokens": tokens, "text": text, "finish_reason": reason, "prompt": ids}
            if s.logprobs is not None:
                lp, alts = model_logprobs(self.server.model, [*ids, *tokens], s.logprobs)
                choice["logprobs"], choice["alts"] = lp, alts
            choices.append(choice)
        return choices


@dataclass
class Job:
    prompts: list[list[int]]
    sampling: Sampling
    future: Future
    push: Callable[[int, list[int]], None] | None = None  # streamed: (choice index, new tokens), engine thread
    cancelled: bool = False  # its client went away: its rows end at the next decode step


class TextStream:
    """One streamed choice's text as its tokens arrive: what can be sent now, never past the first stop
    string nor into text that may still become one (the last len(longest stop) - 1 characters) or a
    character whose bytes have not all arrived; `rest(final)` is what is left of the final text."""

    def __init__(self, tok: Any, stops: list[str]):
        self.tok, self.stops = tok, stops
        self.hold = max((len(x) for x in stops), default=1) - 1
        self.tokens: list[int] = []
        self.sent, self.stopped = "", False

    def add(self, tokens: list[int]) -> str:
        if self.stopped:
            return ""
        self.tokens += tokens
        text = self.tok.decode(self.tokens, skip_special_tokens=True)
        cut = min((text.find(x) for x in self.stops if x in text), default=-1)
        if cut >= 0:
            text, self.stopped = text[:cut], True
        else:
            text = text.rstrip("\ufffd")
            text = text[: len(text) - self.hold] if self.hold else text
        return self._send(text)

    def rest(self, final: str) -> str:
        return self._send(final)

    def _send(self, text: str) -> str:
        if len(text) <= len(self.sent) or not text.startswith(self.sent):
            return ""
        piece, self.sent = text[len(self.sent):], text
        return piece


def batch_key(s: Sampling) -> tuple | None:
    """Requests with equal keys share one engine call; None: this one runs alone. Greedy requests batch
    with any greedy request of the same length limit and stops (their tokens do not depend on the batch);
    sampled ones only without a seed (a seed names one generator stream, which a shared call would split)."""
    if s.temperature > 0 and s.seed is not None:
        return None
    return (s.max_tokens, tuple(s.stop), s.temperature, s.top_p if s.temperature > 0 else 1.0)


def _tokens_within(tok: Any, tokens: list[int], chars: int) -> list[int]:
    """The shortest prefix of `tokens` whose text reaches `chars` characters (the tokens of the cut text)."""
    for k in range(len(tokens) + 1):
        if len(tok.decode(tokens[:k], skip_special_tokens=True)) >= chars:
            return tokens[:k]
    return tokens


# ----------------------------------------------------------------------------- responses


def _pieces(tok: Any, tokens: list[int]) -> list[str]:
    """Each token's text as the decoded prefix grows (so multi-token characters land whole)."""
    out, seen = [], ""
    for k in range(1, len(tokens) + 1):
        text = tok.decode(tokens[:k], skip_special_tokens=True)
        out.append(text[len(seen):] if text.startswith(seen) else text)
        seen = text
    return out


def completion_logprobs(tok: Any, c: dict, echo: bool) -> dict:
    """The completions API's logprobs object for one choice (prompt tokens first with echo)."""
    start = 0 if echo else len(c["prompt"])
    ids = [*c["prompt"], *c["tokens"]][start:]
    lps, alts = c["logprobs"][start:], c["alts"][start:]
    strings = [tok.decode([t]) for t in ids]
    offsets, at = [], 0
    for s in strings:
        offsets.append(at)
        at += len(s)
    top = [None if lp is None else {tok.decode([t]): v for t, v in a} for lp, a in zip(lps, alts)]
    return {"tokens": strings, "token_logprobs": lps, "top_logprobs": top, "text_offset": offsets}


def chat_logprobs(tok: Any, c: dict) -> dict:
    n = len(c["prompt"])
    content = []
    for t, lp, a in zip(c["tokens"], c["logprobs"][n:], c["alts"][n:]):
        piece = tok.decode([t])
        content.append({"token": piece, "logprob": lp, "bytes": list(piece.encode()),
                        "top_logprobs": [{"token": tok.decode([i]), "logprob": v, "bytes": list(tok.decode([i]).encode())}
                                         for i, v in a]})
    return {"content": content}


def usage(prompts: list[list[int]], choices: list[dict]) -> dict:
    p = sum(map(len, prompts))
    c = sum(len(x["tokens"]) for x in choices)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def sse(chunks: Iterator[dict]) -> Iterator[str]:
    for chunk in chunks:
        yield f"data: {json.dumps(chunk)}\n\n"
    yield "data: [DONE]\n\n"


async def sse_async(chunks: AsyncIterator[dict]) -> AsyncIterator[str]:
    async for chunk in chunks:
        yield f"data: {json.dumps(chunk)}\n\n"
    yield "data: [DONE]\n\n"


# ----------------------------------------------------------------------------- the app


def build_app(backend: Backend):
    """The FastAPI app over `backend`."""
    app = FastAPI(title="posttrain inference server")
    tok = backend.tokenizer

    @app.exception_handler(APIError)
    async def api_error(_: Request, err: APIError):
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, err: StarletteHTTPException):
        kind = "not_found_error" if err.status_code == 404 else "invalid_request_error"
        return JSONResponse(APIError(err.status_code, str(err.detail), kind=kind).body(), status_code=err.status_code)

    async def body_of(request: Request) -> dict:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as err:
            raise APIError(400, f"malformed JSON body: {err}") from None
        if not isinstance(body, dict):
            raise APIError(400, "the body must be a JSON object")
        model = body.get("model")
        if model is not None and model != backend.name:
            raise APIError(404, f"model {model!r} does not exist: this server serves {backend.name!r}", "model",
                           "not_found_error", "model_not_found")
        return body

    async def generate(prompts: list[list[int]], s: Sampling) -> list[dict]:
        return await asyncio.wrap_future(backend.submit(prompts, s))

    async def streamed(prompts: list[list[int]], s: Sampling) -> AsyncIterator[tuple[int, str, str | None]]:
        """(choice index, text, None) as tokens decode, then (index, the rest, finish reason) per choice.
        Leaving early (the client went away) ends the request's rows at the engine's next step."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        job = backend.enqueue(Job(prompts, s, Future(),
                                  push=lambda i, t: loop.call_soon_threadsafe(queue.put_nowait, (i, t))))
        done = asyncio.wrap_future(job.future)
        texts: dict[int, TextStream] = {}

        def text(index: int) -> TextStream:
            if index not in texts:
                texts[index] = TextStream(tok, s.stop)
            return texts[index]

        try:
            while True:
                get = asyncio.ensure_future(queue.get())
                await asyncio.wait({get, done}, return_when=asyncio.FIRST_COMPLETED)
                if not get.done():  # decoding ended: what is still queued is drained below
                    get.cancel()
                    break
                index, tokens = get.result()
                piece = text(index).add(tokens)
                if piece:
                    yield index, piece, None
            while not queue.empty():
                index, tokens = queue.get_nowait()
                piece = text(index).add(tokens)
                if piece:
                    yield index, piece, None
            for c in done.result():
                yield c["index"], text(c["index"]).rest(c["text"]), c["finish_reason"]
        finally:
            if not job.future.done():
                job.cancelled = True

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": backend.name, "object": "model", "created": 0,
                                            "owned_by": "posttrain", "max_model_len": backend.positions}]}

    @app.get("/metrics")
    async def metrics():
        st = backend.server.stats
        return {"requests": backend.served, "waiting": backend.waiting, "batches": backend.batches, "calls": st.calls,
                "completions": st.completions, "tokens": st.tokens, "seconds": st.seconds,
                "tokens_per_s": st.tokens_per_s(), "mean_accepted": st.mean_accepted,
                "skip_ratio": st.skip_ratio(), "aborted": backend.aborted}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await body_of(request)
        s = parse_sampling(body, backend.max_n, chat=False)
        prompts = [backend.encode(p) for p in parse_prompts(body)]
        backend.check(prompts, s, "prompt")
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        head = {"id": rid, "object": "text_completion", "created": created, "model": backend.name}
        if s.stream and s.logprobs is None:
            async def live():
                async for index, piece, reason in streamed(prompts, s):
                    if piece or reason:
                        yield {**head, "choices": [{"index": index, "text": piece, "logprobs": None,
                                                    "finish_reason": reason}]}

            return StreamingResponse(sse_async(live()), media_type="text/event-stream")
        choices = await generate(prompts, s)

        def out(c: dict) -> dict:
            text = (tok.decode(c["prompt"], skip_special_tokens=True) if s.echo else "") + c["text"]
            return {"index": c["index"], "text": text, "finish_reason": c["finish_reason"],
                    "logprobs": completion_logprobs(tok, c, s.echo) if s.logprobs is not None else None}

        if not s.stream:
            return {"id": rid, "object": "text_completion", "created": created, "model": backend.name,
                    "choices": [out(c) for c in choices], "usage": usage(prompts, choices)}

        def chunks():
            for c in choices:
                lp = completion_logprobs(tok, c, False) if s.logprobs is not None else None
                for k, piece in enumerate(_pieces(tok, c["tokens"])):
                    one = ({key: value[k:k + 1] for key, value in lp.items()} if lp else None)
                    yield {"id": rid, "object": "text_completion", "created": created, "model": backend.name,
                           "choices": [{"index": c["index"], "text": piece, "logprobs": one, "finish_reason": None}]}
                yield {"id": rid, "object": "text_completion", "created": created, "model": backend.name,
                       "choices": [{"index": c["index"], "text": "", "logprobs": None,
                                    "finish_reason": c["finish_reason"]}]}

        return StreamingResponse(sse(chunks()), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await body_of(request)
        s = parse_sampling(body, backend.max_n, chat=True)
        prompt = backend.chat_prompt(parse_messages(body))
        if body.get("max_tokens") is None and body.get("max_completion_tokens") is None and backend.positions:
            s.max_tokens = max(1, min(s.max_tokens, backend.positions - len(prompt)))  # default: what fits, <= 256
        backend.check([prompt], s, "messages")
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        if s.stream and s.logprobs is None:
            async def live():
                head, started = {"id": rid, "object": "chat.completion.chunk", "created": created,
                                 "model": backend.name}, set()
                async for index, piece, reason in streamed([prompt], s):
                    if index not in started:
                        started.add(index)
                        yield {**head, "choices": [{"index": index, "delta": {"role": "assistant", "content": ""},
                                                    "logprobs": None, "finish_reason": None}]}
                    if piece:
                        yield {**head, "choices": [{"index": index, "delta": {"content": piece}, "logprobs": None,
                                                    "finish_reason": None}]}
                    if reason:
                        yield {**head, "choices": [{"index": index, "delta": {}, "logprobs": None,
                                                    "finish_reason": reason}]}

            return StreamingResponse(sse_async(live()), media_type="text/event-stream")
        choices = await generate([prompt], s)
        if not s.stream:
            return {"id": rid, "object": "chat.completion", "created": created, "model": backend.name,
                    "choices": [{"index": c["index"], "message": {"role": "assistant", "content": c["text"]},
                                 "logprobs": chat_logprobs(tok, c) if s.logprobs is not None else None,
                                 "finish_reason": c["finish_reason"]} for c in choices],
                    "usage": usage([prompt], choices)}

        def chunks():
            head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": backend.name}
            for c in choices:
                yield {**head, "choices": [{"index": c["index"], "delta": {"role": "assistant", "content": ""},
                                            "logprobs": None, "finish_reason": None}]}
                for piece in _pieces(tok, c["tokens"]):
                    yield {**head, "choices": [{"index": c["index"], "delta": {"content": piece}, "logprobs": None,
                                                "finish_reason": None}]}
                yield {**head, "choices": [{"index": c["index"], "delta": {}, "logprobs": None,
                                            "finish_reason": c["finish_reason"]}]}

        return StreamingResponse(sse(chunks()), media_type="text/event-stream")

    return app


# ----------------------------------------------------------------------------- the command line


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m inference.server", description=__doc__.split("\n")[0])
    p.add_argument("model_dir", help="an export (or any HF model dir with its tokenizer)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None, help="the name requests use (default: model_dir as given)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, help="full-precision weights load in this dtype (default: as saved)")
    p.add_argument("--speculative", choices=("seed", "external"))
    p.add_argument("--drafter", metavar="DIR", help="drafter model dir (implies --speculative external)")
    p.add_argument("--draft-len", type=int, default=None)
    p.add_argument("--adapter", metavar="DIR", help="a PEFT (LoRA) adapter dir merged onto model_dir")
    p.add_argument("--skipper", metavar="DIR", help="a layer-skipper dir to serve on model_dir")
    p.add_argument("--no-skipper", action="store_true", help="ignore model_dir/skipper/")
    p.add_argument("--skip-mode", choices=("auto", "routed", "masked"), default="auto")
    p.add_argument("--max-n", type=int, default=16, help="the largest n a request may ask")
    p.add_argument("--max-waiting", type=int, default=64, help="requests queued at most; more get 503")
    p.add_argument("--max-batch", type=int, default=64, help="rows (prompts x n) one engine call decodes at most")
    p.add_argument("--graceful-s", type=int, default=30, help="on SIGTERM, wait this long for requests in flight")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from inference.__main__ import ADAPTER_CONFIG
    from models.model_dir import model_dir_problem

    for flag, path in (("model dir", args.model_dir), ("--drafter", args.drafter)):
        problem = model_dir_problem(path) if path else None
        if problem is not None:
            print(f"error: {flag}: {problem}", file=sys.stderr)
            return EXIT_USAGE
    if args.adapter and not os.path.exists(os.path.join(args.adapter, ADAPTER_CONFIG)):
        print(f"error: --adapter {args.adapter} is not a PEFT adapter dir (no {ADAPTER_CONFIG})", file=sys.stderr)
        return EXIT_USAGE
    if args.drafter and args.speculative is None:
        args.speculative = "external"
    from inference.engine import EngineConfig
    from inference.serving import ServeOptions, ServingError, load_served

    try:
        server = load_served(args.model_dir, ServeOptions(
            adapter=args.adapter, skipper=args.skipper, use_skipper=not args.no_skipper, speculative=args.speculative,
            drafter=args.drafter, draft_len=args.draft_len, device=args.device, dtype=args.dtype,
            engine=EngineConfig(skip_mode=args.skip_mode)))
    except ServingError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USAGE
    backend = Backend(server, args.served_model_name or args.model_dir, args.max_n, args.max_waiting, args.max_batch)
    config = uvicorn.Config(build_app(backend), host=args.host, port=args.port, log_level="warning",
                            timeout_graceful_shutdown=args.graceful_s)
    print(f"serving {args.model_dir} as {backend.name!r} on http://{args.host}:{args.port}/v1", flush=True)
    GracefulServer(config).run()
    return 0


class GracefulServer(uvicorn.Server):
    """uvicorn's server, but SIGTERM is the normal way to stop: after the graceful shutdown the process exits 0
    instead of re-raising the signal on itself."""

    def handle_exit(self, sig, frame) -> None:
        if sig == signal.SIGTERM:
            self.should_exit = True
            return
        super().handle_exit(sig, frame)


if __name__ == "__main__":
    sys.exit(main())

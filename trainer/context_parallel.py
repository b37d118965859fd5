"""AugTree context-parallel replay of ONE group (one prompt + G responses) across the ranks of a
process group (gloo on CPU, NCCL on GPU), with exact gradients through the communication.

A library function (`ContextParallel.logprobs`), not wired into the train loop: it is reached from
tests/trainer/test_context_parallel.py (through tests/trainer/cp_worker.py) and
benchmarks/augtree_bench.py. It needs a process group whose ranks all hold shards of the SAME prompt
group, while the loop's data-parallel split gives every rank different prompts (it splits per
prompt), so the loop has no such group; using it there needs a context-parallel dimension in how
the loop distributes data, which it does not have yet.

No module state. A `ContextParallel` holds the group and the mode; each `logprobs` call builds its
layout and, for the one model call, registers the attention function (bound to that call's state)
under a name of its own and switches the model to it, restoring the model's attention
implementation and dropping the registration on exit.

Placement (`cp_layout`, identical on every rank): the prompt is split into W contiguous shards
(rank r owns prompt[r*P//W : (r+1)*P//W]); every response is owned whole by one rank (longest first to
the least-loaded rank, every rank gets at least one). Each rank runs ONE forward of its local tokens
[prompt shard ; owned responses] with explicit position ids (responses start at P). Embeddings,
norms, MLPs and the head are token-local; only attention communicates, through an attention function
registered in transformers' attention-function registry (named "augtree_cp_<id>") that the model
is switched to for the call. Attention is computed as partials (O, L = log-sum-exp) in fp32 over key
blocks, merged
    L = logaddexp(L_a, L_b),  O = exp(L_a - L) O_a + exp(L_b - L) O_b
and autograd runs backward through the merge. Visibility: a prompt query sees prompt keys at or
before it; a response query sees the whole prompt and its own response causally.

Modes (chosen by `trainer.prompt_sharing.plan_replay`):
  lanes  (responses dominate): per layer the prompt-shard K/V rotate around the ring of the group's
         ranks (W-1 point-to-point steps, each an all_to_all_single with one non-empty split); every
         rank accumulates partials of all its queries against each arriving shard (online softmax).
         Response K/V never move (responses are whole on their rank). Backward: gradients of the
         rotated K/V travel the ring in reverse. Several lanes = several rings: create subgroups of
         `degree` ranks and call this once per lane with that lane's responses.
  owners (prompt dominates): the prompt K/V stay with their owners. Per layer one all_to_all_single
         sends each rank's prompt-shard K/V (needed by later shards' causal prefill) and its response
         queries to every later rank; each later owner computes fp32 partials (O, L) of those queries
         against its own stationary prompt shard and a second all_to_all_single returns them; the
         querying rank merges them with its local partial (own response + the earlier prompt shards
         already received for the prefill).
Both modes need every rank to run backward through a loss that uses every tensor returned to it
(zero weights are fine): the backward collectives must be called on all ranks in the same order.

    logps = ContextParallel("owners", group).logprobs(model, prompt_ids, responses)
    loss = sum(w[i] * lp.sum() for i, lp in enumerate(logps) if lp is not None); loss.backward()
    # parameter gradients are partial per rank: all_reduce(SUM) them (DDP does this) for the total
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from algorithms import losses
from models.anatomy import causal_lm, output_head
from trainer.prompt_sharing import _chunk, _features

ATTN_NAME = "augtree_cp"  # prefix of the names the attention function is registered under, one per call
CP_MODES = ("lanes", "owners")
_NEG = -1e30  # masked score (finite: fully masked blocks stay NaN-free and get zero merge weight)


# --- layout ---------------------------------------------------------------------------------------


@dataclass
class CPLayout:
    prompt_len: int
    response_lens: list[int]
    world: int
    bounds: list[tuple[int, int]]  # prompt shard [start, end) per rank
    owner: list[int]  # rank owning each response
    local: list[list[int]]  # responses of each rank, in local order

    def n_prompt(self, rank: int) -> int:
        s, e = self.bounds[rank]
        return e - s

    def n_resp(self, rank: int) -> int:
        return sum(self.response_lens[i] for i in self.local[rank])

    def meta(self, rank: int) -> tuple[Tensor, Tensor]:
        """(segment, position) of the rank's local tokens: segment 0 prompt, i + 1 response i."""
        s, e = self.bounds[rank]
        seg = [0] * (e - s)
        pos = list(range(s, e))
        for i in self.local[rank]:
            seg += [i + 1] * self.response_lens[i]
            pos += list(range(self.prompt_len, self.prompt_len + self.response_lens[i]))
        return torch.tensor(seg), torch.tensor(pos)

    def prompt_meta(self, rank: int) -> tuple[Tensor, Tensor]:
        s, e = self.bounds[rank]
        return torch.zeros(e - s, dtype=torch.long), torch.arange(s, e)


def cp_layout(prompt_len: int, response_lens: Sequence[int], world: int) -> CPLayout:
    """Prompt shards and response owners for `world` ranks (see the module docstring)."""
    G = len(response_lens)
    if prompt_len < world or G < world:
        raise ValueError(f"context parallel over {world} ranks needs prompt_len >= {world} and >= {world} "
                         f"responses (got {prompt_len}, {G}): every rank holds a prompt shard and a response")
    if min(response_lens) < 1:
        raise ValueError("responses must be non-empty")
    bounds = [(r * prompt_len // world, (r + 1) * prompt_len // world) for r in range(world)]
    load = [e - s for s, e in bounds]
    count = [0] * world
    owner = [0] * G
    for n_left, i in enumerate(sorted(range(G), key=lambda i: (-response_lens[i], i))):
        empty = [r for r in range(world) if count[r] == 0]
        cands = empty if G - n_left <= len(empty) else list(range(world))
        r = min(cands, key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += response_lens[i]
        count[r] += 1
    local = [[i for i in range(G) if owner[i] == r] for r in range(world)]
    return CPLayout(prompt_len, list(response_lens), world, bounds, owner, local)


# --- differentiable communication -----------------------------------------------------------------


class _AllToAll(torch.autograd.Function):
    """all_to_all_single along dim 0 with split sizes (rows) per rank; backward sends the gradients
    back the way the rows came (the same collective with the splits swapped)."""

    @staticmethod
    def forward(ctx, x: Tensor, send: list[int], recv: list[int], group) -> Tensor:
        ctx.send, ctx.recv, ctx.group = send, recv, group
        out = x.new_empty((sum(recv), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        out = grad.new_empty((sum(ctx.send), *grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), ctx.send, ctx.recv, group=ctx.group)
        return out, None, None, None


def all_to_all(x: Tensor, send: list[int], recv: list[int], group=None) -> Tensor:
    """Rows x[sum(send[:j]) : sum(send[:j+1])] go to rank j; returns the rows received, in rank order."""
    return _AllToAll.apply(x, list(send), list(recv), group)


# --- attention ------------------------------------------------------------------------------------


class _PartialAttention(torch.autograd.Function):
    """fp32 attention of q (H, Nq, D) over one key block k, v (H, Nk, D) with a boolean mask (Nq, Nk)
    (None: all visible), returning the partial (O (H, Nq, D), L (H, Nq) log-sum-exp). Backward
    recomputes the probabilities (nothing of size Nq x Nk is saved) and takes gradients of both O and L:
        ds = P * (dO V^T - rowsum(dO * O) + dL).
    Uses the fused softmax (exp of masked scores outside it is very slow on CPU); L = max - log(max P)."""

    @staticmethod
    def _probs(q, k, mask, scale):
        s = torch.matmul(q, k.transpose(-1, -2)) * scale
        if mask is not None:
            s = s.masked_fill(~mask, _NEG)
        return s, torch.softmax(s, dim=-1)

    @staticmethod
    def forward(ctx, q, k, v, mask, scale):
        qf, kf, vf = q.float(), k.float(), v.float()
        s, p = _PartialAttention._probs(qf, kf, mask, scale)
        lse = s.amax(dim=-1) - torch.log(p.amax(dim=-1))
        out = torch.matmul(p, vf)
        ctx.save_for_backward(q, k, v, out)
        ctx.mask, ctx.scale = mask, scale
        return out, lse

    @staticmethod
    def backward(ctx, d_out, d_lse):
        q, k, v, out = ctx.saved_tensors
        qf, kf, vf = q.float(), k.float(), v.float()
        _, p = _PartialAttention._probs(qf, kf, ctx.mask, ctx.scale)
        if d_out is None:
            d_out = torch.zeros_like(out)
        ds = torch.matmul(d_out, vf.transpose(-1, -2)) - (d_out * out).sum(-1, keepdim=True)
        if d_lse is not None:
            ds = ds + d_lse[..., None]
        ds = ds.mul_(p)
        dq = torch.matmul(ds, kf) * ctx.scale
        dk = torch.matmul(ds.transpose(-1, -2), qf) * ctx.scale
        dv = torch.matmul(p.transpose(-1, -2), d_out)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def _partial(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], scale: float) -> tuple[Tensor, Tensor]:
    """fp32 partial attention of q (H, Nq, D) over keys (H, Nk, D): (O (H, Nq, D), L (H, Nq))."""
    return _PartialAttention.apply(q, k, v, mask, scale)


def _merge(a: tuple[Tensor, Tensor], b: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
    (oa, la), (ob, lb) = a, b
    lse = torch.logaddexp(la, lb)
    return torch.exp(la - lse)[..., None] * oa + torch.exp(lb - lse)[..., None] * ob, lse


def _visible(q_meta: tuple[Tensor, Tensor], k_meta: tuple[Tensor, Tensor]) -> Tensor:
    (sq, pq), (sk, pk) = q_meta, k_meta
    return (pk[None] <= pq[:, None]) & ((sk[None] == 0) | (sk[None] == sq[:, None]))


@dataclass
class _CPCall:
    """What the attention function needs during one replay call: passed to it explicitly (bound
    when it is registered), never through module state."""

    mode: str
    group: object
    rank: int
    layout: CPLayout


def _rep(x: Tensor, n: int) -> Tensor:  # (Hkv, N, D) -> (Hkv * n, N, D), kv head j serving q heads j*n..
    return x if n == 1 else x.repeat_interleave(n, dim=0)


def _cp_attention(st: _CPCall, module, query: Tensor, key: Tensor, value: Tensor, attention_mask,
                  dropout: float = 0.0, scaling: Optional[float] = None, **kwargs):
    """The attention function (transformers' signature after the bound `st`) of one replay call."""
    if query.shape[0] != 1:
        raise ValueError("context-parallel replay runs one local sequence per rank")
    q, k, v = query[0], key[0], value[0]  # (H, N, D), (Hkv, N, D)
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    n_rep = q.shape[0] // k.shape[0]
    if q.shape[1] != st.layout.n_prompt(st.rank) + st.layout.n_resp(st.rank):
        raise RuntimeError("local sequence does not match the context-parallel layout")
    fn = _lanes_attention if st.mode == "lanes" else _owners_attention
    out, _ = fn(st, q, k, v, n_rep, scale)
    return out.to(query.dtype).transpose(0, 1)[None], None


def _lanes_attention(st: _CPCall, q, k, v, n_rep, scale):
    lay, r, W = st.layout, st.rank, st.layout.world
    q_meta = lay.meta(r)
    acc = _partial(q, _rep(k, n_rep), _rep(v, n_rep), _visible(q_meta, q_meta), scale)
    npr = lay.n_prompt(r)
    block = torch.cat([k[:, :npr], v[:, :npr]], dim=-1).transpose(0, 1)  # (n, Hkv, 2D): this rank's prompt K/V
    nxt, prv = (r + 1) % W, (r - 1) % W
    for step in range(1, W):
        src = (r - step) % W  # whose shard arrives now
        send, recv = [0] * W, [0] * W
        send[nxt] = lay.n_prompt((r - step + 1) % W)
        recv[prv] = lay.n_prompt(src)
        block = all_to_all(block, send, recv, st.group)
        kb, vb = block.transpose(0, 1).chunk(2, dim=-1)
        part = _partial(q, _rep(kb, n_rep), _rep(vb, n_rep), _visible(q_meta, lay.prompt_meta(src)), scale)
        acc = _merge(acc, part)
    return acc


def _owners_attention(st: _CPCall, q, k, v, n_rep, scale):
    lay, r, W = st.layout, st.rank, st.layout.world
    H, N, D = q.shape
    Hkv = k.shape[0]
    npr = lay.n_prompt(r)
    # 1) to every later rank: this rank's prompt K/V (causal prefill) + its response queries
    kv_rows = torch.cat([k[:, :npr], v[:, :npr]], dim=-1).transpose(0, 1).reshape(-1)  # (npr*Hkv*2D,)
    q_rows = q[:, npr:].transpose(0, 1).reshape(-1)  # (nresp*H*D,)
    msg = torch.cat([kv_rows, q_rows])
    later = list(range(r + 1, W))
    send = [msg.numel() if j > r else 0 for j in range(W)]
    kv_size = [lay.n_prompt(j) * Hkv * 2 * D for j in range(W)]
    q_size = [lay.n_resp(j) * H * D for j in range(W)]
    recv = [kv_size[j] + q_size[j] if j < r else 0 for j in range(W)]
    got = all_to_all(msg.repeat(len(later)), send, recv, st.group)
    parts = got.split(recv)
    # 2) local partial: all local queries over [earlier prompt shards ; local tokens]
    keys, vals, metas = [], [], []
    for j in range(r):
        kv = parts[j][: kv_size[j]].view(lay.n_prompt(j), Hkv, 2 * D).transpose(0, 1)
        kj, vj = kv.chunk(2, dim=-1)
        keys.append(kj)
        vals.append(vj)
        metas.append(lay.prompt_meta(j))
    q_meta = lay.meta(r)
    k_meta = tuple(torch.cat([m[i] for m in metas] + [q_meta[i]]) for i in range(2))
    acc = _partial(q, _rep(torch.cat(keys + [k], dim=1), n_rep), _rep(torch.cat(vals + [v], dim=1), n_rep),
                   _visible(q_meta, k_meta), scale)
    # 3) as owner: partials of earlier ranks' response queries over this rank's prompt shard, sent back
    kp, vp = _rep(k[:, :npr], n_rep), _rep(v[:, :npr], n_rep)
    outs = []
    for j in range(r):
        qj = parts[j][kv_size[j]:].view(lay.n_resp(j), H, D).transpose(0, 1)
        o, lse = _partial(qj, kp, vp, None, scale)  # response queries see the whole prompt
        outs.append(torch.cat([o, lse[..., None]], dim=-1).transpose(0, 1).reshape(-1))  # (nresp_j*H*(D+1),)
    p_send = [lay.n_resp(j) * H * (D + 1) if j < r else 0 for j in range(W)]
    p_recv = [lay.n_resp(r) * H * (D + 1) if j > r else 0 for j in range(W)]
    # the empty slice of `got` makes this collective depend on the first one on EVERY rank (also where
    # nothing is exchanged), so all ranks run the backward collectives in the same order
    back_in = torch.cat(outs + [got[:0].float()])
    back = all_to_all(back_in, p_send, p_recv, st.group)
    # 4) merge the later owners' partials into the response rows
    o_resp, l_resp = _tie(acc[0][:, npr:], got, back), acc[1][:, npr:]  # both collectives in every rank's graph
    for j, part in enumerate(back.split(p_recv)):
        if j > r:
            part = part.view(lay.n_resp(r), H, D + 1).transpose(0, 1)
            o_resp, l_resp = _merge((o_resp, l_resp), (part[..., :D], part[..., D]))
    return torch.cat([acc[0][:, :npr], o_resp], dim=1), torch.cat([acc[1][:, :npr], l_resp], dim=1)


def _tie(x: Tensor, *others: Tensor) -> Tensor:
    """x, with a zero-valued dependency on `others` (possibly empty tensors) so their autograd nodes
    (collectives) run in backward on every rank."""
    for o in others:
        x = x + 0.0 * o.sum()
    return x


# --- public API -----------------------------------------------------------------------------------


class ContextParallel:
    """AugTree context-parallel replay over the ranks of `group` (default: the world) in `mode`
    ("lanes" or "owners", see the module docstring; `trainer.prompt_sharing.plan_replay` chooses).
    Holds no per-call state: one object serves any number of groups and models."""

    def __init__(self, mode: str, group=None):
        if mode not in CP_MODES:
            raise ValueError(f"mode={mode} is not one of {CP_MODES}")
        self.mode, self.group = mode, group

    def layout(self, prompt_len: int, response_lens: Sequence[int]) -> CPLayout:
        """The placement of a group over this object's ranks (identical on every rank)."""
        return cp_layout(prompt_len, response_lens, dist.get_world_size(self.group))

    @contextlib.contextmanager
    def attention(self, model, layout: CPLayout):
        """Within the block, `model`'s attention layers run this replay's attention for `layout`
        (this rank's local tokens, one sequence). The attention function, bound to this call, is
        registered under a name of its own; on exit the model's attention implementation is set back
        and the name dropped, also on error."""
        call = _CPCall(self.mode, self.group, dist.get_rank(self.group), layout)
        name = f"{ATTN_NAME}_{id(call):x}"
        lm = causal_lm(model)
        previous = lm.config._attn_implementation
        ALL_ATTENTION_FUNCTIONS[name] = functools.partial(_cp_attention, call)
        try:
            lm.set_attn_implementation(name)
            yield
        finally:
            lm.set_attn_implementation(previous)
            del ALL_ATTENTION_FUNCTIONS[name]

    def logprobs(self, model, prompt_ids: Tensor, responses: list[Tensor], temperature: float = 1.0,
                 chunk: int = 0) -> list[Optional[Tensor]]:
        """Per response i: (len_i,) log-probs of its tokens under `model` (the first predicted by the
        last prompt position), with gradients, computed context-parallel over the ranks of the group.
        Every rank passes the same prompt_ids (P,) and responses; the result list has one entry per
        response, a tensor on the rank that owns it (`self.layout(...).owner[i]`) and None on the
        others. Needs P >= W and G >= W. Parameter gradients after backward are this rank's share;
        their sum over ranks is the gradient of the whole group's loss. One forward call of `model`
        per rank."""
        group = self.group
        W, r = dist.get_world_size(group), dist.get_rank(group)
        lay = self.layout(prompt_ids.numel(), [x.numel() for x in responses])
        s, e = lay.bounds[r]
        device = prompt_ids.device
        ids = torch.cat([prompt_ids[s:e]] + [responses[i].to(device) for i in lay.local[r]])
        _, pos = lay.meta(r)
        head = output_head(model)
        with self.attention(model, lay):
            hidden = _features(model, ids[None], None, pos.to(device)[None], head)[0]  # (N, D)
        # the last prompt position (on rank W-1) predicts every response's first token: send it to all
        src = W - 1
        mine = hidden[e - s - 1: e - s] if r == src else hidden[:0]
        send = [1 if (r == src and j != src) else 0 for j in range(W)]
        recv = [1 if (j == src and r != src) else 0 for j in range(W)]
        h_last = torch.cat([mine, all_to_all(mine.expand(W - 1 if r == src else 0, -1), send, recv, group)])
        feats, targets, offset = [], [], e - s
        for i in lay.local[r]:
            c = lay.response_lens[i]
            feats += [h_last, hidden[offset: offset + c - 1]]
            targets.append(responses[i].to(device))
            offset += c
        lp = losses.chunked_token_logprobs(torch.cat(feats), head, torch.cat(targets), temperature,
                                           _chunk(model, chunk))
        lp = lp + 0.0 * hidden.sum()  # every local row in the graph, so backward collectives run on all ranks
        out: list[Optional[Tensor]] = [None] * len(responses)
        for i, part in zip(lay.local[r], lp.split([lay.response_lens[i] for i in lay.local[r]])):
            out[i] = part
        return out

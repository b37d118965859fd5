"""AugTree shared-prompt replay for the RL actor update (single process) and the replay planner.

GRPO samples G responses per prompt; the update needs the log-prob of every response token under
the current policy, with gradients. The flattened computation runs G rows [prompt ; response_i], so
the prompt is recomputed G times. Shared-prompt replay instead packs one row per prompt group

    [prompt (P) ; response_1 (c_1) ; ... ; response_G (c_G) ; pad]

with explicit position ids (prompt 0..P-1; every response P..P+c_i-1) and a 4-D boolean attention
mask: prompt tokens attend causally within the prompt; a response token attends to the whole prompt
and causally to its own response; pad tokens attend only to pad tokens (so no real token sees them
and no softmax row is empty). One forward call (through any DDP wrapper) computes the prompt K/V once;
autograd sums the K/V gradients of all G branches and carries them through the prompt's forward graph,
so the loss and every parameter gradient equal the flattened computation (fp32 tolerance), unlike a
detached inference-style KV cache. The last prompt position's hidden state predicts every response's
first token.

Memory: only final hidden states are kept (a hook on the decoder, `logits_to_keep=1`); log-probs are
taken a chunk of tokens at a time by `algorithms.losses.chunked_token_logprobs`, never as [B, T, V].
The mask is (groups, 1, L, L) booleans with L = P + sum(c_i).

    logp = shared_prompt_logprobs(model, input_ids, attention_mask, prompt_lengths)   # (B, T)
    plan = plan_replay(prompt_len=1024, response_lens=[64] * 8, group_size=8, world_size=2)
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
from torch import Tensor

from algorithms import losses
from models.anatomy import capture_final_hidden, output_head, unwrap

MASKED_IMPLS = ("sdpa", "eager")  # attention implementations that take a custom 4-D mask as given


# --- packing --------------------------------------------------------------------------------------


@dataclass
class _Group:
    prompt: Tensor  # (P,)
    rows: list[int] = field(default_factory=list)  # batch rows of this group
    lengths: list[int] = field(default_factory=list)  # completion length per row


def _groups(input_ids: Tensor, attention_mask: Tensor, prompt_lengths: Tensor) -> list[_Group]:
    """Rows grouped by identical prompt tokens (first-seen order), with their completion lengths."""
    ids_cpu = input_ids.detach().cpu()
    real = attention_mask.detach().cpu().long().sum(-1).tolist()
    plens = [int(p) for p in prompt_lengths.detach().cpu().tolist()]
    by_key: dict[tuple, _Group] = {}
    for b, (p, n) in enumerate(zip(plens, real)):
        if p < 1:
            raise ValueError(f"row {b}: prompt length {p} < 1 (nothing predicts the first completion token)")
        if n < p:
            raise ValueError(f"row {b}: {n} real tokens but prompt length {p} (rows must be right-padded)")
        key = tuple(ids_cpu[b, :p].tolist())
        group = by_key.setdefault(key, _Group(prompt=input_ids[b, :p]))
        group.rows.append(b)
        group.lengths.append(n - p)
    return list(by_key.values())


def pack_groups(input_ids: Tensor, attention_mask: Tensor, prompt_lengths: Tensor, pad_id: int = 0):
    """Packed rows, position ids, segment ids and gather indices for shared-prompt replay.

    Returns (packed (n, L), position_ids (n, L), segments (n, L): 0 prompt, i+1 response i, -1 pad,
    index: (row b, column t, packed row g, packed column of the state predicting t) per completion token).
    """
    groups = _groups(input_ids, attention_mask, prompt_lengths)
    lens = [g.prompt.numel() + sum(g.lengths) for g in groups]
    L = max(lens)
    n = len(groups)
    device = input_ids.device
    packed = torch.full((n, L), pad_id, dtype=input_ids.dtype, device=device)
    seg = torch.full((n, L), -1, dtype=torch.long)
    pos = torch.arange(L, dtype=torch.long).repeat(n, 1)  # pads keep increasing positions
    rows, cols, grows, gcols = [], [], [], []
    for gi, g in enumerate(groups):
        P = g.prompt.numel()
        packed[gi, :P] = g.prompt
        seg[gi, :P] = 0
        offset = P
        for k, (b, c) in enumerate(zip(g.rows, g.lengths)):
            if c == 0:
                continue
            packed[gi, offset: offset + c] = input_ids[b, P: P + c]
            seg[gi, offset: offset + c] = k + 1
            pos[gi, offset: offset + c] = torch.arange(P, P + c)
            rows += [b] * c
            cols += list(range(P, P + c))
            grows += [gi] * c
            gcols += [P - 1] + list(range(offset, offset + c - 1))  # first token predicted by the prompt's last
            offset += c
    index = tuple(torch.tensor(x, dtype=torch.long, device=device) for x in (rows, cols, grows, gcols))
    return packed, pos.to(device), seg.to(device), index


def replay_mask(position_ids: Tensor, segments: Tensor) -> Tensor:
    """(n, 1, L, L) boolean mask, True = may attend: key at or before the query, and either in the
    prompt (segment 0) or in the query's own segment (own response, or pad with pad)."""
    pq, pk = position_ids[:, :, None], position_ids[:, None, :]
    sq, sk = segments[:, :, None], segments[:, None, :]
    return ((pk <= pq) & ((sk == 0) | (sk == sq)))[:, None]


# --- log-probs ------------------------------------------------------------------------------------


def _features(model, input_ids: Tensor, mask, position_ids: Optional[Tensor], head) -> Tensor:
    """(n, L, H) final hidden states (or (n, L, V) logits when head is None) from ONE model call."""
    kwargs = dict(input_ids=input_ids, attention_mask=mask, use_cache=False)
    if position_ids is not None:
        kwargs["position_ids"] = position_ids
    if head is None:
        return model(**kwargs).logits
    with capture_final_hidden(model) as store:
        model(**kwargs, logits_to_keep=1)
    return store["hidden"]


def _scatter(values: Tensor, rows: Tensor, cols: Tensor, shape) -> Tensor:
    out = values.new_zeros(shape)
    return out.index_put((rows, cols), values)


def _chunk(model, chunk: int) -> int:
    return chunk if chunk > 0 else losses.auto_chunk(unwrap(model).config.vocab_size, 0)


def completion_index(attention_mask: Tensor, prompt_lengths: Tensor) -> tuple[Tensor, Tensor]:
    """(rows, cols) of completion tokens: t in [prompt_lengths[b], last real token]."""
    T = attention_mask.shape[1]
    t = torch.arange(T, device=attention_mask.device)
    real = attention_mask.long().sum(-1, keepdim=True)
    sel = (t[None] >= prompt_lengths.to(t.device)[:, None]) & (t[None] < real)
    return sel.nonzero(as_tuple=True)


def flattened_logprobs(model, input_ids: Tensor, attention_mask: Tensor, prompt_lengths: Tensor,
                       temperature: float = 1.0, chunk: int = 0) -> Tensor:
    """The reference: every row [prompt ; completion] through the model on its own. Same output as
    `shared_prompt_logprobs`."""
    head = output_head(model)
    feats = _features(model, input_ids, attention_mask, None, head)  # (B, T, D)
    rows, cols = completion_index(attention_mask, prompt_lengths)
    lp = losses.chunked_token_logprobs(feats[rows, cols - 1], head, input_ids[rows, cols], temperature,
                                       _chunk(model, chunk))
    return _scatter(lp, rows, cols, input_ids.shape)


def shared_prompt_logprobs(model, input_ids: Tensor, attention_mask: Tensor, prompt_lengths: Tensor,
                           temperature: float = 1.0, chunk: int = 0) -> Tensor:
    """(B, T) log-prob of token t given tokens < t under `model`, at completion positions
    t in [prompt_lengths[b], last real token] (0 elsewhere), equal to the flattened computation.
    Rows are right-padded prompt+completion; rows whose prompt (first prompt_lengths[b] tokens) is
    identical share one prefill (grouping is detected from the tokens; rows need not be adjacent).

    One forward call through `model` (DDP-safe) on one packed row per group with a custom 4-D mask.
    Attention implementations other than sdpa / eager (which take the 4-D mask as given) fall back
    to the flattened computation. chunk: tokens per log-prob chunk, 0 = from the vocabulary size.
    """
    impl = getattr(unwrap(model).config, "_attn_implementation", "sdpa")
    if impl not in MASKED_IMPLS:
        return flattened_logprobs(model, input_ids, attention_mask, prompt_lengths, temperature, chunk)
    pad_id = getattr(unwrap(model).config, "pad_token_id", None) or 0
    packed, pos, seg, (rows, cols, grows, gcols) = pack_groups(input_ids, attention_mask, prompt_lengths, pad_id)
    mask = replay_mask(pos, seg)
    if impl == "eager":  # additive float mask
        dtype = next(unwrap(model).parameters()).dtype
        mask = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)
    head = output_head(model)
    feats = _features(model, packed, mask, pos, head)  # (n, L, D)
    lp = losses.chunked_token_logprobs(feats[grows, gcols], head, input_ids[rows, cols], temperature,
                                       _chunk(model, chunk))
    return _scatter(lp, rows, cols, input_ids.shape)


# --- planner --------------------------------------------------------------------------------------

MODES = ("flattened", "shared", "lanes", "owners")


@dataclass
class CostParams:
    """Model / machine constants of the replay cost model (per transformer layer; layers scale all
    modes alike). Defaults: a 4k-hidden GQA model (kv width 1/4 of q) in bf16 on accelerators with
    ~400 TFLOP/s effective and ~50 GB/s per-rank link bandwidth, 20 us per collective launch."""

    hidden: int = 4096
    ffn_mult: float = 3.0  # intermediate / hidden
    kv_frac: float = 0.25  # (kv heads * head_dim) / hidden
    heads: int = 32
    bytes_per_el: int = 2  # activations on the wire (queries, K/V); partials (O, L) are fp32
    flops_per_s: float = 4e14
    link_bytes_per_s: float = 5e10
    latency_s: float = 2e-5


@dataclass
class ReplayPlan:
    mode: str  # "flattened" | "shared" | "lanes" | "owners"
    degree: int  # context-parallel ranks per lane (1: no CP)
    lanes: int  # independent replay lanes (rings) the world is split into
    est_cost: float  # estimated seconds per layer (forward + backward) of the chosen mode
    reason: str
    costs: dict = field(default_factory=dict)  # every candidate "mode/degree/lanes" -> est. seconds


def _pairs_causal(n: int) -> float:
    return n * (n + 1) / 2


def replay_costs(prompt_len: int, response_lens: Sequence[int], group_size: int, world_size: int,
                 params: CostParams = CostParams()) -> dict[tuple[str, int, int], float]:
    """Estimated seconds per layer (forward + backward = 3x forward FLOPs) of each candidate.

    Compute: linear layers (q/k/v/o projections + SwiGLU MLP) cost
        c_lin = 2 * (2 + 2 * kv_frac + 3 * ffn_mult) * hidden^2  FLOPs per token,
    attention c_att = 4 * hidden FLOPs per (query, visible key) pair (QK^T and PV).
      flattened: tokens G*P + R, pairs sum_i (P + r_i)(P + r_i + 1)/2; rows split over min(W, G) ranks.
      shared:    tokens P + R,   pairs P(P+1)/2 + sum_i (P r_i + r_i(r_i+1)/2); one rank (degree 1).
      CP modes:  the shared work split evenly over the `degree` ranks of a lane; lanes mode with
                 `lanes` > 1 rings: each ring prefills the prompt itself (prompt work x lanes) and
                 replays G/lanes responses.
    Communication (average bytes per rank, forward + backward = 2x forward; bytes / link bandwidth,
    plus a launch latency per collective), d = degree:
      lanes:  the prompt K/V shards rotate around the ring: (d-1)/d * P * 2 * kv_frac * hidden * b
              per direction (response K/V stay with their whole responses); d-1 ring steps.
      owners: each rank sends its prompt-shard K/V and its response queries to the later ranks
              (the causal prefill needs earlier K/V; earlier owners' K/V are then already local),
              (d-1)/(2d) * (P * 2 * kv_frac * hidden * b + R * hidden * b); the later owners return
              fp32 partials (O, L): (d-1)/(2d) * R * (hidden + heads) * 4; 2 all-to-alls.
    Prompt-dominated groups favour owners (their traffic grows with R, lanes' with P); response-
    dominated ones favour lanes.
    """
    P, R, G, W, p = prompt_len, float(sum(response_lens)), group_size, world_size, params
    H = p.hidden
    c_lin = 2 * (2 + 2 * p.kv_frac + 3 * p.ffn_mult) * H * H
    c_att = 4 * H
    prompt_pairs = _pairs_causal(P)
    resp_pairs = sum(P * r + _pairs_causal(r) for r in response_lens)
    fb = 3.0  # forward + backward FLOPs / forward FLOPs

    def seconds(flops: float) -> float:
        return fb * flops / p.flops_per_s

    def comm(nbytes: float, collectives: int) -> float:
        return 2 * (nbytes / p.link_bytes_per_s + collectives * p.latency_s)

    flat_flops = c_lin * (G * P + R) + c_att * sum(_pairs_causal(P + r) for r in response_lens)
    shared_prompt = c_lin * P + c_att * prompt_pairs
    shared_resp = c_lin * R + c_att * resp_pairs
    costs = {("flattened", 1, min(W, max(G, 1))): seconds(flat_flops) / min(W, max(G, 1)),
             ("shared", 1, 1): seconds(shared_prompt + shared_resp)}
    kv = 2 * p.kv_frac * H * p.bytes_per_el  # bytes of one token's K and V
    for d in range(2, W + 1):
        if W % d:
            continue
        for lanes in range(1, W // d + 1):
            if (W // d) % lanes or lanes > max(G, 1):
                continue
            compute = seconds(lanes * shared_prompt + shared_resp) / (d * lanes)
            costs[("lanes", d, lanes)] = compute + comm((d - 1) / d * P * kv, d - 1)
        compute = seconds(shared_prompt + shared_resp) / d
        owners_bytes = (d - 1) / (2 * d) * (P * kv + R * H * p.bytes_per_el + R * (H + p.heads) * 4)
        costs[("owners", d, 1)] = compute + comm(owners_bytes, 2)
    return costs


def plan_replay(prompt_len: int, response_lens: list[int], group_size: int, world_size: int,
                params: CostParams = CostParams()) -> ReplayPlan:
    """The cheapest replay for one group under `replay_costs` (ties: the simpler mode, in the order
    flattened, shared, lanes, owners; fewer ranks first). world 1 -> shared, or flattened when
    G == 1 (nothing is shared: same cost, simpler)."""
    if world_size < 1 or group_size < 1 or prompt_len < 1:
        raise ValueError("world_size, group_size and prompt_len must be >= 1")
    costs = replay_costs(prompt_len, response_lens, group_size, world_size, params)
    order = {m: i for i, m in enumerate(MODES)}
    low = min(costs.values())
    best = min((k for k in costs if costs[k] <= low * (1 + 1e-9)), key=lambda k: (order[k[0]], k[1], k[2]))
    mode, degree, lanes = best
    P, R = prompt_len, sum(response_lens)
    if mode == "flattened":
        reason = "nothing to share (G == 1)" if group_size == 1 else "flattened rows over ranks are cheapest"
    elif mode == "shared":
        reason = "one prefill per group; CP communication would cost more than it saves" if world_size > 1 \
            else "single rank: one prefill per group"
    elif mode == "owners":
        reason = (f"P={P}, R={R}: shipping response queries to stationary prompt-K/V owners moves fewer "
                  f"bytes than rotating the prompt K/V")
    else:
        reason = (f"P={P}, R={R}: rotating the prompt K/V within {lanes} ring(s) of {degree} moves fewer bytes "
                  f"than shipping response queries and partials")
    return ReplayPlan(mode, degree, lanes, costs[best], reason,
                      {f"{m}/{d}/{l}": c for (m, d, l), c in costs.items()})

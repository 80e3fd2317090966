"""Turns the logits of the rows that sample into next tokens (and logprobs).

Order of processing, as in vLLM: the structured-output token bitmask (its rows only;
logprobs are taken after it), the token controls (``allowed_token_ids``, bad words,
``logit_bias``: each one indexed write over the batch), penalties (repetition over
prompt and output, presence and frequency over output), then temperature, then the
top-k / top-p / min-p masks, then a draw. Temperature 0 is greedy (argmax after
penalties). Logprobs are the model's (after the grammar's mask only), as vLLM's
default ``raw_logprobs``: a biased or banned token keeps its own.

Random draws are a function of (request seed, output index) only, so a request's tokens
do not depend on its batch mates, on chunking, or on preemption history: each row's
uniform is a hash of both (SplitMix64, in Python), and the batch draws by inverse CDF
(one cumulative sum and one search over all rows: no per-row generator or kernel).
Requests without a seed get one from the engine when they are added.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.wire.sampling_params import SamplingParams

_GOLDEN = 0x9E3779B97F4A7C15  # odd 64-bit constant: spreads (seed, index) pairs apart
_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class SampleRow:
    """What the sampler needs to know about one row of logits."""

    params: SamplingParams
    seed: int
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]


@dataclass(frozen=True)
class TokenLogprobs:
    """The model's logprob of one token (after the grammar's mask only) and the likeliest
    alternatives: one per sampled token, or per prompt token for ``prompt_logprobs``."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, logprob), most likely first
    rank: int | None = None  # 1 + how many tokens are more likely (set for prompt logprobs)


def apply_penalties(logits: torch.Tensor, rows: Sequence[SampleRow]) -> None:
    """In place, for the rows whose params ask for penalties."""
    for i, row in enumerate(rows):
        p = row.params
        if not p.needs_penalties:
            continue
        x = logits[i]
        # Ids and counts are built on the logits' device: CUDA refuses a CPU operand.
        if p.repetition_penalty != 1.0:
            seen = sorted(set(row.prompt_token_ids) | set(row.output_token_ids))
            seen = torch.tensor(seen, dtype=torch.long, device=x.device)
            vals = x[seen]
            x[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if row.output_token_ids and (p.presence_penalty or p.frequency_penalty):
            out = torch.tensor(row.output_token_ids, dtype=torch.long, device=x.device)
            counts = torch.zeros_like(x).index_add_(0, out, torch.ones_like(out, dtype=x.dtype))
            x -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)


def apply_token_controls(logits: torch.Tensor, rows: Sequence[SampleRow]) -> None:
    """In place: -inf outside each row's ``allowed_token_ids`` and on the tokens that would
    complete one of its bad words, then its ``logit_bias`` added. The Python work is per
    listed token, never per vocabulary entry; the tensor work is one write per control."""
    restricted: list[int] = []
    allowed: tuple[list[int], list[int]] = ([], [])
    banned: tuple[list[int], list[int]] = ([], [])
    bias: tuple[list[int], list[int], list[float]] = ([], [], [])
    for i, row in enumerate(rows):
        p = row.params
        if p.allowed_token_ids is not None:
            restricted.append(i)
            allowed[0].extend([i] * len(p.allowed_token_ids))
            allowed[1].extend(p.allowed_token_ids)
        if p.bad_words_token_ids:
            tokens = p.banned_tokens(row.output_token_ids)
            banned[0].extend([i] * len(tokens))
            banned[1].extend(tokens)
        if p.logit_bias:
            bias[0].extend([i] * len(p.logit_bias))
            for t, b in p.logit_bias:
                bias[1].append(t)
                bias[2].append(b)
    device = logits.device

    def index(values: list) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=device)

    if restricted:
        blocked = torch.zeros_like(logits, dtype=torch.bool)
        blocked[index(restricted)] = True
        blocked[index(allowed[0]), index(allowed[1])] = False
        logits.masked_fill_(blocked, float("-inf"))
    if banned[0]:
        logits[index(banned[0]), index(banned[1])] = float("-inf")
    if bias[0]:
        values = torch.tensor(bias[2], dtype=logits.dtype, device=device)
        logits.index_put_((index(bias[0]), index(bias[1])), values, accumulate=True)


def apply_top_k_top_p_min_p(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """Mask logits ([B, V]) to -inf outside each row's top-k, top-p nucleus and min-p floor.

    ``top_k`` 0 (or >= V) disables it, ``top_p`` 1 and ``min_p`` 0 likewise. The most
    likely token always survives.
    """
    vocab = logits.shape[-1]
    out = logits.clone()
    sorted_logits, order = out.sort(dim=-1, descending=True)
    k = torch.where((top_k <= 0) | (top_k > vocab), vocab, top_k).long()
    ranks = torch.arange(vocab, device=logits.device).expand_as(sorted_logits)
    drop = ranks >= k.unsqueeze(1)
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    # Keep a token if the mass strictly before it is still short of top_p.
    mass_before = probs.cumsum(dim=-1) - probs
    drop |= mass_before >= top_p.unsqueeze(1)
    drop |= probs < (min_p.unsqueeze(1) * probs[:, :1])
    drop[:, 0] = False
    out.scatter_(1, order, sorted_logits.masked_fill(drop, float("-inf")))
    return out


def uniform(seed: int, index: int) -> float:
    """A uniform draw in [0, 1) that is a function of (seed, index) only: SplitMix64's
    output function on the pair's key, its top 53 bits."""
    z = ((seed * _GOLDEN ^ index) + _GOLDEN) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return ((z ^ (z >> 31)) >> 11) * 2.0**-53


def draw(probs: torch.Tensor, uniforms: Sequence[float]) -> torch.Tensor:
    """One token of each row of ``probs`` ([R, V], rows summing to about 1), by inverse CDF:
    the first token whose cumulative probability passes the row's uniform times the row's
    total, summed in float64. A token of probability 0 is never drawn."""
    cdf = probs.double().cumsum(dim=-1)
    total = cdf[:, -1:]
    u = torch.tensor(uniforms, dtype=torch.float64, device=probs.device).unsqueeze(1) * total
    chosen = torch.searchsorted(cdf, u, right=True).squeeze(1)
    # Rounding can put u at the total: past the last token with any probability.
    last = (cdf < total).sum(dim=-1)
    return torch.minimum(chosen, last)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """In place: -inf for the tokens ``bitmask`` (int32, 32 tokens a word, [B, ceil(V/32)])
    forbids, on the listed rows only; the batch is masked in one call."""
    import xgrammar as xgr  # loaded by the first constrained request's compile already

    if bitmask.device != logits.device:
        bitmask = bitmask.to(logits.device, non_blocking=True)
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[-1], indices=rows)


def sample(
    logits: torch.Tensor,
    rows: Sequence[SampleRow],
    token_bitmask: tuple[torch.Tensor, list[int]] | None = None,
) -> tuple[list[int], list[TokenLogprobs | None]]:
    """logits: [B, V] float32, one row per request that samples. Returns ids and logprobs.

    ``token_bitmask``: (bitmask, the rows it constrains), from the structured-output
    matchers; those rows can only draw the tokens it allows.
    """
    if token_bitmask is not None:
        apply_token_bitmask(logits, *token_bitmask)
    want_logprobs = any(r.params.logprobs is not None for r in rows)
    raw_logprobs = logits.log_softmax(dim=-1) if want_logprobs else None
    controls = any(r.params.has_token_controls for r in rows)
    if controls or any(r.params.needs_penalties for r in rows):
        logits = logits.clone()
        if controls:
            apply_token_controls(logits, rows)
        apply_penalties(logits, rows)
    chosen = logits.argmax(dim=-1)
    random_rows = [i for i, r in enumerate(rows) if not r.params.greedy]
    if random_rows:
        idx = torch.tensor(random_rows, device=logits.device)
        sub = logits[idx]
        params = [rows[i].params for i in random_rows]
        temp = torch.tensor([p.temperature for p in params], device=logits.device)
        sub = sub / temp.unsqueeze(1)
        if any(p.top_k or p.top_p < 1 or p.min_p > 0 for p in params):
            sub = apply_top_k_top_p_min_p(
                sub,
                torch.tensor([p.top_k for p in params], device=logits.device),
                torch.tensor([p.top_p for p in params], device=logits.device),
                torch.tensor([p.min_p for p in params], device=logits.device),
            )
        uniforms = [uniform(rows[i].seed, len(rows[i].output_token_ids)) for i in random_rows]
        chosen[idx] = draw(sub.softmax(dim=-1), uniforms)
    ids = chosen.tolist()
    logprobs: list[TokenLogprobs | None] = [None] * len(rows)
    if raw_logprobs is not None:
        for i, r in enumerate(rows):
            n = r.params.logprobs
            if n is None:
                continue
            top = ()
            if n > 0:
                vals, tok = raw_logprobs[i].topk(n)
                top = tuple(zip(tok.tolist(), vals.tolist()))
            logprobs[i] = TokenLogprobs(ids[i], raw_logprobs[i, ids[i]].item(), top)
    return ids, logprobs


def prompt_logprobs(
    logits: torch.Tensor, targets: Sequence[int], num_top: Sequence[int]
) -> list[TokenLogprobs]:
    """The model's own logprobs (no sampling controls, as vLLM's prompt logprobs) of each
    row's ``targets`` token, its rank, and the row's ``num_top`` most likely tokens."""
    lps = logits.log_softmax(dim=-1)
    target = torch.tensor(targets, dtype=torch.long, device=logits.device).unsqueeze(1)
    chosen = lps.gather(1, target)
    ranks = (lps > chosen).sum(dim=1).add_(1).tolist()
    k = max(num_top)
    top_vals, top_ids = lps.topk(k, dim=-1) if k else (lps[:, :0], lps[:, :0].long())
    top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
    return [
        TokenLogprobs(t, lp, tuple(zip(top_ids[i][:n], top_vals[i][:n])), rank)
        for i, (t, lp, rank, n) in enumerate(zip(targets, chosen.squeeze(1).tolist(), ranks, num_top))
    ]

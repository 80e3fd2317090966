"""What a serving benchmark sends, and when: request workloads and arrival schedules.

Every prompt is a list of token ids, sent as such (HTTP ``prompt: [ids]``, gRPC
``token_ids``), so a prompt of N tokens is exactly N tokens on the server whatever the
tokenizer would make of its text. Every request asks for a fixed number of output
tokens with ``ignore_eos``, so runs of different configurations do the same work.

Pure: plain lists, a seeded ``random.Random`` passed in, no network and no clock.

Workloads:

* ``synthetic``: random tokens; prompt and output lengths uniform within
  ``length * (1 ± range_ratio)`` (vLLM's random dataset).
* ``sharegpt``: real conversations; the prompt is the first human turn, the output
  length the token length of the first reply (vLLM's ShareGPT sampling and filters).
* ``shared_prefix``: G long "system prompts"; each request is one group's prefix plus a
  suffix of its own, which is what prefix caching saves work on.
* ``long_mix``: synthetic requests with a share of very long prompts among them, which
  is what chunked prefill and disaggregation keep from stalling the others.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

# vLLM's ShareGPT filters: shorter sequences say nothing about serving, longer ones
# dominate a run on their own.
MIN_SEQUENCE_TOKENS = 4
SHAREGPT_MAX_PROMPT_TOKENS = 1024
SHAREGPT_MAX_TOTAL_TOKENS = 2048


class Tokenizer(Protocol):
    """What the workloads use of a tokenizer: the vocabulary's size and special ids
    (``sampleable_ids``) and ``encode`` (ShareGPT's prompts and reply lengths)."""

    vocab_size: int
    all_special_ids: frozenset[int]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...


@dataclass(frozen=True)
class BenchRequest:
    """One request of a workload: its prompt as token ids, the output tokens it asks for (with
    ``ignore_eos``), and the part of the workload it belongs to."""

    prompt_token_ids: list[int]
    output_len: int
    group: str = ""  # the part of the workload it belongs to ("long", "prefix-3", ...)


def sampleable_ids(tokenizer: Tokenizer) -> list[int]:
    """Token ids a random prompt may use: special tokens (BOS, EOS, chat markers) would
    change how the model treats the prompt, so they are left out."""
    return [i for i in range(tokenizer.vocab_size) if i not in tokenizer.all_special_ids]


def length_range(length: int, range_ratio: float) -> tuple[int, int]:
    """The inclusive bounds of ``length * (1 ± range_ratio)``, never below one token."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    if length < 1:
        raise ValueError(f"lengths must be >= 1, got {length}")
    return max(1, math.floor(length * (1 - range_ratio))), math.ceil(length * (1 + range_ratio))


def random_tokens(n: int, vocab: Sequence[int], rng: random.Random) -> list[int]:
    return [vocab[rng.randrange(len(vocab))] for _ in range(n)]


def synthetic(
    n: int, input_len: int, output_len: int, range_ratio: float, vocab: Sequence[int], rng: random.Random
) -> list[BenchRequest]:
    in_lo, in_hi = length_range(input_len, range_ratio)
    out_lo, out_hi = length_range(output_len, range_ratio)
    return [
        BenchRequest(random_tokens(rng.randint(in_lo, in_hi), vocab, rng), rng.randint(out_lo, out_hi))
        for _ in range(n)
    ]


def long_mix(
    n: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    long_fraction: float,
    long_len: int,
    vocab: Sequence[int],
    rng: random.Random,
) -> list[BenchRequest]:
    """Synthetic requests of which exactly ``round(n * long_fraction)``, at random
    positions, have a prompt of ``long_len`` tokens."""
    if not 0.0 <= long_fraction <= 1.0:
        raise ValueError(f"long_fraction must be in [0, 1], got {long_fraction}")
    base = synthetic(n, input_len, output_len, range_ratio, vocab, rng)
    long_at = set(rng.sample(range(n), round(n * long_fraction)))
    return [
        BenchRequest(random_tokens(long_len, vocab, rng), r.output_len, "long") if i in long_at
        else BenchRequest(r.prompt_token_ids, r.output_len, "short")
        for i, r in enumerate(base)
    ]


def shared_prefix(
    n: int,
    num_groups: int,
    prefix_len: int,
    suffix_len: int,
    output_len: int,
    range_ratio: float,
    vocab: Sequence[int],
    rng: random.Random,
) -> list[BenchRequest]:
    """Request i uses group ``i % num_groups``'s prefix, in shuffled order; no two
    requests share a suffix, so every token after the prefix is new to the server."""
    if num_groups < 1 or prefix_len < 1 or suffix_len < 1:
        raise ValueError("num_prefix_groups, prefix_len and suffix_len must be >= 1")
    if len(vocab) ** suffix_len < 2 * n:
        raise ValueError(f"{suffix_len}-token suffixes are too few to give {n} requests one each")
    prefixes = [random_tokens(prefix_len, vocab, rng) for _ in range(num_groups)]
    out_lo, out_hi = length_range(output_len, range_ratio)
    seen: set[tuple[int, ...]] = set()
    requests = []
    for i in range(n):
        suffix = random_tokens(suffix_len, vocab, rng)
        while tuple(suffix) in seen:
            suffix = random_tokens(suffix_len, vocab, rng)
        seen.add(tuple(suffix))
        g = i % num_groups
        requests.append(BenchRequest(prefixes[g] + suffix, rng.randint(out_lo, out_hi), f"prefix-{g}"))
    rng.shuffle(requests)
    return requests


def sharegpt(
    path: str | Path,
    n: int,
    tokenizer: Tokenizer,
    context_len: int,
    rng: random.Random,
) -> list[BenchRequest]:
    """``n`` conversations of a ShareGPT-format JSON file, in a seeded random order.

    The prompt is the first human turn, tokenized as the server would tokenize its
    text; the output length is the first reply's token count, clipped to what the
    context leaves. Conversations with a prompt or reply under 4 tokens, a prompt over
    1024 or a total over 2048 tokens are skipped, as vLLM does.
    """
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    if not isinstance(data, list):
        raise ValueError(f"{path}: a ShareGPT file is a JSON list of conversations")
    pairs = [p for p in map(_first_exchange, data) if p is not None]
    rng.shuffle(pairs)
    requests: list[BenchRequest] = []
    for prompt, reply in pairs:
        if len(requests) == n:
            break
        prompt_ids = tokenizer.encode(prompt)
        reply_len = len(tokenizer.encode(reply, add_special_tokens=False))
        out = min(reply_len, context_len - len(prompt_ids))
        if _keep(len(prompt_ids), reply_len, out):
            requests.append(BenchRequest(prompt_ids, out))
    if len(requests) < n:
        raise ValueError(f"{path}: only {len(requests)} usable conversations, {n} requested")
    return requests


def _first_exchange(conversation: object) -> tuple[str, str] | None:
    """(first human turn, the reply to it), or None when the record has no such pair."""
    turns = conversation.get("conversations") if isinstance(conversation, dict) else None
    if not isinstance(turns, list) or len(turns) < 2:
        return None
    first, second = turns[0], turns[1]
    if not (isinstance(first, dict) and isinstance(second, dict)):
        return None
    if first.get("from") != "human" or second.get("from") != "gpt":
        return None
    if not (isinstance(first.get("value"), str) and isinstance(second.get("value"), str)):
        return None
    return first["value"], second["value"]


def _keep(prompt_len: int, reply_len: int, output_len: int) -> bool:
    if prompt_len < MIN_SEQUENCE_TOKENS or output_len < MIN_SEQUENCE_TOKENS:
        return False
    return prompt_len <= SHAREGPT_MAX_PROMPT_TOKENS and prompt_len + reply_len <= SHAREGPT_MAX_TOTAL_TOKENS


def check_fits(requests: Sequence[BenchRequest], context_len: int) -> None:
    """Fail before sending anything when a request cannot fit the model's context: the
    server would reject it, and the run would measure rejections instead of serving."""
    for i, r in enumerate(requests):
        if len(r.prompt_token_ids) + r.output_len > context_len:
            raise ValueError(
                f"request {i} needs {len(r.prompt_token_ids)} prompt + {r.output_len} output tokens, "
                f"more than the model's context of {context_len}"
            )


def arrival_times(n: int, rate: float, burstiness: float, rng: random.Random) -> list[float]:
    """When each of ``n`` requests is sent, in seconds from the start (the first at 0).

    Gaps are gamma-distributed with shape ``burstiness`` and mean ``1 / rate``, as in
    vLLM: burstiness 1 is a Poisson process, below 1 burstier, above 1 more regular. An
    infinite rate sends everything at once.
    """
    if rate <= 0:
        raise ValueError(f"request rate must be > 0, got {rate}")
    if burstiness <= 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if math.isinf(rate):
        return [0.0] * n
    times, t = [], 0.0
    for _ in range(n):
        times.append(t)
        t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
    return times

"""The prefix-block hash: how a full block of token ids becomes a key, chained and seeded.

Owns the one way prefix hashes are computed. The engine's prefix cache
(``engine.core.block_pool``) keys cached KV blocks by these hashes, and the router's
placement index (``router.placement.PrefixIndex``) guesses each worker's cache with
them; nothing else computes prefix hashes.

Chained: a block's hash covers its parent's hash and its own token ids, so equal
hashes mean equal prefixes. The first block's parent is a root drawn from the seed, so
every hash depends on the seed.

Digests are 32-byte ``bytes`` compared whole, never a machine word. Python's ``hash()``
(what this replaced) is 64 bits and unkeyed for ints, so a collision can be searched
for offline, and a prompt crafted to collide with another one is served that prompt's
KV (vLLM's CVE-2025-25183; vLLM answered with a seeded sha256). ``HASH_ALGOS``:

- ``blake2b`` (default): BLAKE2b-256 keyed with the seed. Fast in software on any CPU.
- ``sha256``: SHA-256 over the chain rooted in the seed, as vLLM's. Faster where the
  CPU has SHA instructions (x86 SHA-NI, Armv8 crypto), and a FIPS-approved function.

Both are collision-resistant even to someone who knows the seed; with the default seed
nobody outside the process knows it. Cost on one core of an AMD EPYC (which has
SHA-NI), 16-token blocks: about 1.1 us a block for either, 0.3 ms for a 4k-token
prompt, where ``hash()`` took 0.4 us a block.

The seed: what must agree with what. Hashes are only compared within one process: an
engine looks its cache up with hashes it computed itself, and a router matches its
index against hashes it computed itself (the index is only a placement hint; the
engine's cache is what serves KV; no hash crosses a process). So the default, no seed,
draws a random one per hasher: one per engine, one per dispatcher. A configured seed
(``prefix_hash_seed``, a string or an integer) gives every process the same hashes, for
reproducing a run; hashes of different seeds or algorithms never match, which is
harmless here (a cold cache, not a wrong one).

Pure: hashlib and array, no torch. It lives in ``engine`` beside the cache it keys;
the router can import it because ``engine/__init__.py`` loads its torch parts lazily.
"""

from __future__ import annotations

import hashlib
import os
import sys
from array import array
from collections.abc import Sequence
from typing import Any

HASH_ALGOS = ("blake2b", "sha256")
DEFAULT_HASH_ALGO = "blake2b"
DIGEST_SIZE = 32

BlockHash = bytes

# Token ids as little-endian int64: an injective encoding of every id, so the digest
# input is (parent digest: fixed width) + (tokens: fixed width), and equal inputs mean
# equal blocks. 4-byte ids would take a quarter less time, but could overflow.
_TOKEN_TYPE = "q"
_BIG_ENDIAN = sys.byteorder == "big"


def check_hash_algo(algo: str) -> None:
    if algo not in HASH_ALGOS:
        raise ValueError(f"prefix_hash_algo must be one of {HASH_ALGOS}, got {algo!r}")


def check_hash_seed(seed: object) -> None:
    # An int is taken as its decimal string: `--engine prefix_hash_seed=42` reads as YAML.
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, (str, int))):
        raise ValueError(f"prefix_hash_seed must be a string, an integer or null, got {seed!r}")


class BlockHasher:
    """Chained, seeded hashes of full token blocks (see the module docstring)."""

    __slots__ = ("algo", "root", "_base")

    def __init__(self, algo: str = DEFAULT_HASH_ALGO, seed: str | int | None = None) -> None:
        check_hash_algo(algo)
        check_hash_seed(seed)
        key = os.urandom(32) if seed is None else hashlib.sha256(str(seed).encode()).digest()
        self.algo = algo
        self._base: Any  # a hashlib object, keyed where the algorithm takes a key
        if algo == "blake2b":
            # The keyed state is copied per block rather than rebuilt: keying costs a
            # compression of its own.
            self._base = hashlib.blake2b(digest_size=DIGEST_SIZE, key=key)
            self.root: BlockHash = self._base.copy().digest()
        else:
            self._base = hashlib.sha256()
            self.root = hashlib.sha256(b"tandem prefix root\0" + key).digest()

    def adapter_root(self, adapter: str | None) -> BlockHash | None:
        """The parent of a prompt's first block under a LoRA adapter (None: the base model's
        root): blocks computed under one adapter never serve another, or the base."""
        if adapter is None:
            return None
        h = self._base.copy()
        h.update(self.root)
        h.update(b"\0lora\0" + adapter.encode())
        root: BlockHash = h.digest()
        return root

    def hash_blocks(
        self, token_ids: Sequence[int], block_size: int, parent: BlockHash | None = None
    ) -> list[BlockHash]:
        """Hashes of the full blocks of ``token_ids`` (a partial last block has none),
        chained on ``parent``: the hash of the block before them, None at the prompt's start."""
        data = array(_TOKEN_TYPE, token_ids)
        if _BIG_ENDIAN:
            data.byteswap()
        raw = data.tobytes()
        step = block_size * data.itemsize
        prev = self.root if parent is None else parent
        copy = self._base.copy
        hashes = []
        for start in range(0, len(raw) - step + 1, step):
            h = copy()
            h.update(prev)
            h.update(raw[start : start + step])
            prev = h.digest()
            hashes.append(prev)
        return hashes

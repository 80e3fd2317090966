"""The prefix-block hash (engine/core/block_hash.py): chained, seeded, full-width digests,
the same function for the engine's prefix cache and the router's placement index."""

from __future__ import annotations

import hashlib
import struct

import pytest

from cluster import flags
from engine.core.block_hash import HASH_ALGOS, BlockHasher
from engine.core.block_pool import KVCacheManager
from engine.core.request import Request
from engine.wire.sampling_params import SamplingParams
from router.dispatch import DispatchConfig, Dispatcher
from tandem.cli import build_parser

BS = 4


def _request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, list(tokens), SamplingParams())


def _cache_prompt(kv: KVCacheManager, request: Request) -> list[bytes]:
    """Compute a request's prompt as the engine would, and return its blocks' cache keys."""
    assert kv.allocate_slots(request, request.num_tokens) is not None
    request.num_computed_tokens = request.num_tokens
    kv.cache_blocks(request)
    return [kv.pool.blocks[i].block_hash for i in kv.block_ids(request.request_id)]


@pytest.mark.parametrize("algo", HASH_ALGOS)
def test_equal_prefixes_hash_equal_and_only_full_blocks_count(algo):
    hasher = BlockHasher(algo, seed="s")
    a = hasher.hash_blocks(list(range(10)), BS)
    assert len(a) == 2, f"10 tokens in blocks of {BS} are 2 full blocks, got {len(a)} hashes"
    assert a == hasher.hash_blocks(list(range(8)) + [99, 98, 97], BS), (
        "prompts sharing their full blocks must share their hashes; a partial block has none"
    )
    assert all(len(h) == 32 for h in a), "a block hash is a whole 32-byte digest"


@pytest.mark.parametrize("algo", HASH_ALGOS)
def test_changing_an_early_token_changes_every_later_hash(algo):
    hasher = BlockHasher(algo, seed="s")
    tokens = list(range(16))
    changed = [7] + tokens[1:]  # only block 0 differs
    a, b = hasher.hash_blocks(tokens, BS), hasher.hash_blocks(changed, BS)
    assert all(x != y for x, y in zip(a, b)), "each hash covers the whole prefix, so all four must differ"


@pytest.mark.parametrize("algo", HASH_ALGOS)
def test_hashing_on_from_a_parent_equals_hashing_the_whole(algo):
    # The engine extends a request's hashes as its tokens arrive, block by block.
    hasher = BlockHasher(algo, seed="s")
    tokens = list(range(20))
    whole = hasher.hash_blocks(tokens, BS)
    head = hasher.hash_blocks(tokens[:8], BS)
    assert head + hasher.hash_blocks(tokens[8:], BS, parent=head[-1]) == whole
    assert hasher.hash_blocks(tokens[8:], BS) != whole[2:], "without its parent a block hashes as a first block"


@pytest.mark.parametrize("algo", HASH_ALGOS)
def test_the_seed_decides_every_hash(algo):
    tokens = list(range(12))
    one = BlockHasher(algo, seed="deploy-1").hash_blocks(tokens, BS)
    assert one == BlockHasher(algo, seed="deploy-1").hash_blocks(tokens, BS), "a seed gives the same hashes anew"
    other = BlockHasher(algo, seed="deploy-2").hash_blocks(tokens, BS)
    assert all(x != y for x, y in zip(one, other)), "another seed must change every block's hash"
    assert BlockHasher(algo).hash_blocks(tokens, BS) != BlockHasher(algo).hash_blocks(tokens, BS), (
        "without a seed each hasher draws its own secret one"
    )


def test_the_algorithms_give_different_hashes_for_one_seed():
    tokens = list(range(8))
    blake, sha = (BlockHasher(algo, seed="s").hash_blocks(tokens, BS) for algo in ("blake2b", "sha256"))
    assert all(x != y for x, y in zip(blake, sha))


def test_a_sha256_block_hash_is_the_sha256_of_its_parent_and_its_tokens():
    hasher = BlockHasher("sha256", seed="s")
    tokens = [3, 1, 4, 1, 5, 9, 2, 6]
    first, second = hasher.hash_blocks(tokens, BS)
    assert first == hashlib.sha256(hasher.root + struct.pack("<4q", *tokens[:4])).digest()
    assert second == hashlib.sha256(first + struct.pack("<4q", *tokens[4:])).digest()
    assert hasher.root == hashlib.sha256(b"tandem prefix root\0" + hashlib.sha256(b"s").digest()).digest()


def test_blocks_that_collide_under_pythons_hash_get_different_cache_entries():
    # The old key was hash((parent, tuple(tokens))): an int hashes to itself modulo
    # 2**61 - 1, so these two blocks had one key and the second prompt was served the
    # first one's KV. (Token ids this large never pass validation, but the same 64-bit
    # key made in-vocabulary collisions a matter of an offline search.)
    first = [5, 0, 0, 0]
    colliding = [5 + (2**61 - 1), 0, 0, 0]
    assert hash((None, tuple(first))) == hash((None, tuple(colliding))), "the pair collides under hash()"

    kv = KVCacheManager(num_blocks=8, block_size=BS)
    _cache_prompt(kv, _request("a", first + [1]))
    hit, num_hit = kv.get_computed_blocks(_request("b", colliding + [1]))
    assert num_hit == 0, f"a different block must not be served from the cache, got {num_hit} tokens"


@pytest.mark.parametrize("algo", HASH_ALGOS)
def test_the_engine_caches_blocks_under_the_hashers_digests(algo):
    hasher = BlockHasher(algo, seed="s")
    kv = KVCacheManager(num_blocks=8, block_size=BS, hasher=hasher)
    prompt = list(range(10, 19))
    keys = _cache_prompt(kv, _request("a", prompt))
    assert keys[:2] == hasher.hash_blocks(prompt, BS) and keys[2] is None, (
        "the two full blocks are cached under their digests; the partial third is not cached"
    )


@pytest.mark.parametrize("algo", ["md5", "SHA256", ""])
def test_an_unknown_algorithm_is_an_error_naming_the_setting(algo):
    with pytest.raises(ValueError, match="prefix_hash_algo must be one of"):
        BlockHasher(algo)


@pytest.mark.parametrize("engine", [{"prefix_hash_algo": "md5"}, {"prefix_hash_seed": [1, 2]}])
def test_a_bad_prefix_hash_setting_fails_with_the_topology_not_in_a_worker(engine):
    with pytest.raises(ValueError, match="prefix_hash_(algo|seed) must be"):
        flags.cluster_config(build_parser().parse_args(["up", *(f"--engine={k}={v}" for k, v in engine.items())]))


@pytest.mark.parametrize("seed", [True, 1.5, b"raw"])
def test_a_seed_that_is_no_string_or_integer_is_an_error_naming_the_setting(seed):
    with pytest.raises(ValueError, match="prefix_hash_seed must be"):
        BlockHasher(seed=seed)


@pytest.mark.parametrize("algo", HASH_ALGOS)
def test_the_router_hashes_a_prompt_as_the_engine_does_for_one_setting(algo):
    # One deployment setting, through the `tandem up` flags, reaches both sides.
    args = build_parser().parse_args(
        ["up", "--engine", f"prefix_hash_algo={algo}", "--engine", "prefix_hash_seed=42", "--engine", "block_size=4"]
    )
    cluster = flags.cluster_config(args)
    router = Dispatcher(lambda: [], lambda: [], DispatchConfig(**cluster.dispatch_settings()))
    engine = cluster.engine_config("decode")
    kv = KVCacheManager(8, engine.block_size, hasher=BlockHasher(engine.prefix_hash_algo, engine.prefix_hash_seed))
    prompt = list(range(100, 113))
    engine_keys = _cache_prompt(kv, _request("a", prompt))[:3]
    assert router.prefix_hashes(prompt) == engine_keys == BlockHasher(algo, "42").hash_blocks(prompt, 4), (
        "the router's prefix hashes must be the engine's cache keys for the same seed and algorithm"
    )


def test_without_the_setting_both_sides_use_blake2b_with_seeds_of_their_own():
    settings = flags.cluster_config(build_parser().parse_args(["up"])).dispatch_settings()
    assert (settings["prefix_hash_algo"], settings["prefix_hash_seed"]) == ("blake2b", None)

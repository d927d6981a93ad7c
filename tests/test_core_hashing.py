"""Block hashing: chained, stable across processes, seedable, salted."""
import subprocess
import sys

from rackserve.core.hashing import block_hashes, extend_block_hashes, hash_block, root_hash


def test_equal_prefixes_give_equal_hashes_and_divergence_changes_all_later_ones():
    a = block_hashes(list(range(64)), 16)
    b = block_hashes(list(range(48)) + [999] + list(range(49, 64)), 16)
    assert len(a) == 4
    assert a[:3] == b[:3]
    assert a[3] != b[3]
    # Chained: the same block of tokens after a different parent hashes differently.
    assert hash_block(a[0], range(16, 32)) == a[1]
    assert hash_block(a[1], range(16, 32)) != a[1]


def test_partial_blocks_are_not_hashed_and_extension_is_incremental():
    tokens = list(range(40))
    hashes = extend_block_hashes([], tokens[:20], 16)
    assert len(hashes) == 1
    extend_block_hashes(hashes, tokens, 16)
    assert hashes == block_hashes(tokens, 16)


def test_stable_across_processes():
    code = "from rackserve.core.hashing import block_hashes; print(block_hashes(list(range(100)), 16))"
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={"PYTHONHASHSEED": str(seed)}).stdout for seed in (1, 2)}
    assert len(outs) == 1
    assert outs.pop().strip() == str(block_hashes(list(range(100)), 16))


def test_seed_and_salt_isolate_namespaces():
    tokens = list(range(32))
    assert root_hash(0) != root_hash(1)
    assert block_hashes(tokens, 16, seed=0) != block_hashes(tokens, 16, seed=1)
    salted = block_hashes(tokens, 16, salt="user-a")
    assert salted[0] != block_hashes(tokens, 16)[0]
    assert salted != block_hashes(tokens, 16, salt="user-b")

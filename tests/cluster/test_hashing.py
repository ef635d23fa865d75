import subprocess
import sys

from pagedserve.cluster.hashing import ROOT_HASH, hash_block, hash_blocks

SNIPPET = (
    "from pagedserve.cluster.hashing import hash_blocks; print(hash_blocks(list(range(70)), 16, ('salt',)))"
)


def test_hashes_are_the_same_in_another_process_with_another_hash_seed():
    here = hash_blocks(list(range(70)), 16, ("salt",))
    for seed in ("1", "2"):
        out = subprocess.run(
            [sys.executable, "-c", SNIPPET],
            env={"PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            check=True,
        )
        assert out.stdout.strip() == str(here)


def test_chain_covers_only_full_blocks_and_names_the_whole_prefix():
    tokens = list(range(50))
    hashes = hash_blocks(tokens, 16)
    assert len(hashes) == 3
    assert hashes[0] == hash_block(ROOT_HASH, tokens[:16])
    assert hashes[2] == hash_block(hash_block(hashes[0], tokens[16:32]), tokens[32:48])
    # Same block content after a different prefix is a different block.
    other = [7] + tokens[1:]
    assert hash_blocks(other, 16)[1] != hashes[1]
    # Continuing a chain from a known parent matches hashing everything.
    assert hash_blocks(tokens[16:48], 16, parent=hashes[0]) == hashes[1:]


def test_extra_keys_separate_caches():
    tokens = list(range(32))
    assert hash_blocks(tokens, 16, ("tenant-a",)) != hash_blocks(tokens, 16, ("tenant-b",))
    assert hash_blocks(tokens, 16, ()) != hash_blocks(tokens, 16, ("tenant-a",))


def test_token_ids_past_16_bits_are_distinct():
    assert hash_block(ROOT_HASH, [70000]) != hash_block(ROOT_HASH, [70000 - 65536])

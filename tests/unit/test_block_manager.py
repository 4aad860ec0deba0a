"""The block manager on its own: allocation, ref counts, the prefix cache and its LRU, state slots."""

from __future__ import annotations

import pytest

from mgx.runtime.block_manager import BlockManager, block_hash


def computed(bm: BlockManager, seq_id: int, tokens: list[int]) -> None:
    """What the model runner does: room for the tokens, then commit them."""
    assert bm.allocate(seq_id, bm.num_computed(seq_id) + len(tokens))
    bm.commit(seq_id, tokens)


def test_blocks_are_allocated_on_demand_and_freed() -> None:
    bm = BlockManager(num_blocks=4, block_size=4, prefix_caching=False)
    assert bm.allocate(0, 5) and len(bm.table(0)) == 2
    assert bm.allocate(0, 8) and len(bm.table(0)) == 2  # still fits
    assert bm.allocate(0, 9) and len(bm.table(0)) == 3
    assert not bm.allocate(1, 8)  # needs 2, 1 left: all or nothing
    assert bm.num_free_blocks == 1 and len(bm.table(1)) == 0
    bm.free(0)
    bm.free(1)
    bm.free(99)  # unknown ids are ignored
    assert bm.num_free_blocks == 4 and bm.num_used_blocks == 0
    assert bm.fits(16) and not bm.fits(17)


def test_prefix_hits_share_blocks_and_leave_the_last_token_to_compute() -> None:
    bm = BlockManager(num_blocks=8, block_size=4, cache_salt=b"model-a")
    prompt = list(range(10, 21))  # 11 tokens: 2 full blocks + 3
    computed(bm, 0, prompt)
    assert bm.num_cached_blocks == 2
    assert bm.admit(1, prompt + [99]) == 8  # both full blocks
    assert bm.table(1) == bm.table(0)[:2] and bm.blocks.ref_count[bm.table(0)[0]] == 2
    assert bm.admit(2, prompt[:8]) == 4  # the whole prompt is cached: the last block is recomputed
    assert bm.admit(3, [10, 11, 12, 99, 14]) == 0  # differs in the first block
    other = BlockManager(num_blocks=8, block_size=4, cache_salt=b"model-b")
    computed(other, 0, prompt)
    assert other.blocks.hash_of[other.table(0)[0]] != bm.blocks.hash_of[bm.table(0)[0]]  # salted


def test_keys_chain_through_predecessors() -> None:
    a = block_hash(block_hash(b"root", [1, 2]), [3, 4])
    b = block_hash(block_hash(b"root", [9, 9]), [3, 4])
    assert a != b and a == block_hash(block_hash(b"root", [1, 2]), [3, 4])


def test_unused_cached_blocks_are_evicted_least_recently_used_first() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    computed(bm, 0, [1, 2, 3, 4])  # blocks A B, cached
    computed(bm, 1, [5, 6, 7])  # blocks C (cached) D
    bm.free(0)
    bm.free(1)
    assert bm.num_free_blocks == 4 and bm.num_evictable_blocks == 3 and bm.num_cached_blocks == 3
    assert bm.allocate(2, 2)  # the empty block D comes first
    assert bm.num_cached_blocks == 3
    assert bm.allocate(2, 4)  # then the least recently freed cached block: seq 0's tail (B) before A
    assert bm.admit(3, [1, 2, 3, 4, 0]) == 2  # A still there, B evicted
    bm.free(3)
    bm.free(2)
    assert bm.reset_prefix_cache() == 2 and bm.num_cached_blocks == 0 and bm.num_free_blocks == 4


def test_blocks_in_use_are_never_evicted() -> None:
    bm = BlockManager(num_blocks=3, block_size=2)
    computed(bm, 0, [1, 2, 3, 4])
    bm.free(0)
    assert bm.admit(1, [1, 2, 3, 4, 5]) == 4  # takes both cached blocks back
    assert not bm.allocate(2, 4) and bm.allocate(2, 2)
    assert bm.reset_prefix_cache() == 0 and bm.num_cached_blocks == 2  # in use: kept


def test_the_first_block_with_a_key_wins() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    computed(bm, 0, [1, 2])
    computed(bm, 1, [1, 2])  # computed concurrently, not shared
    assert bm.num_cached_blocks == 1
    bm.free(0)
    bm.free(1)
    assert bm.num_evictable_blocks == 1 and bm.num_free_blocks == 4


def test_recurrent_state_slots_come_from_the_same_interface() -> None:
    bm = BlockManager(num_blocks=8, block_size=4, num_state_slots=2)
    assert not bm.prefix_caching  # recurrent state is not per block
    assert bm.allocate(0, 3) and bm.allocate(1, 3)
    assert {bm.state_slot(0), bm.state_slot(1)} == {0, 1}
    assert bm.allocate(0, 6) and bm.state_slot(0) in (0, 1)  # growing keeps the slot
    assert not bm.allocate(2, 1) and bm.num_used_blocks == 3  # no slot left: nothing taken
    bm.free(0)
    assert bm.allocate(2, 1) and bm.state_slot(2) is not None and bm.state_slot(0) is None


def test_commit_past_the_allocated_blocks_is_a_bug() -> None:
    bm = BlockManager(num_blocks=2, block_size=2)
    assert bm.allocate(0, 2)
    with pytest.raises(AssertionError, match="past its blocks"):
        bm.commit(0, [1, 2, 3])


def test_prepare_step_allocates_only_what_is_missing_and_reports_where_kv_lives() -> None:
    bm = BlockManager(num_blocks=6, block_size=4, prefix_caching=False)
    computed(bm, 0, [1, 2, 3])
    assert bm.allocate(1, 4)  # what the scheduler does before the runner
    used = bm.num_used_blocks
    room = bm.prepare_step([0, 1], [1, 4])
    assert room is not None and bm.num_used_blocks == used  # both already had room
    assert (room.starts, room.tables, room.state_slots) == ([3, 0], [bm.table(0), bm.table(1)], [None, None])
    room = bm.prepare_step([0, 2], [2, 5])  # seq 0 grows into a second block; 2 is new
    assert room is not None and room.starts == [3, 0] and [len(t) for t in room.tables] == [2, 2]
    assert bm.prepare_step([1, 3], [5, 9]) is None  # 1 gets its block, 3 cannot: the earlier keep theirs
    assert len(bm.table(1)) == 2 and bm.num_free_blocks == 0


def test_prepare_step_takes_state_slots() -> None:
    bm = BlockManager(num_blocks=8, block_size=4, num_state_slots=1)
    room = bm.prepare_step([0], [3])
    assert room is not None and room.state_slots == [0]
    assert bm.prepare_step([1], [1]) is None  # no slot left


def test_commit_step_equals_commits_one_by_one() -> None:
    import random

    rng = random.Random(0)
    one, many = BlockManager(64, 4), BlockManager(64, 4)
    seqs = [0, 1, 2]
    for step in range(12):
        sizes = [1 if step > 2 else rng.randint(1, 6) for _ in seqs]
        tokens = [rng.randrange(50) for _ in range(sum(sizes))]
        end = 0
        for s, n in zip(seqs, sizes):
            assert one.allocate(s, one.num_computed(s) + n) and many.allocate(s, many.num_computed(s) + n)
            one.commit(s, tokens[end : end + n])
            end += n
        many.commit_step(seqs, tokens, sizes)
        for s in seqs:
            assert many._seqs[s] == one._seqs[s]  # tokens, table and prefix keys
        assert many.blocks._index == one.blocks._index
    assert many.extents([0, 7]) == ([many.num_computed(0), 0], [4 * len(many.table(0)), 0])


def test_commit_step_refuses_tokens_past_the_blocks() -> None:
    bm = BlockManager(8, 4)
    assert bm.allocate(0, 4)
    bm.commit(0, [1, 2, 3, 4])
    with pytest.raises(AssertionError, match="past its blocks"):
        bm.commit_step([0], [5], [1])

"""Packing a step: the flat form equals the per-chunk form; block tables reused across steps."""

from __future__ import annotations

import random

import numpy as np

from mgx.runtime.batch import BlockTableCache, PagedStep, SeqChunk, StepBatch, block_table_array


def test_packed_equals_pack() -> None:
    rng = random.Random(0)
    for _ in range(50):
        b = rng.randint(1, 6)
        lengths = [rng.choice([1, 1, rng.randint(1, 9)]) for _ in range(b)]
        starts = [rng.randint(0, 40) for _ in range(b)]
        samples = [rng.random() < 0.8 for _ in range(b)]
        ids = [[rng.randrange(100) for _ in range(n)] for n in lengths]
        want = StepBatch.pack([SeqChunk(i, t, sample=s) for i, (t, s) in enumerate(zip(ids, samples))], starts)
        flat = np.array([t for row in ids for t in row], dtype=np.int64)
        got = StepBatch.packed(list(range(b)), flat, lengths, starts, samples)
        for name in ("token_ids", "positions", "cu_seqlens", "sample_rows", "cu_sample_rows"):
            np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=name)
            assert getattr(got, name).dtype == getattr(want, name).dtype, name
        tables = [list(range(10 * i, 10 * i + (s + n + 3) // 4)) for i, (s, n) in enumerate(zip(starts, lengths))]
        a, c = PagedStep.build(got, tables, 4), PagedStep.build(want, tables, 4)
        for name in ("block_tables", "context_lens", "query_start_loc", "slot_mapping", "state_slots"):
            np.testing.assert_array_equal(getattr(a, name), getattr(c, name), err_msg=name)


def test_block_table_array_pads_with_minus_one() -> None:
    got = block_table_array([[3, 4], [], [7]])
    np.testing.assert_array_equal(got, [[3, 4], [-1, -1], [7, -1]])
    assert got.dtype == np.int32
    assert block_table_array([[]]).shape == (1, 1) and block_table_array([]).shape == (0, 1)


def test_block_table_cache_equals_a_fresh_build_as_tables_grow_and_change() -> None:
    rng = random.Random(1)
    cache = BlockTableCache()
    tables = [[rng.randrange(100)] for _ in range(5)]
    previous = None
    for _ in range(200):
        r = rng.random()
        if r < 0.5:  # decode steps: a few tables grow (in place, as the block manager's do)
            for t in rng.sample(tables, rng.randint(0, min(2, len(tables)))):
                t.append(rng.randrange(100))
        elif r < 0.6:  # a sequence finishes, another joins with a new list
            tables[rng.randrange(len(tables))] = [rng.randrange(100) for _ in range(rng.randint(0, 3))]
        elif r < 0.7:
            rng.shuffle(tables)
        elif r < 0.8:
            tables = tables[:-1] if len(tables) > 1 else tables + [[1, 2]]
        got = cache(tables)
        np.testing.assert_array_equal(got, block_table_array(tables))
        assert got is not previous  # a backend may still hold the last one
        if previous is not None and previous.shape == got.shape:
            assert not np.shares_memory(got, previous)
        previous = got

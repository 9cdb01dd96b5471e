"""Draft vocabulary: top-k by assistant-token frequency, ties by id, d2t/t2d consistency."""
import pytest
import torch

from eagle3lib.vocab import (
    build_draft_vocab,
    count_assistant_tokens,
    coverage,
    coverage_curve,
    draft_to_target_ids,
    load_vocab,
    ranked_token_ids,
    save_vocab,
    shrink_draft_vocab,
)


def check_consistent(d2t, t2d, draft_size, vocab_size):
    assert d2t.dtype == torch.int64 and d2t.shape == (draft_size,)
    assert t2d.dtype == torch.bool and t2d.shape == (vocab_size,)
    target_ids = draft_to_target_ids(d2t)
    assert bool(t2d[target_ids].all())                 # every draft id maps into the vocabulary
    assert int(t2d.sum()) == draft_size
    assert bool((target_ids[1:] > target_ids[:-1]).all())  # sorted by target id, no repeats


def test_top_k_with_ties_broken_by_id():
    counts = torch.tensor([0, 5, 3, 5, 0, 1, 0, 3, 0, 0])
    # Ranking: 1 (5), 3 (5), 2 (3), 7 (3), 5 (1), then the zeros by id.
    assert ranked_token_ids(counts)[:6].tolist() == [1, 3, 2, 7, 5, 0]
    d2t, t2d = build_draft_vocab(counts, 3)   # 1 and 3, then 2 beats 7 on the tie
    check_consistent(d2t, t2d, 3, 10)
    assert draft_to_target_ids(d2t).tolist() == [1, 2, 3]
    assert d2t.tolist() == [1, 1, 1]
    d2t, t2d = build_draft_vocab(counts, 4)
    assert draft_to_target_ids(d2t).tolist() == [1, 2, 3, 7]
    assert d2t.tolist() == [1, 1, 1, 4]
    assert t2d.nonzero().flatten().tolist() == [1, 2, 3, 7]


def test_random_counts_are_consistent():
    g = torch.Generator().manual_seed(0)
    vocab_size = 1000
    counts = torch.randint(0, 7, (vocab_size,), generator=g)  # many ties
    for size in (2, 17, 500, 999):
        d2t, t2d = build_draft_vocab(counts, size)
        check_consistent(d2t, t2d, size, vocab_size)
        kept = set(draft_to_target_ids(d2t).tolist())
        # No token outside the vocabulary is more frequent than one inside it.
        assert counts[t2d].min() >= counts[~t2d].max()
        # Inside the boundary count, the kept ids are the smallest ones.
        boundary = int(counts[t2d].min())
        at_boundary = (counts == boundary).nonzero().flatten().tolist()
        kept_at_boundary = [i for i in at_boundary if i in kept]
        assert kept_at_boundary == at_boundary[:len(kept_at_boundary)]


def test_fewer_seen_tokens_than_size_fills_smallest_unseen_ids():
    counts = torch.zeros(20, dtype=torch.int64)
    counts[5], counts[8] = 2, 9
    d2t, t2d = build_draft_vocab(counts, 4)
    check_consistent(d2t, t2d, 4, 20)
    assert draft_to_target_ids(d2t).tolist() == [0, 1, 5, 8]


def test_full_vocabulary_is_identity():
    counts = torch.randint(0, 3, (64,), generator=torch.Generator().manual_seed(1))
    d2t, t2d = build_draft_vocab(counts, 64)
    assert bool((d2t == 0).all()) and bool(t2d.all())


def test_size_out_of_range_raises():
    with pytest.raises(ValueError):
        build_draft_vocab(torch.ones(8, dtype=torch.int64), 9)


def test_count_assistant_tokens_uses_the_mask_only():
    seqs = [([1, 2, 3, 2], [0, 1, 1, 1]), ([4, 4, 1], [1, 0, 1])]
    counts = count_assistant_tokens(seqs, 6)
    assert counts.tolist() == [0, 1, 2, 1, 1, 0]
    with pytest.raises(ValueError, match="vocab size"):
        count_assistant_tokens([([7], [1])], 6)


def test_coverage_and_curve():
    counts = torch.tensor([10, 0, 5, 3, 2])        # 20 assistant tokens
    _, t2d = build_draft_vocab(counts, 2)           # ids 0 and 2: 15 of 20
    assert coverage(counts, t2d) == pytest.approx(0.75)
    curve = coverage_curve(counts, [1, 2, 3, 5, 99])
    assert curve == pytest.approx({1: 0.5, 2: 0.75, 3: 0.9, 5: 1.0})
    assert coverage(torch.zeros(5, dtype=torch.int64), t2d) == 0.0


def test_save_load_roundtrip(tmp_path):
    counts = torch.randint(0, 50, (300,), generator=torch.Generator().manual_seed(2))
    d2t, t2d = build_draft_vocab(counts, 40)
    path = tmp_path / "vocab.safetensors"
    save_vocab(path, d2t, t2d)
    d2t2, t2d2 = load_vocab(path)
    assert torch.equal(d2t, d2t2) and torch.equal(t2d, t2d2)
    bad = t2d.clone()
    bad[int(draft_to_target_ids(d2t)[0])] = False   # drop one kept id from t2d
    save_vocab(path, d2t, bad)
    with pytest.raises(ValueError, match="disagree"):
        load_vocab(path)
    with pytest.raises(ValueError):
        save_vocab(path, d2t.to(torch.int32), t2d)


def test_shrink_keeps_the_most_frequent_draft_tokens():
    # Draft vocabulary = target ids [1, 2, 3, 7, 9]; counts rank them 7, 3 = 9 (tie: 3 first), 1, 2.
    counts = torch.tensor([50, 4, 1, 6, 0, 40, 0, 9, 0, 6])   # 0 and 5 are frequent but not draft tokens
    d2t, _ = build_draft_vocab(torch.tensor([0, 9, 8, 7, 0, 0, 0, 6, 0, 5]), 5)
    assert draft_to_target_ids(d2t).tolist() == [1, 2, 3, 7, 9]
    rows, small_d2t, small_t2d = shrink_draft_vocab(d2t, counts, 3)
    check_consistent(small_d2t, small_t2d, 3, 10)
    assert draft_to_target_ids(small_d2t).tolist() == [3, 7, 9]
    assert rows.tolist() == [2, 3, 4]                          # their rows in the old head, ascending
    assert draft_to_target_ids(d2t)[rows].tolist() == [3, 7, 9]
    rows, small_d2t, _ = shrink_draft_vocab(d2t, counts, 2)    # the tie at 6 goes to the smaller id
    assert draft_to_target_ids(small_d2t).tolist() == [3, 7]
    rows, small_d2t, small_t2d = shrink_draft_vocab(d2t, counts, 5)   # same size: unchanged
    assert torch.equal(small_d2t, d2t) and rows.tolist() == [0, 1, 2, 3, 4]


def test_shrink_size_out_of_range_raises():
    d2t, _ = build_draft_vocab(torch.arange(10), 4)
    for size in (0, 5):
        with pytest.raises(ValueError, match="must be in 1..4"):
            shrink_draft_vocab(d2t, torch.arange(10), size)

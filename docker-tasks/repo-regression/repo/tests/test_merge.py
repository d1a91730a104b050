from intervals import merge


def test_overlapping_ranges_merge() -> None:
    assert merge([(1, 4), (2, 6), (8, 9)]) == [(1, 6), (8, 9)]


def test_disjoint_ranges_stay() -> None:
    assert merge([(5, 6), (1, 2)]) == [(1, 2), (5, 6)]

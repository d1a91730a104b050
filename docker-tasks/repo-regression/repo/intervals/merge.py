"""Merge closed integer ranges."""


def merge(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The union of closed ranges [start, end] as sorted, disjoint ranges; ranges that touch are merged."""
    merged: list[tuple[int, int]] = []
    for start, end in sorted(ranges):
        if not merged:
            merged.append((start, end))
            continue
        if start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged

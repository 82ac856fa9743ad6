"""Sequences of token ids: where two renderings agree, and where a piece of one occurs in another."""

from __future__ import annotations


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def common_suffix(a: list[int], b: list[int], limit: int | None = None) -> int:
    n = min(len(a), len(b)) if limit is None else min(len(a), len(b), limit)
    i = 0
    while i < n and a[-1 - i] == b[-1 - i]:
        i += 1
    return i


def is_prefix(p: list[int], x: list[int]) -> bool:
    return len(p) <= len(x) and x[:len(p)] == p


def last_occurrence(x: list[int], g: list[int], lo: int, hi: int) -> int | None:
    """End of the last occurrence of g in x[lo:hi], or None."""
    n = len(g)
    for k in range(hi, lo + n - 1, -1):
        if x[k - n:k] == g:
            return k
    return None


def after_longest_suffix(x: list[int], prompt: list[int], lo: int, hi: int) -> int | None:
    """End of the longest suffix of `prompt` found in x[lo:hi] (the last such place on a tie), or None."""
    best, at = 0, None
    for k in range(lo + 1, hi + 1):
        n = 0
        while n < len(prompt) and k - n > lo and x[k - 1 - n] == prompt[-1 - n]:
            n += 1
        if n and n >= best:
            best, at = n, k
    return at


__all__ = ["after_longest_suffix", "common_prefix", "common_suffix", "is_prefix", "last_occurrence"]

"""Arithmetic every layer needs."""


def cdiv(a: int, b: int) -> int:
    """``a / b`` rounded up (for non-negative ``a`` and positive ``b``): pages for tokens, blocks
    for a vocabulary, rounds for a batch."""
    return -(-a // b)

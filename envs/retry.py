"""The wait between two attempts of a call to a service that may come back: exponential, capped,
with jitter so that many clients failing together do not retry together."""

from __future__ import annotations

import random


def longest_backoff_s(attempt: int, base_s: float, cap_s: float) -> float:
    """The longest wait after failed attempt ``attempt`` (1-based): ``base_s · 2^(attempt−1)``, at most ``cap_s``."""
    return min(base_s * 2 ** (attempt - 1), cap_s)


def backoff_s(attempt: int, base_s: float, cap_s: float) -> float:
    """The wait after failed attempt ``attempt``: between half of :func:`longest_backoff_s` and all of it."""
    return longest_backoff_s(attempt, base_s, cap_s) * (0.5 + random.random() / 2)

"""Numbers reported about a model's loss, computed the same way wherever they are shown."""

from __future__ import annotations

import math

# exp() of a larger loss overflows a float; such a perplexity is reported as infinite.
_LARGEST_EXPONENT = 700


def perplexity(loss: float) -> float:
    """The exponential of a mean next-token cross-entropy (in nats)."""
    return math.exp(loss) if loss < _LARGEST_EXPONENT else math.inf

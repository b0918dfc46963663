"""Overlong responses (DAPO, Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning
System at Scale", section 3.4): a soft length penalty in the last tokens before the limit,
and optionally no loss at all on responses the limit cut.

The penalty shapes what the advantages read; the outcome itself (the reward function's
score, which metrics and any filter on outcome spread read) is left as it was.
"""

from __future__ import annotations

import torch
from torch import Tensor


def overlong_penalty(lengths: Tensor, max_length: int, buffer: int, factor: float = 1.0) -> Tensor:
    """DAPO's soft overlong punishment of each response, (B,) -> (B,) float32, <= 0.

    With L = max_length and a buffer of b tokens: 0 for a length <= L - b, falling linearly
    to -factor at L ((L - b - length) / b x factor), and -factor beyond L (a response a
    limit longer than this one's cut). buffer 0: no penalty below the limit."""
    lengths = lengths.to(torch.float32)
    if buffer <= 0:
        return torch.where(lengths > max_length, -factor, 0.0)
    start = max_length - buffer
    ramp = (start - lengths) / buffer * factor  # negative inside the buffer
    penalty = torch.where(lengths > start, ramp, 0.0)
    return torch.where(lengths > max_length, -factor, penalty).clamp(max=0.0)

"""A shared check of compiled decoding: the eager tokens, and no compile per decode step."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch._dynamo.utils import counters

from moe_lit.inference import generate


def assert_compiled_decoding_repeats_eager(model, prompts: Sequence[Sequence[int]], steps: int) -> int:
    """``generate(compile=True)`` gives ``generate``'s tokens for 3, 5 and ``steps`` new tokens, and
    the longest run compiles no new frame; returns dynamo's compiled-frame count after it.

    NOTE: the 3- and 5-token runs use two cache lengths, the second of which makes dynamo mark the
    slot dimension dynamic; the ``steps``-token run then decodes more steps, each at a new start
    slot, so a graph per step (or per active-neuron set) would compile again there.
    """
    eager = generate(model, prompts, steps)
    torch._dynamo.reset()
    counters.clear()
    assert generate(model, prompts, 3, compile=True) == [row[:3] for row in eager]
    assert generate(model, prompts, 5, compile=True) == [row[:5] for row in eager]
    frames = counters["frames"]["ok"]
    assert generate(model, prompts, steps, compile=True) == eager
    assert counters["frames"]["ok"] == frames
    return frames

"""What a draft token costs here: an online fit of decode-step time against tokens computed.

A decode step (no prefill chunk) takes about `a + b * tokens`, where tokens counts every
request's token and drafts, and the time runs from scheduling to the end of proposing (so a
draft model's forwards fall into `b` too). The fit is least squares over recent steps, each
weighing DECAY times the one after it, so it follows the machine's speed as it drifts.

    CPU, SmolLM2-135M, one request: a ~ 6 ms, b ~ 2.8 ms (a draft costs a third of a step)
    GPU, small batches: b is a few percent of a (a draft is nearly free)
"""

from __future__ import annotations

DECAY = 0.97  # weight of a step relative to the next: about the last 30 steps count
MIN_SPREAD = 0.25  # variance of the token counts needed before the slope is trusted


class StepCost:
    def __init__(self) -> None:
        self._n = self._x = self._y = self._xx = self._xy = 0.0

    def observe(self, num_tokens: int, seconds: float) -> None:
        d = DECAY
        self._n = d * self._n + 1
        self._x = d * self._x + num_tokens
        self._y = d * self._y + seconds
        self._xx = d * self._xx + num_tokens * num_tokens
        self._xy = d * self._xy + num_tokens * seconds

    def fit(self) -> tuple[float, float] | None:
        """(a, b) in seconds, or None until steps of different sizes have been seen."""
        if self._n < 2:
            return None
        mean_x, mean_y = self._x / self._n, self._y / self._n
        var_x = self._xx / self._n - mean_x * mean_x
        if var_x < MIN_SPREAD:
            return None
        b = (self._xy / self._n - mean_x * mean_y) / var_x
        a = mean_y - b * mean_x
        # Noise can tip the line; a step never gets cheaper with more tokens, nor costs < 0.
        b = max(b, 0.0)
        return max(a, 0.0), b

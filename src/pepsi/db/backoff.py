"""Reconnect delays: capped, jittered, doubling from a short first try.

Every program that rides out a lost database (dispatcher, listener, workers,
bouncer, publishers) waits by this one policy, so a failover costs each of
them at most `cap` after the new primary accepts connections, and a fleet of
them does not knock on the new primary in lockstep. Pure: the random source
is injected.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from pepsi.config.model import DispatchOptions

FIRST_DELAY = 0.1  # seconds: a restart or a failover's last step is often this short
# RECONNECT_MAX_DELAY's default (the config model is its one source): Pepsi's share of an outage
DEFAULT_CAP = DispatchOptions.reconnect_max_delay


@dataclass(frozen=True)
class Backoff:
    """Delays first, 2·first, 4·first … capped at `cap`, each drawn in [d/2, d]."""

    cap: float = DEFAULT_CAP
    first: float = FIRST_DELAY

    def __post_init__(self) -> None:
        if not (self.cap > 0 and self.first > 0):  # a zero delay would spin on a dead server
            raise ValueError(f"backoff delays must be positive, got {self.first}, {self.cap}")

    def delays(self, rng: Callable[[], float] = random.random) -> Iterator[float]:
        """An endless series of delays; `rng` returns a float in [0, 1)."""
        nominal = min(self.first, self.cap)
        while True:
            yield nominal * (0.5 + 0.5 * rng())
            nominal = min(self.cap, nominal * 2)

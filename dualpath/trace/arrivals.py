"""When each agent starts and when each of its rounds is due: pure schedule code.

Offline mode: N agents start together (t = 0) -> the batch's JCT. Online mode: agents
arrive as a Poisson process at ``aps`` agents per second (seeded) -> TTFT/TTST/TPOT.
Either way an agent runs its rounds one after another: round k+1 is due when round k's
last token was generated (plus ``think_time_s``, 0 by default as in the paper's replay).

:class:`ReplaySchedule` is the bookkeeping a replay driver needs. It does no I/O and
reads time only through the injected ``clock``; one thread (the driver's event loop)
owns it. Per agent the states are::

    WAITING(arrival) -> DUE(round k) -> IN_FLIGHT(round k) -> DUE(round k+1) ... -> DONE

``due()`` hands out every round whose time has come (DUE -> IN_FLIGHT) and ``finish()``
closes one (IN_FLIGHT -> DUE(next) or DONE).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from dualpath import clock as _clock
from dualpath.errors import UsageError
from dualpath.trace.model import RoundPlan, Trajectory, plan_rounds

MODES = ("offline", "online")


def arrival_times(n_agents: int, mode: str, *, aps: float | None = None,
                  seed: int = 0) -> list[float]:
    """Start time of each agent in seconds from the replay's start.

    Offline: all 0. Online: a Poisson process of rate ``aps`` (exponential gaps of mean
    1/aps, the first gap included), so agent i arrives at the sum of i+1 gaps.
    """
    if not (isinstance(n_agents, int) and n_agents >= 1):
        raise UsageError(f"number of agents must be an integer >= 1, got {n_agents!r}")
    if mode == "offline":
        if aps is not None:
            raise UsageError("offline mode starts every agent at once; aps is for online mode")
        return [0.0] * n_agents
    if mode == "online":
        if aps is None or not aps > 0:
            raise UsageError(f"online mode needs aps > 0 (agents per second), got {aps!r}")
        gaps = np.random.default_rng(seed).exponential(1.0 / aps, n_agents)
        return np.cumsum(gaps).tolist()
    raise UsageError(f"unknown replay mode {mode!r}; choose one of {MODES}")


@dataclass(frozen=True)
class RoundRequest:
    """One round of one agent, as handed to the driver."""

    agent: int
    trajectory: Trajectory
    plan: RoundPlan
    due_s: float  # when the schedule made it due, seconds from the replay's start

    @property
    def round(self) -> int:
        return self.plan.index

    @property
    def request_id(self) -> str:
        return f"a{self.agent}-r{self.plan.index}"


class ReplaySchedule:
    """Bookkeeping of a replay: which rounds are due, in flight, done. See the module
    docstring for the state machine. Not thread-safe: one owner thread or event loop."""

    def __init__(self, trajectories: Sequence[Trajectory], arrivals: Sequence[float], *,
                 block_tokens: int, think_time_s: float = 0.0,
                 clock: Callable[[], float] = _clock.now):
        if len(trajectories) != len(arrivals):
            raise UsageError(f"{len(trajectories)} trajectories but {len(arrivals)} arrival "
                             "times: one trajectory per agent")
        if not trajectories:
            raise UsageError("a replay needs at least one agent")
        if think_time_s < 0:
            raise UsageError(f"think_time_s must be >= 0, got {think_time_s!r}")
        self._trajs = list(trajectories)
        self._plans = [plan_rounds(t, block_tokens) for t in self._trajs]
        self._think = float(think_time_s)
        self._clock = clock
        self._t0: float | None = None
        self._heap = [(float(t), agent) for agent, t in enumerate(arrivals)]
        heapq.heapify(self._heap)
        self._next_round = [0] * len(self._trajs)
        self._in_flight: dict[int, RoundRequest] = {}
        self.total_rounds = sum(len(p) for p in self._plans)
        self.finished_rounds = 0

    def start(self) -> None:
        """Fix time zero at ``clock()``; every other time is relative to it."""
        if self._t0 is not None:
            raise UsageError("replay schedule already started")
        self._t0 = self._clock()

    def elapsed(self) -> float:
        if self._t0 is None:
            raise UsageError("replay schedule not started")
        return self._clock() - self._t0

    def due(self) -> list[RoundRequest]:
        """Every round due by now, earliest first; they are in flight from here on."""
        now = self.elapsed()
        out = []
        while self._heap and self._heap[0][0] <= now:
            t, agent = heapq.heappop(self._heap)
            req = RoundRequest(agent, self._trajs[agent],
                               self._plans[agent][self._next_round[agent]], t)
            self._in_flight[agent] = req
            out.append(req)
        return out

    def finish(self, req: RoundRequest) -> None:
        """The round's last token was generated now; the agent's next round becomes due
        after ``think_time_s``."""
        if self._in_flight.get(req.agent) is not req:
            raise UsageError(f"{req.request_id} is not in flight")
        now = self.elapsed()
        del self._in_flight[req.agent]
        self.finished_rounds += 1
        self._next_round[req.agent] += 1
        if self._next_round[req.agent] < len(self._plans[req.agent]):
            heapq.heappush(self._heap, (now + self._think, req.agent))

    def next_due_s(self) -> float | None:
        """When the next round becomes due (seconds from the start; may be in the past),
        or None when nothing is waiting (all in flight, or done)."""
        return self._heap[0][0] if self._heap else None

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    @property
    def done(self) -> bool:
        return self.finished_rounds == self.total_rounds

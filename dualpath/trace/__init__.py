"""Agentic traces: the Table 2 generator, the JSONL format, the replay rule and schedule,
and result reporting. Pure code; the replay daemons drive it."""

from dualpath.trace.model import Round, RoundPlan, Trace, Trajectory, plan_rounds

__all__ = ["Round", "RoundPlan", "Trace", "Trajectory", "plan_rounds"]

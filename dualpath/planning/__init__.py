"""Deployment planning from hardware figures: the paper's §4.2 bottleneck-free P/D range
and §8.2's working-set estimate (:mod:`.capacity`). Pure functions; the simulator and
the reproduction commands print them beside what they measure."""

from dualpath.planning.capacity import (
    Hardware,
    PdRange,
    bottleneck_free_range,
    working_set_bytes,
)

__all__ = ["Hardware", "PdRange", "bottleneck_free_range", "working_set_bytes"]

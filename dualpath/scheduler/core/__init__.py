"""The scheduler's pure core: records, the §6.1 policies, §6.2 batching, the Scheduler.

No I/O and no gRPC here; see dualpath.scheduler.service for the RPC edge.
"""

from dualpath.scheduler.core.errors import (
    Conflict,
    LeaseError,
    NotFound,
    PermissionDenied,
    SchedulerError,
)
from dualpath.scheduler.core.model import (
    Completion,
    CompletionStage,
    Engine,
    EngineReport,
    EngineSpec,
    FetchResult,
    Group,
    Node,
    Params,
    ReadSide,
    Request,
    RequestSpec,
    Role,
    Stage,
)
from dualpath.scheduler.core.scheduler import Scheduler

__all__ = [
    "Completion", "CompletionStage", "Conflict", "Engine", "EngineReport", "EngineSpec",
    "FetchResult", "Group", "LeaseError", "Node", "NotFound", "Params", "PermissionDenied",
    "ReadSide", "Request", "RequestSpec", "Role", "Scheduler", "SchedulerError", "Stage",
]

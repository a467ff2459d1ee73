"""The scheduler's pure core: records, the §6.1 policies, §6.2 batching, the Scheduler.

No I/O and no gRPC here; see dualpath.scheduler.service for the RPC edge.
"""

from dualpath.scheduler.core.errors import (
    Conflict,
    LeaseError,
    NotFound,
    QueueFull,
    SchedulerError,
    UnknownGroup,
)
from dualpath.scheduler.core.model import (
    Claim,
    Completion,
    CompletionStage,
    Engine,
    EngineReport,
    EngineSpec,
    FetchResult,
    Finished,
    Group,
    Node,
    Outcome,
    Params,
    ReadSide,
    Request,
    RequestSpec,
    Role,
    Stage,
)
from dualpath.scheduler.core.scheduler import Scheduler, SubmitResult

__all__ = [
    "Claim", "Completion", "CompletionStage", "Conflict", "Engine", "EngineReport",
    "EngineSpec", "FetchResult", "Finished", "Group", "LeaseError", "Node", "NotFound",
    "Outcome", "Params", "QueueFull", "ReadSide", "Request", "RequestSpec", "Role",
    "Scheduler", "SchedulerError", "Stage", "SubmitResult", "UnknownGroup",
]

"""The scheduler's pure core: records, the §6.1 policies, the Scheduler.

No I/O and no gRPC here; see dualpath.scheduler.service for the RPC edge.
"""

from dualpath.scheduler.core.errors import (
    Conflict,
    LeaseError,
    NotFound,
    PermissionDenied,
    SchedulerError,
    UnknownGroup,
)
from dualpath.scheduler.core.model import (
    Admission,
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
    Rejection,
    RejectReason,
    Request,
    RequestSpec,
    Role,
    Stage,
)
from dualpath.scheduler.core.scheduler import Scheduler

__all__ = [
    "Admission",
    "Claim",
    "Completion",
    "CompletionStage",
    "Conflict",
    "Engine",
    "EngineReport",
    "EngineSpec",
    "FetchResult",
    "Finished",
    "Group",
    "LeaseError",
    "Node",
    "NotFound",
    "Outcome",
    "Params",
    "PermissionDenied",
    "ReadSide",
    "RejectReason",
    "Rejection",
    "Request",
    "RequestSpec",
    "Role",
    "Scheduler",
    "SchedulerError",
    "Stage",
    "UnknownGroup",
]

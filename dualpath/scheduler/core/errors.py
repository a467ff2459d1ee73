"""Domain errors of the scheduler core; the RPC edge maps each to one gRPC status code."""

from __future__ import annotations

from dualpath.errors import DualPathError


class SchedulerError(DualPathError):
    """Base of the scheduler's refusals."""


class LeaseError(SchedulerError):
    """The group's lease expired or was replaced: register again (FAILED_PRECONDITION)."""


class UnknownGroup(LeaseError):
    """A leader call names a group the scheduler does not know, e.g. after a restart:
    register again (FAILED_PRECONDITION, like any lease it does not hold)."""


class NotFound(SchedulerError):
    """Unknown engine or request in an operator's call (NOT_FOUND)."""


class Conflict(SchedulerError):
    """An id is already taken: a live request, or an engine/node of another group (ALREADY_EXISTS)."""


class PermissionDenied(SchedulerError):
    """The caller's identity does not own the group it names (PERMISSION_DENIED)."""

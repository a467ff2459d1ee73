"""The failures of a request on a node (each is reported FAILED; the scheduler requeues)."""

from __future__ import annotations

from dualpath.errors import DualPathError


class RequestFailed(DualPathError):
    """A request could not be served here; it is reported FAILED and requeued."""


class PeerUnavailable(RequestFailed):
    """A peer node did not answer or refused a call (the message names it and why)."""


class NeverFits(RequestFailed):
    """The request is larger than a node's buffer (the message names the key to raise):
    no attempt can succeed, so it is reported FAILED as final, not retried."""


class StaleAttempt(DualPathError):
    """A message of an older attempt than the one held for the request (ABORTED): the
    scheduler gave that execution up, so it may neither write, finish nor cancel."""


class NotYours(RequestFailed):
    """A request one node acts on for the scheduler, touched by another (PERMISSION_DENIED):
    a DE's request prepared by another PE, a PE's prefill stopped by a node that is not
    its DE."""

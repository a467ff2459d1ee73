"""Who may call a node daemon's services, by certificate identity (docs/security.md).

Every gRPC surface of a node speaks mutual TLS (dualpath/tls.py): a caller without a
certificate of the cluster's CA never completes the handshake. Past it, the caller's
identity (``spiffe://<trust_domain>/<role>/<name>``) decides what it may do:

- node-to-node calls (ExchangeEndpoint, PrepareRequest, PrefillDone, transfer orders,
  CancelRequest): cluster nodes only, and only on requests the caller prepared (a DE
  binds a request to the identity whose PrepareRequest made it);
- the KvConnector service: this node's own identity only (the vLLM instance beside the
  node runs its connector with the node's certificate);
- StorageReads, ForwardSteps and Holdings (figures): any cluster identity.

With ``tls.plaintext = true`` there are no identities and every check passes: plaintext
is an explicit opt-out, warned about at start-up.
"""

from __future__ import annotations

import grpc

from dualpath import tls
from dualpath.tls import Identity, TlsConfig


class Callers:
    """The checks of one node; ``node_id`` is this node's own identity name."""

    def __init__(self, cfg: TlsConfig, node_id: str):
        self.cfg = cfg
        self.node_id = node_id
        self.secure = not cfg.plaintext

    def identity(self, context) -> Identity | None:
        """The caller's identity (None over plaintext)."""
        if not self.secure:
            return None
        return tls.peer_identity(context, self.cfg.trust_domain)

    async def require(self, context, roles: tuple[str, ...] = ("node",), *,
                      own: bool = False) -> Identity | None:
        """The caller's identity, or the call aborted: UNAUTHENTICATED without one,
        PERMISSION_DENIED for a role not in ``roles`` (or, with ``own``, another node)."""
        if not self.secure:
            return None
        ident = self.identity(context)
        if ident is None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                "no cluster identity in the client certificate")
        if ident.role not in roles or (own and ident.name != self.node_id):
            want = f"node/{self.node_id}" if own else " or ".join(f"{r}/*" for r in roles)
            await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                f"{ident} may not call this (needs {want})")
        return ident

    async def require_owner(self, context, owner: Identity | None, request_id: str) -> None:
        """The caller must be the node that prepared ``request_id``."""
        if not self.secure:
            return
        ident = await self.require(context)
        if owner is not None and ident != owner:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                f"request {request_id} belongs to {owner}, not {ident}")

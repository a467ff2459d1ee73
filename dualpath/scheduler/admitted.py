"""A request runs as it was admitted: what its payload may say (pure).

The scheduler admits a request by its ``prompt_tokens``, ``hit_tokens`` and
``max_new_tokens`` (the memory, the context and the queue it counts); the engines run its
payload (dualpath/paths/payload.py). A payload that says other figures (more tokens to
generate than admitted, another prompt length, fewer carried token ids than the prompt)
would run what the scheduler never counted: it is refused at submit (INVALID, naming the
field), so every node can take the payload's figures as the admitted ones. An empty
payload says nothing (the request cannot run on a node; it is the submitter's).
"""

from __future__ import annotations

import base64
import binascii

from dualpath.errors import UsageError
from dualpath.paths.payload import Payload
from dualpath.scheduler.core.model import RequestSpec


def payload_disagreement(s: RequestSpec) -> str | None:
    """Why ``s``'s payload disagrees with what it asks the scheduler to admit, or None."""
    if not s.payload:
        return None
    try:
        p = Payload.decode(s.payload)
    except UsageError as e:
        return str(e)
    for field, said, admitted in (("prompt_tokens", p.prompt_tokens, s.prompt_tokens),
                                  ("hit_tokens", p.hit_tokens, s.hit_tokens),
                                  ("gen_tokens", p.gen_tokens, s.max_new_tokens)):
        if said != admitted:
            asked = "max_new_tokens" if field == "gen_tokens" else field
            return (f"payload {field} {said} disagrees with the request's {asked} "
                    f"{admitted}")
    if p.token_ids_b64:
        try:
            n = len(base64.b64decode(p.token_ids_b64, validate=True)) // 4
        except (binascii.Error, ValueError):
            return "payload token_ids_b64 is not base64"
        if n < s.prompt_tokens:
            return (f"payload carries {n} token ids for a prompt of {s.prompt_tokens} "
                    "tokens")
    return None

"""Transfer policy over the data-plane providers (verbs or TCP).

- :mod:`.provider`   the interface a transport implements (regions, connections, completions)
- :mod:`.tcp_provider`, :mod:`.verbs_provider`   its two implementations
- :mod:`.oob`        the out-of-band channel for endpoints and region keys
- :mod:`.transport`  ``[transport] kind`` -> which provider (logged; a metric label)
- :mod:`.plan`       pure slicing and spreading
- :mod:`.engine`     :class:`TransferEngine`: batches -> slices -> posts, retries, recovery
"""

from dualpath.transfer.config import TransferConfig
from dualpath.transfer.engine import Grant, TransferEngine
from dualpath.transfer.oob import ConnectReply, ConnectRequest, InProcessChannel, OutOfBand
from dualpath.transfer.provider import Connection, Provider, RegionInfo
from dualpath.transfer.transport import (
    TransportChoice,
    open_provider,
    select_transport,
    selected_transport,
)

__all__ = [
    "ConnectReply", "ConnectRequest", "Connection", "Grant", "InProcessChannel", "OutOfBand",
    "Provider", "RegionInfo", "TransferConfig", "TransferEngine", "TransportChoice",
    "open_provider", "select_transport", "selected_transport",
]

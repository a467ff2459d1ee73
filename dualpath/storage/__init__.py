"""The KV block store (files on a POSIX directory), its read queue and storage-NIC limit."""

from dualpath.storage.errors import StorageError
from dualpath.storage.store import BlockStore

__all__ = ["BlockStore", "StorageError"]

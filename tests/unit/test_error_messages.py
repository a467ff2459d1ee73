"""What an operator reads for errno-carrying errors: the message once, without OSError's
"[Errno N]" prefix in front of the same errno spelt out (errno values from errno.h)."""

import errno

from dualpath.errors import RdmaError
from dualpath.storage.errors import StorageError


def test_rdma_error_str_has_no_errno_prefix():
    e = RdmaError(-errno.ENODEV, "ibv_open_device")
    assert str(e) == "ibv_open_device: ENODEV (No such device)"
    assert e.errno == errno.ENODEV


def test_storage_error_str_has_no_errno_prefix_and_keeps_the_hint():
    e = StorageError(errno.ENOSPC, "writing block", "/kv/x")
    assert str(e).startswith("writing block /kv/x: ENOSPC (No space left on device); ")
    assert "storage.dir" in str(e) and e.errno == errno.ENOSPC

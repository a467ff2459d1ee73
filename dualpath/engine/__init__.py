"""PE and DE node daemons: engines grouped per node, both read paths, emulated compute.

- :mod:`.node`     the daemon (`dualpath node`): storage reader, buffers, HBM, leader loop
- :mod:`.prefill`  the PE side: one prefill per assignment, both read sides
- :mod:`.decode`   the DE side: prepare, the DE read, verify, decode, persist
- :mod:`.servicers` the Engine and Node gRPC services (protobuf <-> the paths)
- :mod:`.state`    what both sides share: engines, metrics, roles, RequestFailed
- :mod:`.kvplan`   request payloads, prompt blocks and layer runs (pure)
- :mod:`.oob`      TransferEngine connect requests over the Engine service
- :mod:`.config`   the [engine] and [cluster] config sections
"""

"""The node daemon (`dualpath node`): one process per node, serving one model engine.

- :mod:`.daemon`    assembles the node: transfer engine, buffers, the engine
  (``engine.kind``, dualpath/engines/), its path, the services, the leader
- :mod:`.leader`    registers the node's group with the scheduler and fetches its work
- :mod:`.servicers` the Engine and Node gRPC services (protobuf <-> the paths)
- :mod:`.holdings`  what the node holds (the idle invariant)
- :mod:`.config`    the [engine] and [cluster] config sections
- :mod:`.cli`       `dualpath node`
"""

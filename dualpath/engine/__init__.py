"""PE and DE node daemons: engines grouped per node, both read paths, emulated compute.

- :mod:`.node`     the daemon (`dualpath node`): storage reader, buffers, HBM, leader loop
- :mod:`.kvplan`   request payloads, prompt blocks and layer runs (pure)
- :mod:`.oob`      TransferEngine connect requests over the Engine service
- :mod:`.config`   the [engine] and [cluster] config sections
"""

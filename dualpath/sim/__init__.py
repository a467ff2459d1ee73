"""A discrete-event simulator of a DualPath cluster on the same code as the daemons
(`dualpath sim`, docs/sim.md).

The real scheduler core (:class:`dualpath.scheduler.core.Scheduler`, driven with the
simulated ``now``), the real PE batch packer (``pack_batch`` with the profiled
``AttentionFit``), the real cost model (``group_layer_time``, ``decode_step_s``) and the
real read-side split (``engine.assignment.split_blocks``); around them, models of what
the daemons would spend time on: each node's storage NIC (a read and a write FIFO at
the NIC's rate), the compute network, the PE/DE DRAM buffers and HBM, and optionally
the host CPU a local cluster spends per request and per byte. Everything it reports is
simulated and says so.

Modules: ``events`` (the clock and event heap), ``hardware`` (the figures a run takes),
``resources`` (FIFO links, buffer pools, the host CPU), ``nodes`` (PE nodes' forward
steps, DE engines' batched decode), ``cluster`` (the leaders, agents and the run),
``report`` (the replay report plus the scheduler's CPU per decision), ``cli``.
"""

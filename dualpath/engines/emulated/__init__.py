"""The emulated engine: a cost model for compute and "HBM" of our own, for benchmarks at
scale (labelled emulated wherever it reports).

- :mod:`.engine`       the cost model and the synthetic KV
- :mod:`.kind`         how a node opens it (dualpath/engines/protocol.py)
- :mod:`.prefill`      its prefill: the forward over the staged hit, layer by layer
- :mod:`.forward`      the PE's forward batches (paper §6.2) under the compute quota
- :mod:`.batching`     the batch packer and its profiled estimator (pure)
- :mod:`.decode`       its decode: verify every byte, the continuous decode batch
- :mod:`.decode_batch` the decode batch's steps (pure timing)
"""

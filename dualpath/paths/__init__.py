"""A node's request paths, whatever engine it serves: what a request holds and does here.

- :mod:`.prefill` / :mod:`.decode`  the PE and DE skeletons (attempts, cancels, fences,
  completions); an engine fills in its compute (dualpath/engines/)
- :mod:`.assignment`, :mod:`.payload`, :mod:`.roles`  an assignment as the paths take it
- :mod:`.kvplan`, :mod:`.kvspace`, :mod:`.layers`  a request's prompt blocks and routes,
  the node's KV space (format, store, buffer pool, read queue), layer sources
- :mod:`.peers`, :mod:`.fence`, :mod:`.auth`  the other nodes: calls, memory they may
  still write into, who may call what
- :mod:`.ranks`, :mod:`.resources`, :mod:`.metrics`, :mod:`.writeback`, :mod:`.errors`
  the engines of the group, what the daemon hands a path, its metrics, new KV on its way
  to storage, typed failures

Nothing here imports an engine or the daemon (import contracts: ``make lint``).
"""

"""Local clusters and trace replay: `dualpath up`, `dualpath replay`, `dualpath demo`.

- :mod:`.local`    spawn and supervise a scheduler and P+D node daemons as processes
- :mod:`.replay`   drive a trace through a running cluster; per-request timings
"""

"""`dualpath doctor`: why a node will not come up, before it is started.

:mod:`.facts` gathers what the host is (limits, devices, filesystems, ports, files);
:mod:`.checks` turns facts and the configuration into results (pure); :mod:`.cli`
prints them and exits with the worst one (0 ok, 1 warn, 2 fail)."""

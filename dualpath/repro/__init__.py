"""`dualpath repro`: the paper's figures, one command each (figures.py runs, plot.py
draws, cli.py is the command)."""

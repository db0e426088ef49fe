"""Pictures and a summary of runs: `python -m areal.report RUN_DIR [RUN_DIR ...]`.

data.py reads a run directory into plain series; plots.py draws them; __main__.py is the
command line."""

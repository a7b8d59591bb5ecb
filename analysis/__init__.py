"""Reports from run tables and traces: per-run metrics, the nondet-over-det speedup table, figures.

Reads tables (trace spans, ``runs.csv``), never simulator or runtime internals. matplotlib and pandas are
imported inside the functions that need them.
"""

"""The benchmark suite: one module per case under cases/, timing.py, report.py and the runner run.py."""

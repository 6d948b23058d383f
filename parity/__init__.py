"""Parity harnesses: each library layer run side by side with the reference it imitates (DeepSpeed,
one process, torch) and compared. Only tests, figures and benchmarks import this package; no library
code does."""

"""primitives' engine: what makes the textbook's collectives safe, fast and measurable.

The checked call (core.py, envelope.py), strict nccl ordering (strict.py), fault attribution
(faults.py), the ledger (ledger.py), topology and hierarchical algorithms (topology.py,
hierarchical.py), the shared-memory transport (shm*.py), the cost model behind "auto" (cost.py),
launching (launch.py), logging (log.py) and the verify-and-time scripts (runner.py, bench.py).
Nothing in the textbook (READING.md) imports this package.
"""

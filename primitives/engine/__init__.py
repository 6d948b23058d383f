"""primitives' engine: what makes the textbook's collectives safe, fast and measurable. It runs
the textbook's algorithm functions (primitives/<collective>.py) unchanged and wraps them:

    checked.py, comms.py     the checked Communicator (ledger, deadlines, strict mode, topology)
                             and its collective methods;
                             mpi_comm.py, shm.py: the MPI and shared-memory transports;
                             registry.py: get_comm(group)
    api.py, calls/           the torch.distributed-shaped drop-ins (coalesced calls included;
                             objects.py: the *_object calls) and the checked call per collective
    planned.py               plans: what a signature's first call decides (algorithm, check way)
                             and its later calls replay; a planned all_reduce on shared memory:
                             API -> Planned.run -> the textbook
    core.py, check.py, envelope.py, inband.py   the checked call: argument checks, the check
                             (in the data, or a round that also carries small calls' data), the
                             one executor for async calls
    cost.py, traffic.py      the α-β cost model behind "auto", and the exact bytes per algorithm
    subcomm.py, topology.py  ranks on several nodes: intra-/inter-node views, the two-level
                             algorithms on them, which node each rank is on
    shm_collectives.py, shm_segment.py   the segment, its flags and the check under the
                             textbook's shared-memory collectives (primitives/shm.py)
    strict.py, ledger.py     nccl's ordering rules on CPU, byte counts
    faults.py                naming the dead rank; communicator set-up through the store (a rank
                             that never arrives is named)
    runner.py, reference.py  the verify-and-time scripts and the backends' own collectives
Printing and launching ranks, which every package uses, live one level up: primitives/log.py, primitives/launch.py.
Nothing in the textbook (READING.md) imports this package.
"""

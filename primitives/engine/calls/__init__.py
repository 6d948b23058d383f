"""The checked collectives, one module per collective, each taking the communicator first:
all_reduce(comm, tensor, op, async_op, algorithm=, tag=). primitives/engine/api.py turns them
into torch.distributed's shape (group= instead of comm)."""

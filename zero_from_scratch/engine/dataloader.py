"""DeepSpeed's training data loader (runtime/dataloader.py): what initialize(training_data=...)
returns, and RepeatingLoader.

    engine, _, loader, _ = zero_from_scratch.initialize(model=m, training_data=dataset, config=cfg)
    for batch in loader: ...          # this rank's micro-batches: DistributedSampler over the ranks

Semantics kept from DeepSpeed 0.19.8: the sampler is DistributedSampler(num_replicas = data-
parallel size, rank = data-parallel rank), shuffled with its default seed 0, and set_epoch is
never called, so every epoch visits the same order (DeepSpeed's quirk); batch size = the config's
train_micro_batch_size_per_gpu; drop_last = the config's dataloader_drop_last; 2 worker processes
per rank unless num_local_io_workers says otherwise (none inside a daemonic process, which
cannot start them: the batches are the same); len() = ceil(len(sampler) / batch) (floor with
drop_last). With local_rank < 0 (no launcher), DeepSpeed uses a RandomSampler over the whole
data set instead, as here. pin_memory only where there is a GPU to pin for. Cost: a DataLoader.
"""
from __future__ import annotations

import math
import multiprocessing

from torch.utils.data import DataLoader, RandomSampler
from torch.utils.data.distributed import DistributedSampler


class RepeatingLoader:
    """Wraps an iterable so that iteration restarts it when it is exhausted (never StopIteration)."""

    def __init__(self, loader):
        self.loader = loader
        self.data_iter = iter(self.loader)

    def __iter__(self):
        return self

    def __next__(self):
        try:
            return next(self.data_iter)
        except StopIteration:
            self.data_iter = iter(self.loader)
            return next(self.data_iter)


class DeepSpeedDataLoader:
    def __init__(self, dataset, batch_size, pin_memory, local_rank, tput_timer, collate_fn=None,
                 num_local_io_workers=None, data_sampler=None, data_parallel_world_size=None,
                 data_parallel_rank=None, dataloader_drop_last=False):
        if data_sampler is None:
            data_sampler = (DistributedSampler(dataset, num_replicas=data_parallel_world_size, rank=data_parallel_rank)
                            if local_rank >= 0 else RandomSampler(dataset))
        self.num_local_io_workers = 2 if num_local_io_workers is None else num_local_io_workers
        if multiprocessing.current_process().daemon:      # cannot start workers: the same batches, read in-process
            self.num_local_io_workers = 0
        self.dataset, self.data_sampler, self.collate_fn = dataset, data_sampler, collate_fn
        self.batch_size, self.pin_memory, self.tput_timer = batch_size, pin_memory, tput_timer
        self.dataloader_drop_last = dataloader_drop_last
        self.data = None
        n = len(self.data_sampler)
        self.len = n // batch_size if dataloader_drop_last else math.ceil(n / batch_size)

    def __iter__(self):
        self._create_dataloader()
        return self

    def __len__(self) -> int:
        return self.len

    def __next__(self):
        if self.tput_timer:
            self.tput_timer.start()
        return next(self.data)

    def _create_dataloader(self) -> DataLoader:
        kw = {} if self.collate_fn is None else {"collate_fn": self.collate_fn}
        self.dataloader = DataLoader(self.dataset, batch_size=self.batch_size, pin_memory=self.pin_memory,
                                     sampler=self.data_sampler, num_workers=self.num_local_io_workers,
                                     drop_last=self.dataloader_drop_last, **kw)
        self.data = (x for x in self.dataloader)
        return self.dataloader

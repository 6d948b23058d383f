"""ZeRO-3's trace, prefetch, reuse and live-parameter cap: a mixin of Stage3 (stage3.py).

    torchrun --standalone --nproc_per_node 2 -m zero_from_scratch.demo --stage 3 --zero overlap_comm=true

The first training micro-batch records the order in which Stage3's hooks ask for units — forward
pre-hooks, then backward pre-hooks — as [(kind, unit)]: the *trace* (DeepSpeed records the same
module order on its first step). Later micro-batches walk it:
  prefetch   after each demand, all-gather asynchronously the next units of the trace, keeping at
             most stage3_prefetch_bucket_size elements ahead and gathered + in-flight elements
             ≤ stage3_max_live_parameters. Cost: no extra bytes (each gather happens once, only
             earlier); memory: up to the cap.
  reuse      after a module's forward, keep its unit gathered if the trace asks for it again
             within stage3_max_reuse_distance elements (its own backward, for the last layers;
             for every layer at DeepSpeed's default 1e9): saves that backward gather.
  room       a demand that would pass the cap first releases units kept for reuse, oldest first.
Every rank walks the same trace, so the prefetches pair up; a micro-batch that leaves the trace
stops prefetching and keeping (demand gathers only) and stays correct.
"""
from __future__ import annotations

import torch


class Prefetch:
    """Needs from Stage3: e (engine), trace, tpos, trace_ok, in_train, recording, prefetched,
    gathered_units, kept, live, max_live, prefetch_budget, reuse_distance, fwd_pos, stats,
    _check, _count_live, _release, param_shard, dev."""

    def _make_room(self, need: int) -> None:
        """Evict units kept for reuse (oldest first) until `need` more elements fit under max_live."""
        while self.kept and self.live + need > self.max_live:
            self._release(self.unit(self.kept[0]), force=True)
            self.stats["evicted"] += 1

    # ------------------------------------------------------------------ the trace and prefetch
    def _follow_trace(self, kind: str, u) -> int | None:
        """Record (first training micro-batch) or check this request against the trace; return its
        position, or None once this micro-batch has left the trace."""
        if not self.in_train:
            return None
        if self.trace is None:
            self.recording.append((kind, u.index))
            return None
        if self.trace_ok and self.tpos < len(self.trace) and self.trace[self.tpos] == (kind, u.index):
            self.tpos += 1
            return self.tpos - 1
        self.trace_ok = False            # same on every rank when ranks run the same modules
        return None

    def _prefetch(self) -> None:
        """All-gather, asynchronously, the next units in the trace: at most prefetch_budget elements
        ahead (in flight or already prefetched), never beyond max_live."""
        if not (self.prefetch_budget and self.trace_ok and self.trace is not None):
            return
        c, ahead, seen = self.e.comm, 0, set()
        for kind, i in self.trace[self.tpos:]:
            if i in seen or i in self.gathered_units:
                continue
            seen.add(i)
            u = self.unit(i)
            if i in self.prefetched:
                ahead += u.padded
                continue
            if ahead >= self.prefetch_budget or self.live + u.padded > self.max_live:
                return
            label = f"prefetch for {kind} of {u.tag!r}"
            tag = self._check(kind, u, label)
            full = torch.empty(u.padded, dtype=self.e.dtype, device=self.dev)
            self._count_live(u.padded)
            self.stats["prefetch"] += 1
            h = c.all_gather(full, self.param_shard(u), f"param all-gather ({kind})", tag=tag, async_op=True,
                             what=u.tag)
            self.prefetched[i] = (h, full)
            ahead += u.padded

    def _reused_soon(self, u) -> bool:
        """Does the trace use u again within reuse_distance elements after its forward?"""
        pos = self.fwd_pos.get(u.index)
        if pos is None or not (self.trace_ok and self.in_train):
            return False
        traversed = 0
        for _, i in self.trace[pos + 1:]:
            if traversed >= self.reuse_distance:
                return False
            if i == u.index:
                return True
            traversed += self.unit(i).numel
        return False

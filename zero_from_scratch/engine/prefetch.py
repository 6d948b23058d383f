"""ZeRO-3's trace, prefetch, reuse and live-parameter cap (DeepSpeed's stage3_* keys), one object.

    torchrun --standalone --nproc_per_node 2 -m zero_from_scratch.engine.demo --stage 3 --zero overlap_comm=true

The first training micro-batch records the order in which the stage's hooks ask for units —
forward pre-hooks, then backward pre-hooks — as [(kind, unit)]: the *trace* (DeepSpeed records
the same module order on its first step). Later micro-batches walk it:
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
  ds_order   (the runner's, quirks.prefetch_as_deepspeed) DeepSpeed 0.19.8's coordinator
             (partitioned_param_coordinator.py): the forward's start prefetches too (its root
             module's fetch), and a unit whose later use a prefetch scan has passed (a unit
             already gathered or in flight is skipped there, __most_recent_step_id_param_fetched_for)
             stays gathered after its forward, evictable like a reused one, so its gathered
             copy serves that use. Cost: memory, up to the cap; no extra bytes.
"""
from __future__ import annotations


class Prefetcher:
    """unit(i) -> Unit; budget: elements ahead (0 = no prefetch); max_live, reuse_distance: elements.
    The stage tells it what happens (start/follow/finish, count_live) and hands it two actions:
    start(u, kind) -> (wait, buffer) for an asynchronous all-gather (wait() blocks until buffer is
    filled), evict(u) to release."""

    def __init__(self, unit, budget: int, max_live: int, reuse_distance: int):
        self.unit, self.budget, self.max_live, self.reuse_distance = unit, budget, max_live, reuse_distance
        self.trace: list | None = None                    # [(kind, unit index)] of the first training micro-batch
        self.recording: list = []
        self.tpos, self.trace_ok, self.in_train = 0, False, False
        self.fwd_pos: dict[int, int] = {}                 # unit -> its trace position in this forward
        self.prefetched: dict[int, tuple] = {}            # unit -> (wait, buffer) in flight
        self.kept: list[int] = []                         # gathered past forward for reuse, oldest first
        self.live = 0                                     # gathered + in-flight elements
        self.stats = {"demand": 0, "prefetch": 0, "prefetch_used": 0, "max_live": 0, "evicted": 0}
        self.ds_order = False                             # the runner's: DeepSpeed's release rule (docstring)
        self.pos: dict[int, int] = {}                     # unit -> its latest trace position this micro-batch
        self.scanned: dict[int, int] = {}                 # unit -> furthest trace position a prefetch scan passed
        self.status = lambda i, name: None                # ds_order: ds_status of unit i's parameters ← name

    def start_forward(self, training: bool, gathered=(), start=None) -> None:
        """Before each forward: eval / no-grad passes neither follow nor record the trace."""
        self.in_train = training
        self.tpos, self.trace_ok, self.fwd_pos = 0, training and self.trace is not None, {}
        self.pos, self.scanned = {}, {}
        if self.ds_order and start is not None:        # DeepSpeed's root-module fetch prefetches the first units
            self.prefetch(gathered, start)

    def finish_backward(self) -> None:
        if self.in_train and self.trace is None:
            self.trace = self.recording  # the first training micro-batch is the trace
        self.in_train = False

    def count_live(self, n: int) -> None:
        self.live += n
        self.stats["max_live"] = max(self.stats["max_live"], self.live)

    def make_room(self, need: int, evict) -> None:
        """Evict units kept for reuse (oldest first) until `need` more elements fit under max_live."""
        while self.kept and self.live + need > self.max_live:
            evict(self.unit(self.kept[0]))
            self.stats["evicted"] += 1

    def follow(self, kind: str, u) -> None:
        """Record (first training micro-batch) or check this demand against the trace."""
        if not self.in_train:
            return
        if self.trace is None:
            self.recording.append((kind, u.index))
        elif self.trace_ok and self.tpos < len(self.trace) and self.trace[self.tpos] == (kind, u.index):
            if kind == "forward":
                self.fwd_pos[u.index] = self.tpos
            self.pos[u.index] = self.tpos
            self.tpos += 1
        else:
            self.trace_ok = False        # same on every rank when ranks run the same modules

    def prefetch(self, gathered, start) -> None:
        """Start the next units of the trace (not in `gathered`): at most budget elements ahead (in
        flight or already prefetched), never beyond max_live."""
        if not (self.budget and self.trace_ok and self.trace is not None):
            return
        ahead, seen = 0, set()
        for at, (kind, i) in enumerate(self.trace[self.tpos:], self.tpos):
            if self.ds_order:
                self.scanned[i] = max(at, self.scanned.get(i, -1))
            if i in seen or i in gathered:
                continue
            seen.add(i)
            u = self.unit(i)
            if i in self.prefetched:
                ahead += u.padded
                continue
            if ahead >= self.budget or self.live + u.padded > self.max_live:
                return
            self.count_live(u.padded)
            self.stats["prefetch"] += 1
            self.prefetched[i] = start(u, kind)
            self.status(i, "INFLIGHT")                    # installed: AVAILABLE (saved.py)
            ahead += u.padded

    def reused_soon(self, u) -> bool:
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

    def passed_later_use(self, u) -> bool:
        """ds_order: has a prefetch scan passed a use of u after its current one?"""
        later = self.scanned.get(u.index, -1) > self.pos.get(u.index, 1 << 62)
        return self.ds_order and self.trace_ok and self.in_train and later

    def drop(self, give=None) -> None:
        """Wait for and forget every prefetch in flight (give(buffer) hands each buffer back)."""
        for i, (wait, buf) in list(self.prefetched.items()):
            wait()
            self.live -= self.unit(i).padded
            self.status(i, "NOT_AVAILABLE")               # never installed
            if give is not None:
                give(buf)
        self.prefetched.clear()

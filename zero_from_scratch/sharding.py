"""The one sharding function: flatten, pad to a multiple of N, give every rank its offsets.

    python -m pytest tests/test_zero_units.py -k shard     (pure arithmetic, no processes)

Every part of the ZeRO engine that needs to know "which elements does rank r own" asks the
Layout built here: the optimizer step, the gradient norm, the collectives and the checkpoint
manifest. There is no second copy of this arithmetic anywhere (llm.c's
`multi_gpu_get_shard_offset` plays the same role).

A *unit* is a run of parameters of one param group that is communicated as one flat buffer:
  stages 0-2  consecutive parameters up to `reduce_bucket_size` elements (one unit per group
              with DeepSpeed's default bucket of 5e8)
  stage 3     the parameters of one module (gathered before its forward, freed after)
Each unit is padded to a multiple of N so every rank owns exactly `shard = padded / N`
elements of it: rank r owns [r·shard, (r+1)·shard). Padding costs at most N-1 elements per
unit and is always zero (it is never written by a gradient), so norms and updates ignore it.

A rank's *local* buffer of a group concatenates its shards of that group's units, in unit
order: `Unit.local_offset` says where. Cost: O(number of parameters), no communication.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Slot:
    """One parameter inside a unit's flat buffer."""
    name: str
    shape: tuple
    offset: int          # element offset inside the unit's (unpadded) flat buffer

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Unit:
    index: int           # position in Layout.units (the order collectives run in)
    group: int           # optimizer param group
    slots: tuple         # tuple[Slot, ...]
    numel: int           # real elements
    padded: int          # numel rounded up to a multiple of world_size
    shard: int           # padded // world_size: elements each rank owns
    local_offset: int    # where this rank's shard sits in the group's local buffer
    flat_offset: int     # where the unit sits in the group's full flat buffer (stages 0-2)
    tag: str = ""        # e.g. the module name (stage 3), for error messages

    def shard_range(self, rank: int) -> tuple[int, int]:
        """[start, end) of rank's shard, in unit coordinates (padding included)."""
        return rank * self.shard, (rank + 1) * self.shard

    def owned_real(self, rank: int) -> int:
        """How many of rank's shard elements are real parameters (the rest is padding)."""
        lo, hi = self.shard_range(rank)
        return max(0, min(hi, self.numel) - lo)


@dataclass(frozen=True)
class Layout:
    world_size: int
    units: tuple                   # tuple[Unit, ...]
    group_local: tuple             # per group: elements of one rank's local buffer
    group_flat: tuple              # per group: elements of the full padded flat buffer
    numel: int                     # Ψ: real parameter elements
    padded: int                    # Σ padded over units
    where: dict = field(default_factory=dict)   # param name -> (unit index, slot)

    @property
    def padding(self) -> int:
        return self.padded - self.numel

    def units_of_group(self, g: int) -> list:
        return [u for u in self.units if u.group == g]

    def to_manifest(self) -> dict:
        return {"world_size": self.world_size, "numel": self.numel, "padded": self.padded,
                "units": [{"group": u.group, "tag": u.tag, "numel": u.numel, "padded": u.padded,
                           "shard": u.shard, "local_offset": u.local_offset, "flat_offset": u.flat_offset,
                           "slots": [[s.name, list(s.shape), s.offset] for s in u.slots]} for u in self.units]}


def shard_layout(units: list, world_size: int) -> Layout:
    """Build the layout for `units`: a list of (group, tag, [(name, shape), ...]) in the order the
    collectives will run. Pads each unit to a multiple of world_size and assigns offsets."""
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    ngroups = 1 + max((g for g, _, _ in units), default=-1)
    local = [0] * ngroups
    flat = [0] * ngroups
    out, where, seen = [], {}, set()
    for i, (g, tag, params) in enumerate(units):
        slots, off = [], 0
        for name, shape in params:
            if name in seen:
                raise ValueError(f"parameter {name!r} appears in two units")
            seen.add(name)
            s = Slot(name, tuple(int(d) for d in shape), off)
            slots.append(s)
            off += s.numel
        padded = -(-off // world_size) * world_size
        u = Unit(i, g, tuple(slots), off, padded, padded // world_size, local[g], flat[g], tag)
        local[g] += u.shard
        flat[g] += padded
        out.append(u)
        for s in slots:
            where[s.name] = (i, s)
    return Layout(world_size, tuple(out), tuple(local), tuple(flat),
                  sum(u.numel for u in out), sum(u.padded for u in out), where)


def bucket_units(groups: list, bucket_numel: int) -> list:
    """Stages 0-2: split each group's (name, shape) list into runs of ≤ bucket_numel elements
    (a parameter larger than the bucket gets a unit of its own). Units run in reverse
    registration order, the order backward usually produces gradients in."""
    units = []
    for g, params in enumerate(groups):
        cur, size = [], 0
        for name, shape in reversed(params):
            n = math.prod(shape)
            if cur and size + n > bucket_numel:
                units.append((g, f"group{g}.bucket{len([u for u in units if u[0] == g])}", cur))
                cur, size = [], 0
            cur.append((name, shape))
            size += n
        if cur:
            units.append((g, f"group{g}.bucket{len([u for u in units if u[0] == g])}", cur))
    return units


def split_range(lo: int, hi: int, slot_lo: int, slot_hi: int):
    """Intersection of [lo, hi) with [slot_lo, slot_hi), or None: used to map shards to params."""
    a, b = max(lo, slot_lo), min(hi, slot_hi)
    return (a, b) if a < b else None

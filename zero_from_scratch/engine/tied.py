"""ZeRO-3 and a parameter several modules hold: each use's gradient into the bucket as it arrives.

    python -m pytest tests/test_zero_stage3.py -k tied

A tied parameter (T5's embedding: the encoder's and decoder's embedding and the LM head) is one
autograd leaf, so autograd sums its uses' gradients in a buffer of its own, held from the first
use's backward to the last, adding each later use out of place (a second and third full-size
tensor for a moment); only then does the engine's hook copy the sum into the unit's bucket. Here,
while a module holding it runs forward with grad enabled, its attribute is an alias made by _Use,
whose backward adds that use's gradient straight into the unit's bucket and gives autograd
nothing: the bucket is the parameter's one full-size gradient (on the T5 of
benchmarks/zero_memory_table.py, the decoder embedding's backward rises 12 MiB instead of 23; the
row's peak, now the LM head's backward, 89 → 86 MiB). The parameter's slot counts as
arrived once every use of the forward has. The sums are autograd's, in its order (zeros, then
each use as backward reaches it). A use that bypasses the modules (F.linear(x, m.weight) in a
parent's forward) goes through autograd and the ordinary hook, which adds it to the same bucket;
arriving after the aliased uses completed the unit, it raises rather than be lost.
Reducing each use as it arrives (so that no full-size gradient waits between uses) was measured
on that T5 with its gradients in files: the backward's peak rose 6 MiB (the use's gradient, a
fresh bucket and the shard being summed coexist at each of three reduce-scatters), so the unit
reduces once, when its last use arrives.
Cost: one autograd node per use; no other communication.
"""
from __future__ import annotations

import torch


class _Use(torch.autograd.Function):
    @staticmethod
    def forward(ctx, p, tied, key):
        ctx.tied, ctx.key = tied, key
        return p.view_as(p)

    @staticmethod
    def backward(ctx, g):
        ctx.tied.arrive(ctx.key, g)
        return None, None, None


class Tied:
    def __init__(self, stage, shared: dict):
        """shared: {slot name: [(module, attribute)]}, every slot held by two or more modules."""
        self.st, self.alias_of = stage, {}
        where = {s.name: (u, s) for u in stage.layout.units for s in u.slots}
        self.slot = {name: where[name] for name in shared}
        self.outstanding, self.done = dict.fromkeys(shared, 0), set()
        self.holders = [(m, attr, name) for name, ms in shared.items() for m, attr in ms]
        flat = [(u, s) for u in stage.layout.units for s in u.slots]
        for name in shared:                        # the ordinary hook: only for uses that bypass the modules
            i = flat.index(where[name])
            stage.hooks[i].remove()
            stage.hooks[i] = stage.params[name].register_post_accumulate_grad_hook(self._bypass(name))
        for m, attr, name in self.holders:
            stage.hooks += [m.register_forward_pre_hook(self._pre(attr, name)),
                            m.register_forward_hook(self._post(attr))]

    def _pre(self, attr: str, name: str):
        def hook(module, args):
            if torch.is_grad_enabled() and attr in module._parameters:
                p = module._parameters.pop(attr)
                self.alias_of[id(module)] = (module, attr, p)
                self.outstanding[name] += 1
                module.__dict__[attr] = _Use.apply(p, self, name)
        return hook

    def _post(self, attr: str):
        def hook(module, args, output):
            self._restore(id(module))
        return hook

    def _restore(self, key) -> None:
        m, attr, p = self.alias_of.pop(key) if key in self.alias_of else (None, None, None)
        if m is not None:
            m.__dict__.pop(attr, None)
            m._parameters[attr] = p

    def restore(self) -> None:
        """Before each forward: a forward that raised left its aliases in place."""
        for key in list(self.alias_of):
            self._restore(key)

    def _add(self, name: str, g: torch.Tensor) -> None:
        st, (u, s) = self.st, self.slot[name]
        if st.pending[u.index] == -1:
            raise RuntimeError(f"rank {st.rank}: a gradient of tied parameter {name!r} arrived after its unit was "
                               "reduced: a use outside the forward of the modules that hold it finished last")
        b = st.bucket.get(u.index)
        if b is None:
            b = st.bucket[u.index] = st._new_bucket(u)
        b[s.offset:s.offset + s.numel].view(s.shape).add_(g)     # g as it comes (a transposed view: no copy)

    def _complete(self, name: str) -> None:
        if self.outstanding[name] == 0 and name not in self.done:   # the slot arrives once per backward
            self.done.add(name)
            self.st._arrived(self.slot[name][0])

    def arrive(self, name: str, g: torch.Tensor) -> None:
        self._add(name, g)
        self.outstanding[name] -= 1
        self._complete(name)

    def _bypass(self, name: str):
        def hook(p):
            if p.grad is None:               # autograd calls it after the aliases too, with nothing
                return
            self._add(name, p.grad)
            p.grad = None
            self._complete(name)
        return hook

    def after_backward(self) -> None:
        self.outstanding, self.done = dict.fromkeys(self.outstanding, 0), set()


def make(stage, module):
    """Tied, or None when no trainable parameter is held by two modules."""
    names = {id(p): s.name for u in stage.layout.units for s in u.slots for p in [stage.params[s.name]]}
    holders: dict = {}
    for m in module.modules():
        for attr, p in m._parameters.items():
            if p is not None and p.requires_grad and id(p) in names:
                holders.setdefault(names[id(p)], []).append((m, attr))
    shared = {n: ms for n, ms in holders.items() if len(ms) > 1}
    return Tied(stage, shared) if shared else None

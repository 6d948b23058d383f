"""CheckpointHiddenStatesOffload (zero_from_scratch/as_deepspeed/offload_activations.py), served as DeepSpeed's.

    python -m pytest -q tests/test_ds_offload_activations.py

One process: the hook moves saved tensors and sends nothing between ranks. The reference is the
same model run without the hook (gradients must be bit-identical: a copy to the host and back
changes no value). On the CPU the hook moves nothing, as DeepSpeed's (the accelerator is a
synchronized device); `HostHop` treats CPU tensors as device tensors, so the offload path itself —
keep-last window, host buffers and their pool, strides, retain_graph — runs here too.
"""
from functools import partial

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from zero_from_scratch.as_deepspeed.offload_activations import CheckpointHiddenStatesOffload


class HostHop(CheckpointHiddenStatesOffload):
    """Every CPU tensor counts as on the device: marked ones are copied to a host buffer and back."""

    def _offloadable(self, tensor):
        return True


def _layers():
    torch.manual_seed(3)
    return nn.ModuleList([nn.Linear(16, 16) for _ in range(4)])


def _run(layers, x, manager=None):
    h = x
    for layer in layers:
        if manager is not None:
            manager.mark(h)
        h = checkpoint(layer, h, use_reentrant=False)
    return h.square().sum()


def _grads(layers, x, manager=None):
    layers.zero_grad(set_to_none=True)
    x.grad = None
    loss = _run(layers, x, manager)
    loss.backward()
    return [loss.detach(), x.grad.clone()] + [p.grad.clone() for p in layers.parameters()]


@pytest.mark.parametrize("keep_last_count", [0, 1, 2])
def test_offloaded_hidden_states_give_the_same_gradients(keep_last_count):
    layers, x = _layers(), torch.randn(8, 16, requires_grad=True)
    ref = _grads(layers, x)
    offload = HostHop(use_streams=False, min_offload_bytes=0, keep_last_count=keep_last_count)
    with offload:
        got = _grads(layers, x, offload)
        n = 4 - keep_last_count
        assert offload.stats.offloaded_tensors == offload.stats.restored_tensors == n
        assert offload.stats.kept_last_tensors == keep_last_count
        assert offload.stats.offloaded_bytes == n * 8 * 16 * 4
        assert offload._cpu_buffer_pool_count == n       # every host buffer back in the pool
        got2 = _grads(layers, x, offload)                # the same shapes: served from the pool
        assert offload._cpu_buffer_pool_count == n
    for a, b in zip(ref, got + got2[2:]):
        assert torch.equal(a, b)


def test_the_saved_tensor_is_a_restored_copy_with_the_saved_strides():
    seen = []

    class Spy(HostHop):
        def _restore_tensor(self, tensor_id, cache=True):
            seen.append(super()._restore_tensor(tensor_id, cache))
            return seen[-1]

    base = torch.randn(6, 8)
    x_ref = base[2:, ::2].clone().requires_grad_(True)
    torch.sin(checkpoint(torch.square, x_ref, use_reentrant=False)).sum().backward()
    x = base[2:, ::2].detach().requires_grad_(True)            # an offset, strided view
    offload = Spy(use_streams=False, min_offload_bytes=0, keep_last_count=0)
    with offload:
        offload.mark(x)
        loss = torch.sin(checkpoint(torch.square, x, use_reentrant=False)).sum()
        loss.backward(retain_graph=True)
        assert offload.stats.restored_tensors == 1 and seen[0].stride() == x.stride()
        assert seen[0].data_ptr() != x.data_ptr() and torch.equal(seen[0], x)
        first = x.grad.clone()
        x.grad = None
        loss.backward()                                        # unpacked again: the cached copy
        assert offload.stats.restored_tensors == 1
    assert torch.equal(first, x_ref.grad) and torch.equal(x.grad, x_ref.grad)


def test_on_the_cpu_nothing_moves_and_unmarked_tensors_pass():
    layers, x = _layers(), torch.randn(8, 16, requires_grad=True)
    ref = _grads(layers, x)
    offload = CheckpointHiddenStatesOffload(use_streams=False, min_offload_bytes=0, keep_last_count=0)
    with offload:
        got = _grads(layers, x, offload)
    assert offload.stats.marked_tensors == 4 and offload.stats.skipped_marked_tensors == 4
    assert offload.stats.offloaded_tensors == 0 and offload.stats.saved_tensors_seen > 4
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
    small = HostHop(use_streams=False, min_offload_bytes=1 << 20, keep_last_count=0)
    with small:
        _grads(layers, x, small)                               # below min_offload_bytes: skipped
    assert small.stats.skipped_marked_tensors == 4 and small.stats.offloaded_tensors == 0


def test_a_transformers_checkpointing_layer_marks_its_hidden_states_while_a_manager_is_active():
    transformers = pytest.importorskip("transformers")
    GCL = transformers.GradientCheckpointingLayer
    before = GCL.__call__

    class Layer(GCL):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, hidden_states):
            return self.lin(hidden_states).tanh()

    torch.manual_seed(0)
    layer = Layer().train()
    layer.gradient_checkpointing = True
    layer._gradient_checkpointing_func = partial(checkpoint, use_reentrant=False)
    x = torch.randn(4, 8, requires_grad=True)
    layer(x).sum().backward()
    ref = (x.grad.clone(), layer.lin.weight.grad.clone())
    x.grad = None
    layer.zero_grad()
    offload = HostHop(use_streams=False, min_offload_bytes=0, keep_last_count=0)
    with offload:                                # (its __enter__ returns None, as DeepSpeed's)
        assert GCL.__call__ is not before
        layer(x).sum().backward()
    assert GCL.__call__ is before
    assert offload.stats.marked_tensors == offload.stats.offloaded_tensors == offload.stats.restored_tensors == 1
    assert torch.equal(x.grad, ref[0]) and torch.equal(layer.lin.weight.grad, ref[1])

"""ZeRO-3 leaf modules, as DeepSpeed 0.19.8's (deepspeed/utils/z3_leaf_module.py and its stage-3
hooks): a module flagged `_z3_leaf` is gathered whole at its own pre-forward and pre-backward, and
no hook fires for its children.

    python -m pytest -q tests/test_zero_leaf.py      (an MoE block routed differently on each rank, 2 ranks)

    set_z3_leaf_modules(model, [MixtralSparseMoeBlock]); engine, *_ = deepspeed.initialize(model=model, ...)

Why: stage 3 all-gathers the units a module uses when it runs, so every rank must run the same
modules in the same order. A mixture-of-experts block routes each batch to different experts on
each rank; flagged as a leaf, all its experts are gathered together (the collectives pair up
whatever the routing) and its gradients are reduced together in unit order in the leaf's full
backward hook, an expert that got none reducing zeros (DeepSpeed's reduce_leaf_module_grads).
As DeepSpeed, that hook needs an input of the leaf that requires grad: without one torch fires
it before the leaf's backward has run, so the engine raises (DeepSpeed fails there too).
zero_optimization.leaf_module {classes, names, name_suffixes} flags modules at initialize, at every
stage; DeepSpeed's default classes (Mixtral's, Qwen2-MoE's, Qwen3-MoE's sparse blocks) always.
Cost: a leaf's whole subtree is gathered at once (its parameters count as one live unit set).
"""
from __future__ import annotations

import warnings

import torch

DEFAULT_LEAF_MODULE_CLASSES = ["transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
                               "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
                               "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock"]
DEFAULT_LEAF_MODULE_NAMES: list = []
DEFAULT_LEAF_MODULE_NAME_SUFFIXES: list = []


# ------------------------------------------------------------------ DeepSpeed's functions, its semantics
def z3_leaf_module(model: torch.nn.Module) -> bool:
    return hasattr(model, "_z3_leaf") and model._z3_leaf


def z3_leaf_parameter(param) -> bool:
    return hasattr(param, "ds_z3_leaf_module")


def get_z3_leaf_modules(model: torch.nn.Module) -> list:
    return [m for m in model.modules() if z3_leaf_module(m)]


def set_z3_leaf_module(model: torch.nn.Module, flag: bool) -> None:
    model._z3_leaf = flag


def _qualname(m) -> str:
    return f"{type(m).__module__}.{type(m).__qualname__}"


def _set_by_class(model, classes, flag: bool, raise_if_not_found: bool) -> list:
    assert all(isinstance(c, (type, str)) for c in classes), \
        f"leaf_module_classes must be a list of types or names, got {classes}"
    found = []
    for m in model.modules():          # model.apply's order (children first) is DeepSpeed's; the set is the same
        if any(isinstance(m, c) if isinstance(c, type) else c in (type(m).__name__, _qualname(m)) for c in classes):
            m._z3_leaf = flag
            found.append(m)
    if not found and raise_if_not_found:
        raise ValueError(f"No modules of type {classes} found in model {model}")
    return found


def set_z3_leaf_modules(model, leaf_module_classes, raise_if_not_found: bool = True) -> list:
    return _set_by_class(model, leaf_module_classes, True, raise_if_not_found)


def unset_z3_leaf_modules(model, leaf_module_classes, raise_if_not_found: bool = True) -> list:
    return _set_by_class(model, leaf_module_classes, False, raise_if_not_found)


def set_z3_leaf_modules_by_name(model, module_names, flag: bool = True, raise_if_not_found: bool = True):
    by_name, found, missing = dict(model.named_modules()), [], []
    for name in module_names:
        if name not in by_name:
            missing.append(name)
            continue
        by_name[name]._z3_leaf = flag
        found.append(by_name[name])
    if missing and raise_if_not_found:
        raise ValueError(f"No modules named {missing} found in model {model}")
    return found, missing


def set_z3_leaf_modules_by_suffix(model, module_name_suffixes, flag: bool = True, raise_if_not_found: bool = True):
    by_name, found, missing = dict(model.named_modules()), [], []
    for suffix in module_name_suffixes:
        hits = [m for n, m in by_name.items() if n.endswith(suffix)]
        for m in hits:
            m._z3_leaf = flag
            if all(m is not f for f in found):
                found.append(m)
        if not hits:
            missing.append(suffix)
    if missing and raise_if_not_found:
        raise ValueError(f"No modules matching suffixes {missing} found in model {model}")
    return found, missing


def _as_list(v) -> list:
    return list(dict.fromkeys(str(x) for x in ([v] if isinstance(v, str) else v)))


def apply_config(model, section, rank: int) -> list:
    """zero_optimization.leaf_module (DeepSpeed's apply_zero_leaf_module_config): flag by class,
    name and name suffix; a customised entry that matches nothing is warned about."""
    section = dict(section or {})
    classes = _as_list(section.get("classes", DEFAULT_LEAF_MODULE_CLASSES))
    names = _as_list(section.get("names", DEFAULT_LEAF_MODULE_NAMES))
    suffixes = _as_list(section.get("name_suffixes", DEFAULT_LEAF_MODULE_NAME_SUFFIXES))
    found = set_z3_leaf_modules(model, classes, raise_if_not_found=False) if classes else []
    for what, values, fn in (("names", names, set_z3_leaf_modules_by_name),
                             ("name_suffixes", suffixes, set_z3_leaf_modules_by_suffix)):
        if values:
            hits, missing = fn(model, values, raise_if_not_found=False)
            found += [m for m in hits if all(m is not f for f in found)]
            if missing and what in section and rank == 0:
                warnings.warn(f"zero_from_scratch: zero_optimization.leaf_module.{what} matches no module: {missing}",
                              stacklevel=3)
    if not found and section and rank == 0:
        warnings.warn("zero_from_scratch: zero_optimization.leaf_module matched no module; hooks are applied as "
                      "usual (DeepSpeed warns the same)", stacklevel=3)
    return found


def set_by_granularity(model, threshold: int, max_leaf: float = 1e9) -> list:
    """stage3_module_granularity_threshold (DeepSpeed's _set_z3_leaf_modules_by_threshold): a module's
    granularity is its subtree's elements ÷ its non-container modules with parameters (torch leaves
    and containers: none); top-down, the first module at or under the threshold is flagged a leaf."""
    gran: dict = {}

    def walk(m) -> tuple[int, int]:
        gran[m] = float("inf")
        if not any(True for _ in m.parameters()):
            return 0, 0
        n = sum(getattr(p, "ds_numel", p.numel()) for p in m.parameters(recurse=False))
        if not any(True for _ in m.children()):
            return 1, n
        layers = 0
        for c in m.children():
            cl, cn = walk(c)
            layers, n = layers + cl, n + cn
        if type(m).__name__ in torch.nn.modules.container.__all__:
            return layers, n                 # a ModuleList's children keep their hooks
        gran[m] = n // (layers + 1) if n <= max_leaf else float("inf")
        return layers + 1, n

    def flag(m, found: list) -> list:
        if any(True for _ in m.parameters()):
            if gran[m] <= threshold:
                set_z3_leaf_module(m, True)
                found.append(m)
            else:
                for c in m.children():
                    flag(c, found)
        return found

    walk(model)
    smallest = min(gran, key=gran.get)
    if gran[smallest] > threshold:        # DeepSpeed's warning, in its words
        warnings.warn(f"The smallest module granularity is [{type(smallest).__name__}:{gran[smallest]}]. To make "
                      f"stage3_module_granularity_threshold effective, you need to set "
                      f"stage3_module_granularity_threshold >= {gran[smallest]}. Current Value:{threshold}", stacklevel=3)
        return []
    return flag(model, [])


# ------------------------------------------------------------------ the engine: hooks on the leaf only
def outermost_leaves(model) -> list:
    """(name, module) of each flagged module with no flagged ancestor (DeepSpeed stops at the first)."""
    out = []

    def walk(name, m):
        if z3_leaf_module(m):
            out.append((name or "<root>", m))
            return
        for cn, c in m.named_children():
            walk(f"{name}.{cn}" if name else cn, c)
    walk("", model)
    return out


def _hook_dicts(m) -> list:
    return [m._forward_pre_hooks, m._forward_hooks, m._backward_pre_hooks, m._backward_hooks]


def _drop_hooks(handles: list, modules) -> list:
    """Remove the handles registered on `modules`; the others are returned."""
    dicts = {id(d) for m in modules for d in _hook_dicts(m)}
    keep = []
    for h in handles:
        d = h.hooks_dict_ref()
        if d is not None and id(d) in dicts:
            h.remove()
        else:
            keep.append(h)
    return keep


def install(engine) -> list:
    """At initialize: flag the config's leaves (leaf_module; at stage 3 also
    stage3_module_granularity_threshold's); at stage 3, move every hook the stage (and the frozen
    parameters, frozen.py) put on a leaf's subtree onto the leaf, with all the subtree's units."""
    z = engine.config.raw.get("zero_optimization", {})
    apply_config(engine.module, z.get("leaf_module"), engine.comm.global_rank)
    threshold = z.get("stage3_module_granularity_threshold", 0)
    if engine.stage_id == 3 and isinstance(threshold, (int, float)) and threshold > 0:
        set_by_granularity(engine.module, threshold)
    leaves = outermost_leaves(engine.module)
    if engine.stage_id != 3 or not leaves:
        return leaves
    st, fz = engine.stage, engine.frozen
    unit_of = {id(st.params[s.name]): u for u in list(engine.layout.units) + list(fz.units) for s in u.slots}
    for name, leaf in leaves:
        subtree = list(leaf.modules())
        st.hooks = _drop_hooks(st.hooks, subtree)
        fz.hooks = _drop_hooks(fz.hooks, subtree)
        for p in leaf.parameters():
            p.ds_z3_leaf_module = leaf
        units = sorted({unit_of[id(p)].index: unit_of[id(p)] for p in leaf.parameters() if id(p) in unit_of}.items())
        trained = [u for i, u in units if i < len(engine.layout.units)]
        frozen = [u for i, u in units if i >= len(engine.layout.units)]
        if trained:
            st.add_module_hooks(name, leaf, trained)
            st.hooks += _reduce_hooks(st, name, leaf, trained)
        if frozen:
            fz.hook_module(name, leaf, frozen)
    return leaves


def _reduce_hooks(st, name: str, leaf, units: list) -> list:
    """The leaf's gradients wait for its backward to finish, then reduce in unit order (DeepSpeed's
    reduce_leaf_module_grads): one extra pending count per unit, taken back in the full backward hook."""
    held: set = set()
    seen = [None]                      # the stage's pending counts of this backward (a new dict each backward)

    def hold(module, grad_output):
        if seen[0] is not st.pending:
            seen[0] = st.pending
            held.clear()
        for u in units:
            if u.index not in held and st.pending[u.index] > 0:
                st.pending[u.index] += 1
                held.add(u.index)

    def reduce(module, grad_input, grad_output):
        if st.coalescing:              # inside engine.coalesce_grad_reduction() the block's exit reduces (coalesce.py),
            return                     # after every backward: the hook-order problem below cannot arise there
        if all(g is None for g in grad_input):
            raise RuntimeError(f"ZeRO-3 leaf module {name!r} ({type(leaf).__name__}): none of its inputs requires "
                               "grad, so torch runs its full backward hook before its backward and its gradients "
                               "cannot be reduced there (DeepSpeed fails here too); make an input require grad (e.g. "
                               "model.enable_input_require_grads()) or do not flag this module as a leaf")
        for u in units:
            held.discard(u.index)
            if st.pending[u.index] != -1:
                st._reduce(u)
    return [leaf.register_full_backward_pre_hook(hold), leaf.register_full_backward_hook(reduce)]

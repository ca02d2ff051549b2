"""The modules' forward and backward as two registered torch custom ops, so
that ``torch.compile`` (``fullgraph=True`` included) treats an embstore
lookup as one opaque call with a known output shape instead of tracing the
NumPy code behind it.

- ``embstore::lookup(anchor, inputs, handle, store, spec) -> Tensor``: the
  forward of module ``handle`` (a registry of live modules by number) over
  its input tensors; ``spec`` is a string the module reads back (a
  collection's feature names). Its fake implementation asks the module for
  the output's shape from the inputs' shapes alone.
- ``embstore::step(grad, inputs, handle, spec) -> ()``: the backward, which
  applies ``grad`` to the module's tables (or holds it, when the module
  accumulates); marked as having a side effect so no compiler drops it.

``anchor`` is one empty leaf that requires grad, shared by every call: it
makes autograd record the lookup (the tables' rows are not torch
parameters) and never receives a gradient. Module handles are not saved:
a copied or unpickled module registers itself anew.

No ``from __future__ import annotations`` here: torch.library reads the
functions' annotations to build the ops' schemas.
"""

import itertools
import weakref
from typing import Any

import torch
import torch.fx.node

__all__ = ["call", "register"]

_MODULES: "weakref.WeakValueDictionary[int, Any]" = weakref.WeakValueDictionary()
_HANDLES = itertools.count(1)
_ANCHOR = torch.empty(0, requires_grad=True)


def register(module: Any) -> int:
    """A fresh handle for ``module`` (held weakly: the registry never keeps a
    module alive)."""
    handle = next(_HANDLES)
    _MODULES[handle] = module
    return handle


def _checked(inputs: "list[torch.Tensor | None]", values: bool) -> None:
    """Refuses inputs no module call takes, naming them: none at all, no
    ids first, and (``values``: a real call, not a shape-only one) meta
    tensors, which hold no values to look up."""
    if not isinstance(inputs, (list, tuple)) or not inputs or inputs[0] is None:
        raise ValueError(
            "inputs: expected the ids tensor first (then the module's other inputs), "
            f"got {inputs!r}"
        )
    for i, t in enumerate(inputs):
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"inputs[{i}]: expected a tensor or None, got {type(t).__name__}")
        if values and t is not None and t.device.type == "meta":
            raise ValueError(
                f"inputs[{i}]: a meta tensor holds no values to look up (call the module on "
                "real tensors; torch.compile's fake tensors take the shape-only path)"
            )


def _module(handle: int) -> Any:
    module = _MODULES.get(handle)
    if module is None:
        raise RuntimeError(
            f"embstore: the module of handle {handle} no longer exists (a compiled graph "
            "outlived the module it was traced from)"
        )
    return module


@torch.library.custom_op("embstore::lookup", mutates_args=())
def _lookup(
    anchor: torch.Tensor,
    inputs: list[torch.Tensor | None],
    handle: int,
    store: bool,
    spec: str,
) -> torch.Tensor:
    _checked(inputs, values=True)
    out: torch.Tensor = _module(handle)._run(inputs, store, spec)
    return out


@_lookup.register_fake
def _lookup_fake(
    anchor: torch.Tensor,
    inputs: list[torch.Tensor | None],
    handle: int,
    store: bool,
    spec: str,
) -> torch.Tensor:
    _checked(inputs, values=False)
    out: torch.Tensor = _module(handle)._empty(inputs, spec)
    return out


@torch.library.custom_op("embstore::step", mutates_args=())
def _step(grad: torch.Tensor, inputs: list[torch.Tensor | None], handle: int, spec: str) -> None:
    _checked(inputs, values=True)
    if grad.device.type == "meta":
        raise ValueError("grad: a meta tensor holds no gradient to apply")
    _module(handle)._backward(inputs, grad, spec)


@_step.register_fake
def _step_fake(
    grad: torch.Tensor, inputs: list[torch.Tensor | None], handle: int, spec: str
) -> None:
    return None


# A call that returns nothing and changes the tables: no graph pass may
# remove it as dead code.
torch.fx.node.has_side_effect(torch.ops.embstore.step.default)


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    _, tensors, handle, _, spec = inputs
    ctx.handle, ctx.spec = handle, spec
    # The graph keeps the module alive until its backward (the registry
    # holds it weakly): a module built for one call, et.Embedding(t)(ids),
    # still gets its backward.
    ctx.module = _MODULES.get(handle)
    ctx.present = [t is not None for t in tensors]
    ctx.save_for_backward(*[t for t in tensors if t is not None])


def _backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
    saved = iter(ctx.saved_tensors)
    tensors = [next(saved) if present else None for present in ctx.present]
    torch.ops.embstore.step(grad, tensors, ctx.handle, ctx.spec)
    # No gradient for any input: the tables took theirs. (torch.library
    # takes a list holding a None as one input, any other list entry-wise.)
    none: Any = None if None in tensors else [None] * len(tensors)
    return None, none, None, None, None


_lookup.register_autograd(_backward, setup_context=_setup_context)


class _Eager(torch.autograd.Function):
    """The same forward and backward as the ops, for eager calls: an
    autograd.Function skips the dispatcher's round trips (a custom op costs
    some 100 us a call more), and does exactly what the ops do."""

    @staticmethod
    def forward(
        ctx: Any,
        anchor: torch.Tensor,
        module: Any,
        inputs: list[torch.Tensor | None],
        store: bool,
        spec: str,
    ) -> torch.Tensor:
        ctx.module, ctx.inputs, ctx.spec = module, inputs, spec
        _checked(inputs, values=True)
        out: torch.Tensor = module._run(inputs, store, spec)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, ...]:
        ctx.module._backward(ctx.inputs, grad, ctx.spec)
        return (None,) * 5


def call(
    module: Any, inputs: list[torch.Tensor | None], store: bool, spec: str = ""
) -> torch.Tensor:
    """The forward of ``module`` over ``inputs``: through the registered op
    where torch.compile traces it, else as the same autograd.Function."""
    out: torch.Tensor
    if torch.compiler.is_compiling():
        out = torch.ops.embstore.lookup(_ANCHOR, inputs, module._handle, store, spec)
    else:
        out = _Eager.apply(_ANCHOR, module, inputs, store, spec)
    return out

"""A declared slot's module, as warmup builds and exports it: the engine's
factory called with the spec's ``args``, wrapped so that its parameters and
buffers are inputs of the compiled code, not constants in it.

:class:`WeightsAsInputs` takes ``(*state, *inputs)``: the module's parameters
then its buffers, in ``named_parameters()`` / ``named_buffers()`` order, then the
declared inputs; it runs the module with ``torch.func.functional_call``, so the
artifact holds the code only and one artifact serves every checkpoint of the
same shapes. The state's names, shapes and dtypes (:func:`state_spec`) are
recorded in the entry (``slot_params``) and checked when an engine binds its
weights (:meth:`kernel_cache.runtime.declared.DeclaredSlots.bind`).

Resolving the factory imports the engine's code: only warmup does it.
"""

from __future__ import annotations

from kernel_cache.config.slot_spec import SlotSpec
from kernel_cache.errors import CompileError


def build_declared(spec: SlotSpec):
    """``factory(**args)`` of ``spec``, in eval mode.

    Raises:
        CompileError: the factory cannot be imported, raised, or returned no
            ``torch.nn.Module`` (names the slot and the path).
    """
    from torch import nn

    from kernel_cache.kernels.slots import load_factory

    where = f"slot {spec.name}={spec.factory}"
    factory = load_factory(spec.name, spec.factory, kind="slot")
    try:
        mod = factory(**spec.factory_args())
    except Exception as e:  # the engine's code: reported, not raised through
        raise CompileError(
            f"{where}: the factory raised {type(e).__name__}: {e} (called with "
            f"{spec.factory_args()})"
        ) from None
    if not isinstance(mod, nn.Module):
        raise CompileError(
            f"{where}: the factory returned a {type(mod).__name__}, not a torch.nn.Module"
        )
    return mod.eval()


def state_spec(module) -> list[tuple[str, list[int], str]]:
    """``[(name, shape, dtype), ...]`` of ``module``'s parameters then buffers
    (dtype as ``"float32"``), the leading inputs of :class:`WeightsAsInputs`."""
    out = []
    for name, t in (*module.named_parameters(), *module.named_buffers()):
        out.append((name, list(t.shape), str(t.dtype).removeprefix("torch.")))
    return out


def _wrapper_class():
    from torch import func, nn

    class WeightsAsInputs(nn.Module):
        """``forward(*state, *inputs)``: ``module(*inputs)`` with its parameters
        and buffers replaced by ``state`` (names: :func:`state_spec`). The
        module is held outside the wrapper's own state, so exporting the
        wrapper lifts no weight into the artifact."""

        def __init__(self, module):
            super().__init__()
            object.__setattr__(self, "_inner", module)  # not a submodule: no state
            self.names = tuple(n for n, _, _ in state_spec(module))

        def forward(self, *args):
            n = len(self.names)
            state = dict(zip(self.names, args[:n], strict=True))
            return func.functional_call(self._inner, state, tuple(args[n:]))

    return WeightsAsInputs


def weights_as_inputs(module):
    """``module`` wrapped as :class:`WeightsAsInputs` (see the module docstring)."""
    return _wrapper_class()(module)


def example_state(module) -> tuple:
    """The module's own parameters and buffers, detached, in :func:`state_spec`
    order: the example values of the state inputs at export."""
    return tuple(t.detach() for _, t in (*module.named_parameters(), *module.named_buffers()))

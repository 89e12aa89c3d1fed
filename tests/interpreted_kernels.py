"""torch.compile of the Triton kernels under the interpreter (tests' helper).

``wrap_triton`` records each launch in the compiled graph with the arguments it writes, which torch finds by
analysing the kernel's compiled IR for a GPU target. The interpreter has neither, and torch then assumes every
argument is written: a leaf that requires grad (a layer's weight read by a kernel) would be written in place,
which AOT autograd refuses. :func:`kernel_writes` tells torch what a GPU's analysis finds instead: the output
arguments below (the kernels' ``tl.store`` targets), except where a kernel is handed a stand-in for one it does not
write (the same tensor as one of its inputs)."""
from __future__ import annotations

import contextlib

import torch

WRITES = {
    "pola": {
        "_state_kernel": ("part_ptr",),
        "_forward_kernel": ("state_ptr", "out_ptr"),
        "_backward_kernel": ("grad_q_ptr", "grad_k_ptr", "grad_v_ptr", "grad_local_ptr", "grad_gate_ptr",
                             "grad_part_ptr", "grad_param_ptr"),
        "_key_grad_kernel": ("grad_k_ptr", "grad_v_ptr", "grad_param_ptr"),
    },
    "pacs": {
        "_state_kernel": ("part_ptr",),
        "_forward_kernel": ("state_ptr", "out_ptr"),
        "_backward_kernel": ("grad_q_ptr", "grad_k_ptr", "grad_v_ptr", "grad_local_ptr", "grad_gate_ptr",
                             "grad_part_ptr", "grad_temp_ptr"),
        "_key_grad_kernel": ("grad_k_ptr", "grad_v_ptr"),
    },
    "causal": {
        "_walk_kernel": ("states_ptr", "keys_ptr", "counts_ptr", "final0_ptr", "final1_ptr", "final_key_ptr",
                         "final_count_ptr"),
        "_output_kernel": ("out_ptr", "stats_ptr"),
        "_walk_back_kernel": ("grad_states_ptr", "grad_keys_ptr", "grad_initial0_ptr", "grad_initial1_ptr",
                              "grad_initial_key_ptr"),
        "_grads_kernel": ("grad_q_ptr", "grad_k_ptr", "grad_v_ptr", "grad_param_ptr"),
    },
}


def _declared(kernel) -> tuple[str, ...] | None:
    op = kernel.fn.__module__.split(".")[-2]  # polaformer.ops.<op>.triton
    return WRITES.get(op, {}).get(kernel.fn.__name__)


@contextlib.contextmanager
def kernel_writes():
    """torch's mutation analysis answered from :data:`WRITES` for the interpreted kernels."""
    import torch._higher_order_ops.triton_kernel_wrap as wrap
    from triton.runtime.autotuner import Autotuner

    from polaformer.backends.triton.common import _Interpreted

    analysed = wrap.get_mutated_tensors

    def get_mutated_tensors(kernel_idx, constant_args_idx, kwargs, tma_descriptor_metadata):
        kernel = wrap.kernel_side_table.get_kernel(kernel_idx)
        while isinstance(kernel, Autotuner):  # how torch holds a launch's num_warps
            kernel = kernel.fn
        declared = _declared(kernel) if isinstance(kernel, _Interpreted) else None
        if declared is None:
            return analysed(kernel_idx, constant_args_idx, kwargs, tma_descriptor_metadata)
        read = [value for name, value in kwargs.items() if name not in declared]
        return [name for name in declared
                if isinstance(kwargs.get(name), torch.Tensor) and not any(kwargs[name] is value for value in read)]

    wrap.get_mutated_tensors = get_mutated_tensors
    try:
        yield
    finally:
        wrap.get_mutated_tensors = analysed

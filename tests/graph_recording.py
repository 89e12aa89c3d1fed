"""Recording what torch.compile makes of a call (tests' helper): the AOT forward and backward graphs and the
Triton kernels they launch (``wrap_triton``'s nodes, by name; read when the graph is made, as
``torch._dynamo.reset`` forgets the kernels)."""
from __future__ import annotations

from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd


def kernels_launched(graph_module) -> list[str]:
    """The Triton kernels the graph launches, by name."""
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table
    from triton.runtime.autotuner import Autotuner

    names = []
    for node in graph_module.graph.nodes:
        if node.op == "call_function" and "triton_kernel_wrapper" in str(node.target):
            kernel = kernel_side_table.get_kernel(node.kwargs["kernel_idx"])
            while isinstance(kernel, Autotuner):  # how torch holds a launch's num_warps
                kernel = kernel.fn
            names.append(kernel.fn.__name__)
    return names


class GraphRecorder:
    """A torch.compile backend (:meth:`backend`) that keeps the AOT graphs it is given, forward then backward, and
    the kernels each launches (:attr:`kernels`), and runs them as they are (``aot_eager``)."""

    def __init__(self):
        self.graphs = []
        self.kernels = []

    def _keep(self, graph_module, example_inputs):
        self.graphs.append(graph_module)
        self.kernels.append(kernels_launched(graph_module))
        return make_boxed_func(graph_module.forward)

    def backend(self):
        return aot_autograd(fw_compiler=self._keep, bw_compiler=self._keep)

"""The fused causal kernels as the rest of the stack sees them: a fixed number of Triton launches and torch
device ops per call, whatever the number of chunks and sequences, and no host read on a packed call; one
registered op in a ``torch.compile(fullgraph=True)`` graph with eager's values and gradients; the registered
ops' fake-tensor shapes and dtypes; and a second differentiation that raises instead of silently dropping a
term. Under the interpreter (conftest.py) on CPU tensors, in float64; skipped on a GPU, where the causal kernels'
values are tests/backends/triton/test_causal_kernels.py's.

Tolerances (tests/README.md): float64 at 1e-12, far above reorder_rtol(n, float64) for the chunk sums of these few
tokens and channels."""
from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from graph_recording import GraphRecorder
from interpreted_kernels import kernel_writes
from polaformer.ops import causal_pacs_linear_attention, causal_pola_linear_attention, rope_1d
from polaformer.ops.causal import CausalState, op as causal_ops, triton as triton_causal

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="counts the interpreter's launches and host reads on float64 CPU tensors")

D = 4

# Ops that only describe memory (views) or allocate it without writing: no device work.
_NO_WORK = {
    "alias", "as_strided", "detach", "empty", "empty_like", "empty_strided", "expand", "lift_fresh", "new_empty",
    "new_empty_strided", "permute", "reshape", "select", "slice", "split", "squeeze", "t", "transpose", "unbind",
    "unsqueeze", "view", "_unsafe_view",
}


class _DeviceOps(TorchDispatchMode):
    """Every aten op with a tensor among its arguments or results, outside Triton launches (the interpreter
    copies a launch's arguments with torch ops a GPU does not run), views and allocations excepted."""

    def __init__(self, record):
        super().__init__()
        self.record = record

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        touches_tensors = any(isinstance(x, torch.Tensor) for x in tree_flatten((args, kwargs, result))[0])
        if (not self.record.inside and touches_tensors and func.overloadpacket.__name__ not in _NO_WORK):
            self.record.ops.append(func.overloadpacket.__name__)
        return result


@pytest.fixture
def device_work(monkeypatch):
    """Records the Triton kernels launched, the torch device ops run and the host reads (``.tolist``,
    ``.item``) made outside launches, with the value checks that only CPU tensors get switched off (so the
    interpreter takes the CUDA path)."""
    record = SimpleNamespace(kernels=[], ops=[], reads=[], inside=False)
    kernel_type = type(triton_causal._walk_kernel)  # JITFunction, or InterpretedFunction under the interpreter
    launch = kernel_type.run

    def run(self, *args, **kwargs):
        record.kernels.append(self.fn.__name__)
        record.inside = True
        try:
            return launch(self, *args, **kwargs)
        finally:
            record.inside = False

    monkeypatch.setattr(kernel_type, "run", run)
    for name in ("tolist", "item"):
        read = getattr(torch.Tensor, name)

        def spy(self, *args, _read=read, _name=name):
            if not record.inside:
                record.reads.append(_name)
            return _read(self, *args)

        monkeypatch.setattr(torch.Tensor, name, spy)
    monkeypatch.setattr(causal_ops, "_host_checks", lambda x: False)

    def clear():
        record.kernels, record.ops, record.reads = [], [], []

    record.clear = clear
    record.mode = lambda: _DeviceOps(record)
    return record


def _call(op, q, k, v, params, tables=None, **kwargs):
    if op == "pola":
        return causal_pola_linear_attention(q, k, v, params[0], chunk_size=16, **kwargs)
    return causal_pacs_linear_attention(q, k, v, *params, *(tables or (None, None)), chunk_size=16, **kwargs)


def _inputs(op, batch, n, dtype=torch.float32, heads=1):
    q, k, v = (torch.randn(batch, heads, n, D, dtype=dtype) for _ in range(3))
    params = ([1 + torch.rand(1, heads, 1, D, dtype=dtype)] if op == "pola"
              else [torch.rand(1, heads, 1, 2 * D, dtype=dtype) for _ in range(2)])
    tables = rope_1d(torch.linspace(0.1, 1.0, D, dtype=dtype).repeat_interleave(2), n) if op == "pacs" else None
    return [t.requires_grad_() for t in (q, k, v, *params)], tables


@pytest.mark.parametrize("op", ["pola", "pacs"])
@pytest.mark.parametrize("layout", ["dense", "packed"])
def test_fixed_launches_and_no_host_reads(triton_backend, device_work, op, layout):
    """Forward: the state walk and the output kernel, nothing else. Backward: the walk back and the gradient
    kernel, and one torch reduction of the exponent's (or both temperatures') per-chunk partial gradients.
    The same for 1 or 3 chunks, 1 or 4 sequences (an empty one among them)."""
    sizes = {"dense": [(1, 16, None), (1, 40, None)],
             "packed": [(1, 16, [0, 16]), (1, 40, [0, 5, 5, 33, 40])]}[layout]
    for batch, n, offsets in sizes:
        (q, k, v, *params), tables = _inputs(op, batch, n)
        kwargs = {} if offsets is None else dict(cu_seqlens=torch.tensor(offsets, dtype=torch.int32))
        grad_out = torch.randn(batch, 1, n, D)
        device_work.clear()
        with device_work.mode():
            out = _call(op, q, k, v, params, tables, **kwargs)
        assert (device_work.kernels, device_work.ops, device_work.reads) == (["_walk_kernel", "_output_kernel"], [], [])
        device_work.clear()
        with device_work.mode():
            torch.autograd.grad(out, [q, k, v, *params], grad_out)
        assert (device_work.kernels, device_work.ops, device_work.reads) == (
            ["_walk_back_kernel", "_grads_kernel"], ["sum"], [])


@pytest.mark.parametrize("op", ["pola", "pacs"])
def test_compiled_graph_launches_the_kernels(triton_backend, op):
    """``torch.compile(fullgraph=True)`` traces the whole call (no value read, no graph break) through the
    registered op into the kernels' launches themselves (``wrap_triton``), forward and backward; compiled outputs
    and gradients equal eager's. Pola padded with an initial and a final state, PaCS packed with RoPE."""
    (q, k, v, *params), tables = _inputs(op, 2 if op == "pola" else 1, 20, dtype=torch.float64)
    if op == "pola":
        mask = torch.zeros(2, 20, dtype=torch.bool)
        mask[1, :2] = True
        kv = (torch.randn(2, 1, 2 * D, 2, dtype=torch.float64), torch.randn(2, 1, 2 * D, 2, dtype=torch.float64))
        state = CausalState(kv, torch.rand(2, 1, 2 * D, dtype=torch.float64), torch.full((2, 1, 1), 3.0,
                                                                                          dtype=torch.float64))

        def fn(q, k, v, power):
            out, final = _call(op, q, k, v, [power], key_padding_mask=mask, initial_state=state, return_state=True)
            return out, final.kv[0]
    else:
        offsets = torch.tensor([0, 7, 7, 20], dtype=torch.int32)

        def fn(q, k, v, ts, to):
            return _call(op, q, k, v, [ts, to], tables, cu_seqlens=offsets), q.new_zeros(())

    recorder = GraphRecorder()
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=recorder.backend(), fullgraph=True)
    leaves = [q, k, v, *params]
    results = []
    for run in (compiled, fn):
        with kernel_writes():
            out, final = run(*leaves)
            loss = (out * torch.linspace(-1, 1, out.shape[-2], dtype=out.dtype)[:, None]).sum() + final.sum()
            results.append((out, final, torch.autograd.grad(loss, leaves)))
    torch._dynamo.reset()
    (out, final, grads), (ref_out, ref_final, ref_grads) = results
    torch.testing.assert_close(out, ref_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(final, ref_final, rtol=1e-12, atol=1e-12)
    for grad, ref_grad in zip(grads, ref_grads):
        torch.testing.assert_close(grad, ref_grad, rtol=1e-12, atol=1e-12)
    assert recorder.kernels == [["_walk_kernel", "_output_kernel"], ["_walk_back_kernel", "_grads_kernel"]]


def _op_args(case):
    """Arguments of ``polaformer::causal_attention``: Pola padded with a strided mask and an initial state, or
    PaCS packed with RoPE."""
    n = 20
    op = "pola" if case == "mask-state" else "pacs"
    (q, k, v, *params), tables = _inputs(op, 2 if op == "pola" else 1, n)
    params = [p.detach() for p in params] + [None] * (2 - len(params))
    mask = cu = state = None
    if op == "pola":
        mask = (torch.rand(2, 2 * n) < 0.3)[:, ::2]
        state = (torch.randn(2, 1, 2 * D, 2), torch.randn(2, 1, 2 * D, 2), torch.rand(2, 1, 2 * D),
                 torch.full((2, 1, 1), 3.0))
    else:
        cu = torch.tensor([0, 7, 7, 20], dtype=torch.int32)
    return (q.detach(), k.detach(), v.detach(), *params, *(tables or (None, None)), mask, cu,
            *(state or (None,) * 4), triton_causal.FEATURES[op], 1e-6, 16)


@pytest.mark.parametrize("case", ["mask-state", "packed-rope"])
def test_registered_ops_fake_kernels_match_the_real_ones(triton_backend, case):
    """torch.library.opcheck: the forward op's and the backward op's schemas, and their fake kernels' shapes,
    dtypes and strides against a real run."""
    args = _op_args(case)
    torch.library.opcheck(torch.ops.polaformer.causal_attention.default, args,
                          test_utils=("test_schema", "test_faketensor"))
    out, *_, stats, states, keys, _ = torch.ops.polaformer.causal_attention(*args)
    grads = (torch.randn_like(out), None, None, None)
    backward_args = (*args[:9], out, stats, states, keys, *grads, *args[13:])
    torch.library.opcheck(torch.ops.polaformer.causal_attention_backward.default, backward_args,
                          test_utils=("test_schema", "test_faketensor"))


def test_second_derivative_raises_instead_of_dropping_a_term(triton_backend):
    """A gradient penalty (create_graph=True) through the kernels raises torch's once-differentiable error: the
    kernels' gradients do not depend on the inputs through autograd, so a second derivative would silently
    miss their terms."""
    (q, k, v, power), _ = _inputs("pola", 1, 18, dtype=torch.float64)
    out = causal_pola_linear_attention(q, k, v, power, chunk_size=16)
    (grad_q,) = torch.autograd.grad(out.square().sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        grad_q.square().sum().backward()

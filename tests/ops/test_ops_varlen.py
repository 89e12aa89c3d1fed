"""``pola_linear_attention``'s packed variable-length option (cu_seqlens) on the torch formulation: each
sequence gets exactly its output alone, gradients included; bad offsets give one clear error."""
import pytest
import torch

from polaformer.ops import dispatch, naive_pola_linear_attention, pola_linear_attention

pytestmark = pytest.mark.numerics  # tests/README.md: run again under ATEN_CPU_CAPABILITY=default


@pytest.fixture
def torch_backend():
    previous = dispatch.set_attention_backend("torch")
    yield
    dispatch.set_attention_backend(previous)


@pytest.mark.parametrize("key_offsets", [None, [0, 2, 2, 9]])
def test_packed_batch_equals_each_sequence_alone(torch_backend, key_offsets):
    query_offsets = [0, 4, 11, 12]
    keys = query_offsets if key_offsets is None else key_offsets
    q = torch.randn(1, 2, query_offsets[-1], 6, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 2, keys[-1], 6, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 2, keys[-1], 5, dtype=torch.float64, requires_grad=True)
    power = (1 + 2 * torch.rand(1, 2, 1, 6, dtype=torch.float64)).requires_grad_()
    extra = {} if key_offsets is None else {"cu_seqlens_k": torch.tensor(key_offsets)}
    out = pola_linear_attention(q, k, v, power, cu_seqlens=torch.tensor(query_offsets, dtype=torch.int32), **extra)
    pieces = []
    for s in range(3):
        qs, qe, ks, ke = query_offsets[s], query_offsets[s + 1], keys[s], keys[s + 1]
        if ke == ks:
            pieces.append(q.new_zeros(1, 2, qe - qs, 5))
        else:
            pieces.append(naive_pola_linear_attention(q[:, :, qs:qe], k[:, :, ks:ke], v[:, :, ks:ke], power))
    expected = torch.cat(pieces, dim=2)
    torch.testing.assert_close(out, expected)
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v, power), grad_out)
    expected_grads = torch.autograd.grad(expected, (q, k, v, power), grad_out)
    for grad, expected_grad in zip(grads, expected_grads):
        torch.testing.assert_close(grad, expected_grad)


@pytest.mark.parametrize("kwargs, message", [
    ({"cu_seqlens": torch.tensor([0, 3, 5])}, "end at the packed token count 6"),
    ({"cu_seqlens": torch.tensor([0.0, 6.0])}, "1-D int32/int64"),
    ({"cu_seqlens": torch.tensor([0, 6]), "cu_seqlens_k": torch.tensor([0, 2, 6])}, "as many sequences"),
    ({"cu_seqlens_k": torch.tensor([0, 6])}, "needs cu_seqlens"),
    ({"cu_seqlens": torch.tensor([0, 6]), "key_padding_mask": torch.zeros(1, 6, dtype=torch.bool)}, "not both"),
])
def test_bad_packed_arguments_are_named(torch_backend, kwargs, message):
    q, k, v = torch.randn(1, 2, 6, 4), torch.randn(1, 2, 6, 4), torch.randn(1, 2, 6, 4)
    with pytest.raises(ValueError, match=message):
        pola_linear_attention(q, k, v, 2.0, **kwargs)


def test_packed_batch_needs_batch_size_one(torch_backend):
    q = torch.randn(2, 2, 6, 4)
    with pytest.raises(ValueError, match="batch size 1"):
        pola_linear_attention(q, q, q, 2.0, cu_seqlens=torch.tensor([0, 6]))

"""Inputs and checks shared by the token-mixer tests (baseline layers and the LRA registry).

Tolerances (tests/README.md, tests/tolerances.py): float64 at 1e-10 absolute, far above reorder_rtol(n, float64) for a
layer's sums of at most a few hundred terms on these unit-scale inputs."""
import pytest
import torch

DIM, HEADS, HEAD_DIM, MAX_LEN = 16, 2, 8, 32


def randomize_zero_init(layer):
    """Non-trivial values for parameters that start at zero (temperatures, powers); returns the layer in eval mode."""
    with torch.no_grad():
        for pname, p in layer.named_parameters():
            if pname.endswith(("scale", "power", "s1", "s2")):
                p.uniform_(-0.5, 0.5)
    return layer.eval()


def padded_batch(lengths, n, dtype=torch.float64, junk=10.0):
    """(x, mask): ``x`` (B, n, DIM) with large random junk at the padded positions; mask True there."""
    x = torch.randn(len(lengths), n, DIM, dtype=dtype)
    pad = torch.arange(n)[None, :] >= torch.tensor(lengths)[:, None]
    x = torch.where(pad[..., None], junk * torch.randn_like(x), x)
    return x, pad


def check_finite_outputs_and_gradients(layer):
    """Full, mostly padded and all-padding sequences: finite outputs and gradients everywhere (float32 layer)."""
    layer.train()
    x, pad = padded_batch([16, 3, 0], 16, torch.float32)
    x.requires_grad_(True)
    out = layer(x, pad)
    assert out.shape == x.shape and out.dtype == torch.float32
    assert torch.isfinite(out).all()
    (out * torch.randn_like(out)).sum().backward()
    assert torch.isfinite(x.grad).all()
    for pname, p in layer.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), pname
    # no mask, and a sequence shorter than max_seq_len
    assert layer(torch.randn(2, 5, DIM)).shape == (2, 5, DIM)


def check_right_padding_gives_the_unpadded_output(layer):
    lengths = [14, 9, 3]
    x, pad = padded_batch(lengths, 14)
    with torch.no_grad():
        out = layer(x, pad)
        for b, n in enumerate(lengths):
            alone = layer(x[b:b + 1, :n])
            torch.testing.assert_close(out[b, :n], alone[0], atol=1e-10, rtol=0)


def check_padded_contents_never_reach_valid_outputs(layer):
    lengths = [18, 11, 4, 0]
    x, pad = padded_batch(lengths, 18)
    clean = x.masked_fill(pad[..., None], 0.0)
    with torch.no_grad():
        out_junk, out_zero = layer(x, pad), layer(clean, pad)
    valid = ~pad
    torch.testing.assert_close(out_junk[valid], out_zero[valid], atol=1e-10, rtol=0)
    assert torch.isfinite(out_junk).all()


def check_input_errors(layer):
    """Too long, a non-bool mask, the wrong channel count: each a ValueError naming it."""
    with pytest.raises(ValueError, match="exceeds max_seq_len"):
        layer(torch.randn(1, MAX_LEN + 1, DIM, dtype=torch.float64))
    with pytest.raises(ValueError, match="bool"):
        layer(torch.randn(1, 4, DIM, dtype=torch.float64), torch.zeros(1, 4))
    with pytest.raises(ValueError, match=r"\(B, N, 16\)"):
        layer(torch.randn(1, 4, DIM + 1, dtype=torch.float64))

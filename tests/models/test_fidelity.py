"""Where the official code returns an output, ours returns the same one (issue 12).

Each test runs an input that the library used to reject or compute differently, in float64,
forward and every gradient, against a plain reference written here from the official rules
(flat position tables, ``torch.chunk`` value split, flooring strided convs, bilinear stage
tables from the built grid). The attention math itself comes from the naive reference ops,
which other tests check against the official vectors.

Tolerances, from how far rounding alone moves these numbers. Changing every weight by one ulp
(random direction, float64) moved, relative to ``max(1, max|ref|)`` per tensor:

- the small models used here and in the reference vectors (0.2·N(0,1) weights): outputs by
  ≤ 3e-15, gradients by ≤ 2.4e-14;
- a deep Swin (Swin-T widths 96/192/384/768, depths 2-2-6-2, and Swin-S depths 2-2-18-2, on the
  official 56×56 layout, same weights): outputs by 3e-13 / 8e-13, gradients by 1.4e-11 / 5.5e-11
  (absolute 4.4e-8 / 3.5e-7; the largest gradients are 4.7e3 / 1.7e4). With timm's
  initialisation instead, ~1e-15.

So a single layer is compared at 1e-12 and a small whole model at 1e-11, a few hundred times
its one-ulp movement (operation order differs from the reference by a few ulp per op, and the
errors add along the depth) and still far below any formula difference (1e-3 and more). The
1e-9 of the reference vectors is 20× the one-ulp movement of a deep Swin's gradients, the
deepest model any float64 comparison in the suite runs.

Tolerances (tests/README.md, tests/tolerances.py): float64 only, at 1e-12 and 1e-13 absolute on unit-scale outputs,
far above reorder_rtol(n, float64) for these small layers' sums (n ≤ 500: 1.1e-13).
"""
import pytest
import timm
import torch
import torch.nn.functional as F

from polaformer.finetune import resample_position_table
from polaformer.layers import PolaLinearAttention, SpatialReductionAttention
from polaformer.models import _helpers
from polaformer.models.polapp import PolaFormerPP
from polaformer.models.pvt import PolaPVT
from polaformer.models.swin import PolaSwinTransformer
from polaformer.ops import learnable_power, naive_pola_linear_attention, pola_linear_attention, rope_angles

pytestmark = pytest.mark.numerics  # tests/README.md: run again under ATEN_CPU_CAPABILITY=default

F64 = torch.float64
LAYER_TOL = 1e-12
MODEL_TOL = 1e-11


def randomize(module, seed=0):
    """Weights as the reference vectors draw them: every entry non-zero, norms near 1."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in module.named_parameters():
            scale = 1.0 if name.endswith(("norm.weight", "norm1.weight", "norm2.weight")) else 0.0
            t.copy_(scale + 0.2 * torch.randn(t.shape, generator=gen, dtype=t.dtype))
    return module.eval()


def outputs_and_grads(fn, module, x, seed=1):
    """fn(x)'s output and the gradients of a fixed random projection of it w.r.t. x and every parameter."""
    x = x.detach().clone().requires_grad_(True)
    out = fn(x)
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
    params = list(module.parameters())
    grads = torch.autograd.grad((out * weight).sum(), [x] + params, allow_unused=True)
    return out.detach(), [torch.zeros_like(p) if g is None else g for g, p in zip(grads, [x] + params)]


def assert_same(fn, reference, module, x, tol):
    out, grads = outputs_and_grads(fn, module, x)
    ref_out, ref_grads = outputs_and_grads(reference, module, x)
    assert out.shape == ref_out.shape
    for got, want in [(out, ref_out)] + list(zip(grads, ref_grads)):
        assert (got - want).abs().max().item() <= tol * max(1.0, want.abs().max().item())


# --- plain references of the official layers -----------------------------------------------------

def reference_pola_attention(layer, x, height, width, table):
    """The official PVT/Swin Pola layer: ``table`` is added to the keys as given (flat)."""
    b, n, c = x.shape
    heads, d = layer.num_heads, c // layer.num_heads
    if hasattr(layer, "qkvg"):
        q, k, v, g = F.linear(x, layer.qkvg.weight, layer.qkvg.bias).chunk(4, dim=-1)
    else:
        q, g = F.linear(x, layer.qg.weight, layer.qg.bias).chunk(2, dim=-1)
        src = x
        if layer.sr_ratio > 1:  # the strided conv floors a grid it does not divide
            src = F.conv2d(x.transpose(1, 2).reshape(b, c, height, width), layer.sr.weight, layer.sr.bias,
                           stride=layer.sr_ratio).flatten(2).transpose(1, 2)
            src = F.layer_norm(src, (c,), layer.norm.weight, layer.norm.bias, layer.norm.eps)
        k, v = F.linear(src, layer.kv.weight, layer.kv.bias).chunk(2, dim=-1)
    m = k.shape[1]
    k = k + table
    scale = F.softplus(layer.scale)
    heads_of = lambda t: t.reshape(b, t.shape[1], heads, d).transpose(1, 2)  # noqa: E731
    power = learnable_power(layer.power, layer.alpha)
    out = naive_pola_linear_attention(heads_of(q / scale), heads_of(k / scale), heads_of(v), power)  # torch.chunk split
    out = out.transpose(1, 2).reshape(b, n, c)
    v = heads_of(v)
    if m != n:
        v = F.interpolate(v.transpose(-2, -1).reshape(b * heads, d, m), size=n, mode="linear")
        v = v.reshape(b, heads, d, n).transpose(-2, -1)
    v = v.reshape(b * heads, height, width, d).permute(0, 3, 1, 2)
    local = F.conv2d(v, layer.dwc.weight, layer.dwc.bias, padding=layer.dwc.padding, groups=d)
    return F.linear((out + local.reshape(b, c, n).transpose(1, 2)) * g, layer.proj.weight, layer.proj.bias)


def reference_sr_attention(layer, x, height, width):
    b, n, c = x.shape
    heads = layer.num_heads
    q = F.linear(x, layer.q.weight, layer.q.bias)
    src = F.conv2d(x.transpose(1, 2).reshape(b, c, height, width), layer.sr.weight, layer.sr.bias,
                   stride=layer.sr_ratio).flatten(2).transpose(1, 2)
    src = F.layer_norm(src, (c,), layer.norm.weight, layer.norm.bias, layer.norm.eps)
    k, v = F.linear(src, layer.kv.weight, layer.kv.bias).chunk(2, dim=-1)
    heads_of = lambda t: t.reshape(b, t.shape[1], heads, c // heads).transpose(1, 2)  # noqa: E731
    attn = torch.softmax(heads_of(q) @ heads_of(k).transpose(-2, -1) * layer.scale, dim=-1)
    return F.linear((attn @ heads_of(v)).transpose(1, 2).reshape(b, n, c), layer.proj.weight, layer.proj.bias)


def bilinear(table, old_grid, new_grid):
    """The official stage-table resampling, in the table's dtype."""
    grid = table.reshape(1, *old_grid, -1).permute(0, 3, 1, 2)
    grid = F.interpolate(grid, size=new_grid, mode="bilinear")
    return grid.reshape(1, -1, new_grid[0] * new_grid[1]).permute(0, 2, 1)


def reference_pvt(model, x):
    """The official Pola-PVT forward: flooring patch convs; a stage table is added flat when the stage has
    the first stage's built token count, else resampled bilinearly from the stage's built grid. Where the
    official flat add fails (a later stage's table on that many tokens), ours resamples too."""
    first = model.patch_embed1.num_patches
    for i in range(model.num_stages):
        embed = getattr(model, f"patch_embed{i + 1}")
        table = getattr(model, f"pos_embed{i + 1}")
        t = F.conv2d(x, embed.proj.weight, embed.proj.bias, stride=embed.patch_size)
        height, width = t.shape[-2:]
        t = embed.norm(t.flatten(2).transpose(1, 2))
        flat = height * width == first and table.shape[1] in (1, first)
        pos = table if flat else bilinear(table, embed.grid_size, (height, width))
        t = t + pos
        for blk in getattr(model, f"block{i + 1}"):
            t = blk(t, height, width)
        x = t.transpose(1, 2).reshape(t.shape[0], -1, height, width)
    return model.head(x.mean(dim=(-2, -1)))


# --- 1. flat key tables --------------------------------------------------------------------------

@pytest.mark.parametrize("grid,sr,rows", [
    ((4, 16), 1, 64),  # a table built for 8x8 keys on 4x16 keys
    ((16, 4), 1, 64),
    ((64, 16), 4, 64),  # 8x8 key table, sr 4 on 64x16 tokens: 16x4 keys
    ((3, 5), 1, 1),  # a one-row table broadcasts
    ((7, 9), 2, 1),
])
def test_pvt_key_table_is_added_flat_when_it_has_one_row_per_key(grid, sr, rows):
    layer = randomize(PolaLinearAttention(8, 2, sr_ratio=sr, key_pos_tokens=rows)).double()
    x = torch.randn(2, grid[0] * grid[1], 8, dtype=F64)
    reference = lambda t: reference_pola_attention(layer, t, *grid, layer.positional_encoding)  # noqa: E731
    assert_same(lambda t: layer(t, *grid), reference, layer, x, LAYER_TOL)


def test_key_table_of_another_length_is_resampled_in_float64():
    """Where the official layer fails (16 rows, 48 keys), the 4x4 table is resampled bilinearly in float64."""
    layer = randomize(PolaLinearAttention(8, 2, key_pos_tokens=16)).double()
    table = bilinear(layer.positional_encoding, (4, 4), (6, 8))
    via_float32 = bilinear(layer.positional_encoding.float(), (4, 4), (6, 8)).double()
    assert (table - via_float32).abs().max() > 1e-9  # what resampling in float32 loses
    x = torch.randn(2, 48, 8, dtype=F64)
    assert_same(lambda t: layer(t, 6, 8), lambda t: reference_pola_attention(layer, t, 6, 8, table), layer, x,
                LAYER_TOL)


# --- 2. resampling in the table's dtype ----------------------------------------------------------

@pytest.mark.parametrize("mode,antialias", [("bilinear", False), ("bicubic", True)])
def test_position_tables_resample_in_their_own_dtype(mode, antialias):
    table = torch.randn(1, 1 + 16, 6, dtype=F64)
    grid = table[:, 1:].reshape(1, 4, 4, 6).permute(0, 3, 1, 2)
    want = F.interpolate(grid, size=(3, 7), mode=mode, antialias=antialias, align_corners=False)
    want = torch.cat([table[:, :1], want.permute(0, 2, 3, 1).reshape(1, 21, 6)], dim=1)
    got = _helpers.pos_table_for_grid(table, (3, 7), (4, 4), num_prefix_tokens=1, interpolation=mode,
                                      antialias=antialias)
    assert got.dtype == F64 and torch.equal(got, want)
    assert torch.equal(resample_position_table(table, (3, 7), num_prefix_tokens=1, mode=mode, antialias=antialias),
                       want)
    half = _helpers.pos_table_for_grid(table.half(), (3, 7), (4, 4), 1, mode, antialias)
    assert half.dtype == torch.float16  # computed in float32, returned in the table's dtype


def test_swin_absolute_table_resampled_in_float64():
    model = randomize(PolaSwinTransformer(img_size=32, patch_size=4, embed_dim=8, depths=(1, 1), num_heads=(2, 2),
                                          window_size=8, ape=True, num_classes=3)).double()
    x = torch.randn(1, 3, 32, 64, dtype=F64)
    tokens = model.patch_embed(x)
    table = model.absolute_pos_embed.reshape(1, 8, 8, 8).permute(0, 3, 1, 2)
    want = F.interpolate(table, size=(8, 16), mode="bicubic", antialias=True, align_corners=False)
    with torch.no_grad():
        assert torch.equal(model._embed(x), tokens + want.permute(0, 2, 3, 1))


# --- 3. inputs the official code runs ------------------------------------------------------------

@pytest.mark.parametrize("dim,heads,sr,grid", [
    (15, 3, 1, (5, 6)),  # head_dim 5
    (6, 2, 2, (7, 9)),  # head_dim 3, a grid that sr does not divide
    (16, 2, 4, (9, 6)),
    (16, 2, 3, (8, 8)),
])
def test_pvt_attention_odd_head_dim_and_flooring_reduction(dim, heads, sr, grid):
    keys = (grid[0] // sr) * (grid[1] // sr)
    layer = randomize(PolaLinearAttention(dim, heads, sr_ratio=sr, key_pos_tokens=keys, kernel_size=3)).double()
    x = torch.randn(2, grid[0] * grid[1], dim, dtype=F64)
    reference = lambda t: reference_pola_attention(layer, t, *grid, layer.positional_encoding)  # noqa: E731
    assert_same(lambda t: layer(t, *grid), reference, layer, x, LAYER_TOL)


def test_swin_attention_odd_head_dim():
    layer = randomize(PolaLinearAttention(9, 3, key_pos_tokens=16, fused_qkvg=True)).double()  # head_dim 3
    x = torch.randn(3, 16, 9, dtype=F64)
    assert_same(lambda t: layer(t, 4, 4), lambda t: reference_pola_attention(layer, t, 4, 4, layer.positional_encoding),
                layer, x, LAYER_TOL)
    model = PolaSwinTransformer(img_size=32, embed_dim=6, depths=(1, 2), num_heads=(2, 4), window_size=4,
                                num_classes=3, attn_type="LS")  # head_dim 3 in both stages
    assert model(torch.randn(1, 3, 32, 32)).shape == (1, 3)


@pytest.mark.parametrize("dv", [3, 5])
def test_pola_op_odd_value_width_splits_as_torch_chunk(dv):
    gen = torch.Generator().manual_seed(dv)
    q, k, v = (torch.randn(2, 2, 7, dv, generator=gen, dtype=F64, requires_grad=True) for _ in range(3))
    w = torch.randn(1, 2, 1, dv, generator=gen, dtype=F64, requires_grad=True)
    args = (q, k, v, w)
    fast = pola_linear_attention(q, k, v, learnable_power(w, 4.0))
    naive = naive_pola_linear_attention(q, k, v, learnable_power(w, 4.0))
    torch.testing.assert_close(fast, naive, rtol=0, atol=1e-13)
    g = torch.randn(fast.shape, generator=gen, dtype=F64)
    for a, b in zip(torch.autograd.grad(fast, args, g), torch.autograd.grad(naive, args, g)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_softmax_sr_attention_floors_the_grid():
    layer = randomize(SpatialReductionAttention(12, 3, qkv_bias=True, sr_ratio=3)).double()
    x = torch.randn(2, 7 * 8, 12, dtype=F64)
    assert_same(lambda t: layer(t, 7, 8), lambda t: reference_sr_attention(layer, t, 7, 8), layer, x, LAYER_TOL)


def tiny_pvt(**kwargs):
    args = dict(img_size=64, embed_dims=(8, 12, 16, 16), num_heads=(2, 2, 2, 4), mlp_ratios=(2, 2, 2, 2),
                depths=(1, 1, 1, 1), num_classes=5, attn_type="LLSL", sr_ratios=(8, 4, 2, 1))
    args.update(kwargs)
    return randomize(PolaPVT(**args)).double()


@pytest.mark.parametrize("build,run", [
    (64, (32, 128)),  # every stage has its built token count on another grid: stage 1 and key tables flat
    (64, (128, 32)),
    (200, (200, 200)),  # official sizes not divisible by 32: stage grids 50/25/12/6
    (208, (208, 208)),  # 52/26/13/6
    (48, (96, 96)),  # official fails (key tables; stage 2's table flat on 144 tokens): ours resamples
])
def test_pvt_model_follows_the_official_position_rule(build, run):
    model = tiny_pvt(img_size=build)
    x = torch.randn(1, 3, *run, dtype=F64)
    assert_same(model, lambda t: reference_pvt(model, t), model, x, MODEL_TOL)


def test_pvt_200_stage_grids():
    model = tiny_pvt(img_size=200)
    shapes = [f.shape[-2:] for f in model.forward_intermediates(torch.randn(1, 3, 200, 200, dtype=F64),
                                                                 intermediates_only=True)]
    assert shapes == [(50, 50), (25, 25), (12, 12), (6, 6)]


def test_pvt_three_stages():
    model = tiny_pvt(num_stages=3, embed_dims=(8, 12, 16, 16))
    assert not any(k.startswith(("block4", "pos_embed4", "patch_embed4")) for k in model.state_dict())
    assert model.norm.weight.shape == (16,) and model.head.in_features == 16
    assert_same(model, lambda t: reference_pvt(model, t), model, torch.randn(2, 3, 64, 64, dtype=F64), MODEL_TOL)
    with pytest.raises(ValueError, match=r"embed_dims\[2\] must equal embed_dims\[3\]"):
        PolaPVT(num_stages=3, embed_dims=(8, 12, 16, 24), num_heads=(2, 2, 2, 4), depths=(1, 1, 1, 1))


def test_polapp_linear_only_stage_with_head_width_2_mod_4():
    # stage 1: head width 6, 'l' blocks only: the official model holds RoPE(12, 2) (2 angles) unused
    model = randomize(PolaFormerPP(embed_dims=(12, 16, 16, 16), depths=(2, 1, 1, 1), num_heads=(2, 2, 2, 2),
                                   block_types=("l", "l", "v", "v"), projection=8, num_classes=3)).double()
    want = (1.0 / 10000 ** torch.linspace(0, 1, 6 // 4)).repeat_interleave(2)
    assert torch.equal(model.layers[0].RoPE.angle, want)
    assert torch.equal(rope_angles(12, 2, allow_partial=True), want)
    x = torch.randn(1, 3, 32, 32, dtype=F64)
    with torch.no_grad():
        out = model(x)
        model.layers[0].RoPE.angle.fill_(123.0)  # unused, as in the official model
        assert torch.equal(model(x), out)
    with pytest.raises(ValueError, match="divisible by 4, got 6"):
        PolaFormerPP(embed_dims=(12, 16, 16, 16), depths=(1, 1, 1, 1), num_heads=(2, 2, 2, 2),
                     block_types=("v", "l", "v", "v"))(torch.randn(1, 3, 32, 32))


@pytest.mark.parametrize("size,grids", [
    ((64, 48), [(16, 12), (8, 6), (4, 3), (2, 2)]),
    ((17, 23), [(5, 6), (3, 3), (2, 2), (1, 1)]),  # every stride-2 conv pads: ceil(n/2)
])
def test_polapp_any_image_size(size, grids):
    model = randomize(timm.create_model("POLA_b0", embed_dims=(16, 24, 32, 48), depths=(1, 1, 1, 1),
                                        num_heads=(1, 1, 2, 3), projection=8, num_classes=3)).double()
    x = torch.randn(2, 3, *size, dtype=F64)
    feats = model.forward_intermediates(x, intermediates_only=True)
    assert [tuple(f.shape[-2:]) for f in feats] == grids
    out, grads = outputs_and_grads(model, model, x)
    assert out.shape == (2, 3) and all(torch.isfinite(g).all() for g in grads)
    # each image on its own gives its row of the batch (no padding or size effect across the batch)
    with torch.no_grad():
        torch.testing.assert_close(model(x[1:]), out[1:], rtol=0, atol=1e-12)

"""The fused CPU kernels (polaformer/backends/cpu/csrc/) against the torch-op versions they replace.

Tolerances (tests/README.md, tests/tolerances.py): the float64 kernels against the torch ops at 1e-12 to 1e-14
relative, above reorder_rtol(n, float64) for their sums (at most 64 terms: 1.4e-14·κ) or exactly equal where both add
in one order; float32 at 1e-5 to 1e-6 (1e-4 for a whole layer), probable_rtol over sums of at most a few hundred terms
(1.5e-5 at n = 256). Not in the ATEN_CPU_CAPABILITY=default pass: under it the kernels are not built."""
import logging
import shutil
from pathlib import Path

import pytest
import torch

import polaformer.backends.cpu.native as native_mod
import polaformer.ops.dispatch as dispatch
import polaformer.ops.pacs.autograd as pacs
import polaformer.ops.pola.autograd as pa
from polaformer.ops import (
    _common,
    learnable_power,
    naive_pola_linear_attention,
    pola_linear_attention,
    rope_2d,
    rope_angles,
)
from polaformer.ops._common import sum_to

F64 = torch.float64


def _can_build() -> bool:
    return (
        torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
        and shutil.which("c++") is not None
        and shutil.which("ninja") is not None
    )


@pytest.fixture(scope="module")
def native():
    module = native_mod.native_kernels()
    if module is None:
        if _can_build() and native_mod.native_enabled():
            pytest.fail("a compiler, ninja and a supported CPU are here, but the native kernels did not build")
        pytest.skip("native kernels unavailable here (no compiler/ninja, unsupported CPU, or POLAFORMER_NATIVE=0)")
    return module


@pytest.fixture
def torch_ops():
    """Runs the ops' torch-op versions: the ``torch`` backend offers no native kernel."""
    previous = dispatch.set_attention_backend("torch")
    yield
    dispatch.set_attention_backend(previous)


def _torch_op(fn, *args, **kwargs):
    """``fn`` on the torch formulation (the ``torch`` backend offers no native kernel to any op)."""
    previous = dispatch.set_attention_backend("torch")
    try:
        return fn(*args, **kwargs)
    finally:
        dispatch.set_attention_backend(previous)


def _x(shape, dtype=F64, seed=0, token_major=False):
    gen = torch.Generator().manual_seed(seed)
    if token_major:  # (B, N, H, d) memory seen as (B, H, N, d), as the layers pass q and k
        b, h, n, d = shape
        return torch.randn(b, n, h, d, generator=gen, dtype=dtype).transpose(1, 2)
    return torch.randn(*shape, generator=gen, dtype=dtype)


def _equal_nan(a, b, rtol, atol=0.0):
    assert a.shape == b.shape
    torch.testing.assert_close(a, b, rtol=rtol, atol=atol, equal_nan=True)


@pytest.mark.parametrize("d", [5, 32, 33, 64])
@pytest.mark.parametrize("power_shape", ["scalar", "channel", "head", "full"])
@pytest.mark.parametrize("token_major", [False, True])
def test_power_features_match_torch_ops(native, d, power_shape, token_major):
    b, h, n = 2, 3, 7
    x = _x((b, h, n, d), token_major=token_major)
    x[0, 0, 0, :3] = 0.0  # both halves 0, log -inf
    x[1, 2, 3, 1] = float("nan")
    shapes = {"scalar": (), "channel": (d,), "head": (h, 1, d), "full": (b, h, 1, d)}
    power = 1.0 + 3.0 * torch.rand(shapes[power_shape], dtype=F64)
    feat, log_abs = native.power_features(x, power, True)
    ref_feat, ref_log = _torch_op(pa._power_features, x, power)
    _equal_nan(feat, ref_feat, rtol=1e-14)
    _equal_nan(log_abs, ref_log, rtol=1e-14)
    assert torch.isnan(feat[1, 2, 3, [1, d + 1]]).all(), "NaN input must give NaN in both halves"
    assert (feat[0, 0, 0, :3] == 0).all() and (feat[0, 0, 0, d:d + 3] == 0).all()
    # +inf: inf in the positive half and 0 in the other, as relu then pow gives (the torch-op version's
    # relu(s) - s makes that inf - inf = NaN)
    x_inf = x.clone()
    x_inf[1, 1, 2, 0] = float("inf")
    inf_feat = native.power_features(x_inf, power, False)[0][1, 1, 2]
    assert inf_feat[0] == float("inf") and inf_feat[d] == 0
    no_log_feat, none = native.power_features(x, power, False)
    assert none is None or none.numel() == 0
    assert torch.equal(no_log_feat.nan_to_num(), feat.nan_to_num())


@pytest.mark.parametrize("d", [5, 32])
@pytest.mark.parametrize("need_power_grad", [True, False])
def test_power_backward_matches_torch_ops(native, d, need_power_grad):
    b, h, n = 2, 3, 300  # more tokens than one reduction chunk
    x = _x((b, h, n, d), token_major=True)
    x[0, 1, 5, :2] = 0.0
    power = 1.0 + 3.0 * torch.rand(h, 1, d, dtype=F64)
    feat, log_abs = native.power_features(x, power, True)
    grad_feat = _x((b, h, n, 2 * d), seed=1)
    grad_x, grad_p = native.power_backward(x, feat, log_abs, grad_feat, power, need_power_grad)
    ref_x, ref_p = _torch_op(pa._power_backward, x, feat, log_abs, grad_feat.clone(), power, need_power_grad)
    _equal_nan(grad_x, ref_x, rtol=1e-13)
    assert (grad_x[0, 1, 5, :2] == 0).all()
    if need_power_grad:
        assert grad_p.shape == (b, h, 1, d)
        _equal_nan(sum_to(grad_p, power.shape), sum_to(ref_p, power.shape), rtol=1e-12)


def test_power_grad_does_not_depend_on_thread_count(native):
    x = _x((2, 2, 1000, 32), dtype=torch.float32)
    power = 1.0 + 3.0 * torch.rand(2, 1, 32)
    feat, log_abs = native.power_features(x, power, True)
    grad_feat = _x((2, 2, 1000, 64), dtype=torch.float32, seed=3)
    threads = torch.get_num_threads()
    try:
        results = []
        for count in (1, 2):
            torch.set_num_threads(count)
            results.append(native.power_backward(x, feat, log_abs, grad_feat, power, True))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


@pytest.mark.parametrize("dv,half", [(64, 32), (7, 4), (34, 17)])
def test_normalise_and_output_grad_match_torch_ops(native, dv, half):
    b, h, n = 2, 3, 11
    res = _x((b, h, n, dv + 2)).abs_()
    out = pa._token_major_output(_x((b, h, n, 4)), _x((b, h, n, dv)))
    ref_out = torch.empty_like(out)
    denom = native.normalise(res.clone(), 1e-6, half, out)
    ref_denom = _torch_op(pa._normalise, res.clone(), 1e-6, half, ref_out)
    _equal_nan(out, ref_out, rtol=0.0)
    _equal_nan(denom, ref_denom, rtol=0.0)
    grad_out = _x((b, h, n, dv), seed=2)
    g = native.output_grad(grad_out, denom, out, half)
    ref_g = _torch_op(pa._output_grad, grad_out, ref_denom, ref_out, half)
    _equal_nan(g, ref_g, rtol=1e-13)


@pytest.mark.parametrize("d", [5, 32, 33])
@pytest.mark.parametrize("keep_log", [True, False])
def test_query_features_with_normalisers_match_torch_ops(native, d, keep_log):
    b, h, n = 2, 3, 11
    x = _x((b, h, n, d), token_major=True)
    x[0, 0, 0, :2] = 0.0  # zeros give 0 in both halves, and nothing in the normalisers
    power = learnable_power(_x((1, h, 1, d), seed=1), 4.0)
    key_means = _x((b, h, 2 * d), seed=2).abs_()
    feat, log_abs, z = native.power_features_dots(x, power, key_means, 1e-6, keep_log)
    ref_feat, ref_log = _torch_op(pa._power_features, x, power)
    _equal_nan(feat, ref_feat, rtol=1e-14)
    if keep_log:
        _equal_nan(log_abs, ref_log, rtol=1e-14)
    swapped = torch.cat([key_means[..., d:], key_means[..., :d]], -1)
    ref_z = torch.stack([ref_feat @ key_means.unsqueeze(-1), ref_feat @ swapped.unsqueeze(-1)], -1)[..., 0, :] + 1e-6
    torch.testing.assert_close(z, ref_z, rtol=1e-13, atol=0)
    res = _x((b, h, n, 7), seed=3)
    out = pa._token_major_output(x, res)
    native.divide_streams(res, z, 4, out)
    divided = torch.cat([res[..., :4] / z[..., :1], res[..., 4:] / z[..., 1:]], -1)
    torch.testing.assert_close(out, divided, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="key_means must be"):
        native.power_features_dots(x, power, key_means[..., 1:], 1e-6, keep_log)


@pytest.mark.parametrize("d,dv,half", [(32, 64, 32), (5, 7, 4), (8, 34, 17), (3, 2, 1)])
@pytest.mark.parametrize("dtype", [F64, torch.float32])
def test_stream_rhs_and_its_backward_match_torch_ops(native, d, dv, half, dtype):
    b, h, m = 2, 3, 197
    kv = _x((b, h, 2 * d, dv), dtype)
    k_sum = _x((b, h, 2 * d, 2), dtype, seed=1)[..., 0]  # a strided view: the kernel must not assume contiguity
    rhs = native.stream_rhs(kv, k_sum, float(m), half)
    ref = _torch_op(pa._stream_rhs, kv.clone(), k_sum.clone(), m, half)
    torch.testing.assert_close(rhs, ref, rtol=0, atol=0)
    grad_rhs = _x((b, h, 2 * d, dv + 2), dtype, seed=2)
    grad_kv, grad_sum = native.stream_rhs_backward(grad_rhs, float(m), half)
    ref_kv, ref_sum = _torch_op(pa._stream_rhs_backward, grad_rhs, m, half)
    torch.testing.assert_close(grad_kv, ref_kv, rtol=0, atol=0)
    torch.testing.assert_close(grad_sum, ref_sum, rtol=0, atol=0)


@pytest.mark.parametrize("blocks", [False, True])
@pytest.mark.parametrize("dtype", [F64, torch.float32])
def test_native_forward_without_gradients_matches_torch_ops_and_reference(native, monkeypatch, blocks, dtype):
    if blocks:  # blocks of 7 tokens, the last one short, for the keys and for the queries
        monkeypatch.setattr(_common, "BLOCK_ELEMENTS", 1)
        monkeypatch.setattr(_common, "MIN_BLOCK_TOKENS", 7)
    q = _x((2, 3, 40, 8), dtype, token_major=True)
    k = _x((2, 3, 29, 8), dtype, seed=1, token_major=True)
    v = _x((2, 3, 29, 5), dtype, seed=2)
    power = learnable_power(_x((1, 3, 1, 8), dtype, seed=3), 4.0)
    with torch.no_grad():
        fused = native.pola_forward_no_grad(q, k, v, power, 1e-6, _common.BLOCK_ELEMENTS, _common.MIN_BLOCK_TOKENS)
        through_op = pola_linear_attention(q, k, v, power)
        plain = _torch_op(pola_linear_attention, q, k, v, power)
    assert fused.shape == (2, 3, 40, 5) and fused.transpose(1, 2).is_contiguous()  # token-major, as the layers use
    torch.testing.assert_close(through_op, fused, rtol=0, atol=0)
    tol = dict(rtol=1e-12, atol=1e-13) if dtype == F64 else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fused, plain, **tol)
    ref = naive_pola_linear_attention(q.double(), k.double(), v.double(), power.double())
    torch.testing.assert_close(fused.double(), ref, **tol)


def test_no_gradient_forward_is_one_native_call_only_where_that_applies(native, monkeypatch):
    calls = []

    class Spy:
        def __getattr__(self, name):
            return getattr(native, name)

        def pola_forward_no_grad(self, *args):
            calls.append(args[0].shape)
            return native.pola_forward_no_grad(*args)

    monkeypatch.setattr(pa, "cpu_kernels", lambda x: Spy())
    q, k, v = (_x((2, 3, 9, 4), torch.float32, seed=s) for s in range(3))
    ref = naive_pola_linear_attention(q.double(), k.double(), v.double(), 2.5)
    mask = torch.zeros(2, 9, dtype=torch.bool)
    with torch.no_grad():
        cases = {
            "eligible": lambda: pola_linear_attention(q, k, v, 2.5),
            "masked": lambda: pola_linear_attention(q, k, v, 2.5, key_padding_mask=mask),
            "float64 power": lambda: pola_linear_attention(q, k, v, torch.tensor(2.5, dtype=F64)),
            "strided channels": lambda: pola_linear_attention(q.transpose(-2, -1).contiguous().transpose(-2, -1),
                                                              k, v, 2.5),
        }
        for name, call in cases.items():
            torch.testing.assert_close(call().double(), ref, rtol=1e-5, atol=1e-6, msg=name)
            assert len(calls) == 1, name  # the first case only
        with torch.autocast("cpu", dtype=torch.bfloat16):
            torch.testing.assert_close(pola_linear_attention(q, k, v, 2.5).double(), ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(pola_linear_attention(q.requires_grad_(), k, v, 2.5).double(), ref,
                               rtol=1e-5, atol=1e-6)
    assert len(calls) == 1


def test_stream_rhs_rejects_malformed_inputs(native):
    with pytest.raises(RuntimeError, match="kv must be"):
        native.stream_rhs(_x((2, 3, 5, 4)), _x((2, 3, 5)), 1.0, 2)
    with pytest.raises(RuntimeError, match="k_sum must be"):
        native.stream_rhs(_x((2, 3, 6, 4)), _x((2, 3, 4)), 1.0, 2)
    with pytest.raises(RuntimeError, match="half must"):
        native.stream_rhs_backward(_x((2, 3, 6, 6)), 1.0, 5)


@pytest.mark.parametrize("shape", [(2, 3, 9, 13, 8, 10), (1, 2, 64, 64, 32, 32), (3, 1, 5, 300, 6, 5)])
@pytest.mark.parametrize("masked", [False, True])
def test_op_with_native_kernels_equals_reference_forward_and_backward(native, shape, masked):
    b, h, n, m, d, dv = shape
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(b, h, t, c, generator=gen, dtype=F64).requires_grad_() for t, c in ((n, d), (m, d), (m, dv)))
    w = torch.randn(1, h, 1, d, generator=gen, dtype=F64).requires_grad_()
    mask = (torch.rand(b, m, generator=gen) < 0.3) if masked else None
    fast = pola_linear_attention(q, k, v, learnable_power(w, 4.0), key_padding_mask=mask)
    ref = naive_pola_linear_attention(q, k, v, learnable_power(w, 4.0), key_padding_mask=mask)
    torch.testing.assert_close(fast, ref, rtol=1e-10, atol=1e-12)
    grad = torch.randn(ref.shape, generator=gen, dtype=F64)
    for a, r in zip(torch.autograd.grad(fast, (q, k, v, w), grad), torch.autograd.grad(ref, (q, k, v, w), grad)):
        torch.testing.assert_close(a, r, rtol=1e-9, atol=1e-11)


def test_op_float32_native_equals_torch_ops(native, torch_ops):
    gen = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(2, 4, 197, 32, generator=gen).requires_grad_() for _ in range(3))
    w = torch.randn(1, 4, 1, 32, generator=gen).requires_grad_()
    plain = pola_linear_attention(q, k, v, learnable_power(w, 4.0))
    plain_grads = torch.autograd.grad(plain.square().sum(), (q, k, v, w))
    pa.cpu_kernels = dispatch.cpu_kernels  # back on, for the fused run
    fused = pola_linear_attention(q, k, v, learnable_power(w, 4.0))
    fused_grads = torch.autograd.grad(fused.square().sum(), (q, k, v, w))
    torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-6)
    for a, b in zip(fused_grads, plain_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(pola_linear_attention(q, k, v, learnable_power(w, 4.0)), plain, rtol=1e-5, atol=1e-6)


def test_switched_off_by_environment(monkeypatch):
    monkeypatch.setenv("POLAFORMER_NATIVE", "0")
    assert not native_mod.native_enabled()
    assert native_mod.native_kernels() is None


def test_unsupported_cpu_falls_back_to_torch_ops_with_a_warning(monkeypatch, caplog):
    monkeypatch.setattr(native_mod, "_state", {})
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")
    with caplog.at_level(logging.WARNING, logger="polaformer.backends.cpu.native"):
        assert native_mod.native_kernels() is None
    assert "not built for CPU capability DEFAULT" in caplog.text
    q, k, v = (torch.randn(1, 2, 10, 8, dtype=F64) for _ in range(3))
    out = pola_linear_attention(q, k, v, 3.0)
    torch.testing.assert_close(out, naive_pola_linear_attention(q, k, v, torch.tensor(3.0, dtype=F64)))


def test_failed_build_falls_back_with_a_warning(monkeypatch, caplog, tmp_path):
    monkeypatch.setattr(native_mod, "_state", {})
    monkeypatch.setattr(native_mod, "_SOURCE_DIR", tmp_path)
    (tmp_path / "broken.cpp").write_text("this is not C++\n")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "build"))
    with caplog.at_level(logging.WARNING, logger="polaformer.backends.cpu.native"):
        assert native_mod.native_kernels() is None
    if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
        assert "build failed" in caplog.text


@pytest.fixture
def fake_builds(monkeypatch, tmp_path):
    """cpp_extension.load replaced by a stand-in that writes a library file where it is told (and counts the
    calls); loading a library returns its path. The build root is tmp_path/build."""
    from torch.utils import cpp_extension

    if torch.backends.cpu.get_cpu_capability() not in native_mod._FLAGS:
        pytest.skip("no native build for this CPU")
    calls = []

    def load(**kwargs):
        calls.append(kwargs)
        library = Path(kwargs["build_directory"]) / f"{kwargs['name']}.so"
        library.write_bytes(b"a library")
        return library

    monkeypatch.setattr(cpp_extension, "load", load)
    monkeypatch.setattr(cpp_extension, "_get_build_directory", lambda name, verbose: str(tmp_path / "build" / name))
    monkeypatch.setattr(native_mod, "_load_library", lambda name, path: path)
    return calls


def test_every_source_is_built_under_a_name_that_changes_with_any_header(monkeypatch, tmp_path, fake_builds):
    for name in ("b.cpp", "a.cpp", "shared.h"):
        (tmp_path / name).write_text(f"// {name}\n")
    monkeypatch.setattr(native_mod, "_SOURCE_DIR", tmp_path)
    native_mod._build()
    (tmp_path / "shared.h").write_text("// shared.h, edited\n")
    native_mod._build()
    first, second = fake_builds
    private = Path(first["build_directory"])
    assert private.name.startswith(f"{first['name']}.build-")  # built aside, then renamed into place
    assert first["sources"] == [str(private / "src" / "a.cpp"), str(private / "src" / "b.cpp")]
    staged = tmp_path / "build" / first["name"] / "src"
    assert (staged / "shared.h").read_text() == "// shared.h\n"
    assert first["name"] != second["name"]
    assert first["name"].startswith(second["name"].rsplit("_", 1)[0])


def test_two_checkouts_of_the_same_sources_share_one_build(monkeypatch, tmp_path, fake_builds):
    """The build is keyed by the sources' content: a second checkout loads the first one's build."""
    for checkout in ("one", "two"):
        (tmp_path / checkout).mkdir()
        (tmp_path / checkout / "a.cpp").write_text("// a.cpp\n")
        monkeypatch.setattr(native_mod, "_SOURCE_DIR", tmp_path / checkout)
        library = native_mod._build()
    assert len(fake_builds) == 1 and library == tmp_path / "build" / fake_builds[0]["name"] / library.name


def test_two_environments_build_once_each_and_never_into_a_loaded_library(monkeypatch, tmp_path, fake_builds):
    """Two virtual environments with the same torch but other paths (here: another include path) used to
    build into one folder with different commands, each recompiling the other's objects and relinking the
    library a process had loaded. Now the key holds every input, each builds once into its own folder, and a
    folder, once renamed into place, is never written again."""
    from torch.utils import cpp_extension

    real_include_paths = cpp_extension.include_paths
    environments = {"one": real_include_paths(), "two": ["/other/venv/site-packages/torch/include"]}
    capability = torch.backends.cpu.get_cpu_capability()
    names = {}
    for environment, paths in environments.items():
        monkeypatch.setattr(cpp_extension, "include_paths", lambda *args, paths=paths, **kwargs: list(paths))
        names[environment] = native_mod.build_name(capability, cpp_extension)
        assert paths[0] in native_mod.build_inputs(capability, cpp_extension)["include_paths"]
    assert names["one"] != names["two"]

    libraries = {}
    for round_ in range(2):
        for environment, paths in environments.items():
            monkeypatch.setattr(cpp_extension, "include_paths", lambda *args, paths=paths, **kwargs: list(paths))
            loaded = native_mod._build()
            library = tmp_path / "build" / names[environment] / f"{names[environment]}.so"
            stat = library.stat()
            if round_ == 0:
                libraries[environment] = (stat.st_ino, stat.st_mtime_ns)
            else:  # loaded from its folder as built: not rebuilt, not rewritten
                assert loaded == library and (stat.st_ino, stat.st_mtime_ns) == libraries[environment]
    assert [call["name"] for call in fake_builds] == [names["one"], names["two"]]
    assert all(Path(call["build_directory"]).name.startswith(f"{call['name']}.build-") for call in fake_builds)
    assert sorted(p.name for p in (tmp_path / "build").iterdir()) == sorted(
        [*names.values(), *(f"{name}.lock" for name in names.values())])  # no private folder left


def test_a_build_killed_midway_leaves_nothing_that_is_loaded(monkeypatch, tmp_path, fake_builds, caplog):
    """A failed build removes its private folder; the next process builds afresh (a leftover of a killed one is
    removed under the lock) and nothing half-built is ever in the folder that processes load from."""
    from torch.utils import cpp_extension

    name = native_mod.build_name(torch.backends.cpu.get_cpu_capability(), cpp_extension)
    leftover = tmp_path / "build" / f"{name}.build-0123456789ab"
    leftover.mkdir(parents=True)
    (leftover / "half.o").write_bytes(b"")

    def failing(**kwargs):
        raise RuntimeError("Error building extension")

    monkeypatch.setattr(cpp_extension, "load", failing)
    with caplog.at_level(logging.WARNING, logger="polaformer.backends.cpu.native"):
        assert native_mod._build() is None
    assert "build failed (Error building extension)" in caplog.text
    assert sorted(p.name for p in (tmp_path / "build").iterdir()) == [f"{name}.lock"]


def test_the_shipped_sources_include_every_kernel_family():
    names = {path.name for path in native_mod._sources()}
    assert {"bindings.cpp", "pola_power.cpp", "pacs.cpp", "pacs_fused.cpp", "rope.cpp", "gelu.cpp",
            "depthwise.cpp"} <= names

# ---- PaCS ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("rope", [False, True])
@pytest.mark.parametrize("token_major", [False, True])
@pytest.mark.parametrize("with_exp", [False, True])
def test_pacs_halves_match_torch_ops(native, rope, token_major, with_exp):
    x = _x((2, 3, 9, 18), token_major=token_major)  # d = 18: a vector and a scalar tail at any width
    x[0, 0, 0, :4] = 0.0
    x[1, 2, 3, 5] = float("nan")
    out, same = native.pacs_halves(x, rope, with_exp)
    assert same is out  # no tables: the features are their own numerator
    ref = _torch_op(pacs._relu_halves, x, rope, with_exp)
    _equal_nan(out, ref, rtol=1e-13, atol=1e-15)
    if rope:
        sin, cos = rope_2d(rope_angles(2 * 18 * 3, 3, dtype=F64), 3, 3)
        tables = pacs._arrange_rope_tables(sin, cos)
        feat, rotated = native.pacs_halves(x, rope, with_exp, tables[0][:1], tables[1][:1])
        _equal_nan(feat, ref, rtol=1e-13, atol=1e-15)
        _equal_nan(rotated, pacs._rotate(ref, tables[0][0], tables[1][0]), rtol=1e-13, atol=1e-15)


@pytest.mark.parametrize("temp_shape", [(2, 3, 2, 1, 36), (1, 3, 2, 1, 36), (1, 1, 2, 1, 36)])
def test_pacs_exp_features_match_torch_ops(native, temp_shape):
    p = _x((2, 3, 9, 36)).abs_()
    temps = torch.rand(temp_shape, dtype=F64)
    ref = (p.unsqueeze(2) * temps).exp() - 1
    phi, same = native.pacs_exp_features(p, temps)
    assert same is phi
    _equal_nan(phi, ref, rtol=1e-13, atol=1e-15)
    sin, cos = rope_2d(rope_angles(36 * 3, 3, dtype=F64), 3, 3)
    tables = pacs._arrange_rope_tables(sin, cos)
    phi, rotated = native.pacs_exp_features(p, temps, *tables)
    _equal_nan(phi, ref, rtol=1e-13, atol=1e-15)
    _equal_nan(rotated, pacs._rotate(ref, *tables), rtol=1e-13, atol=1e-15)
    # a block of rows of the tables (the no-gradient forward passes strided views)
    phi, rotated = native.pacs_exp_features(p[:, :, 2:5].contiguous(), temps, *(t[:, 2:5] for t in tables))
    _equal_nan(rotated, pacs._rotate(ref[:, :, :, 2:5], *(t[:, 2:5] for t in tables)), rtol=1e-13, atol=1e-15)
    # with the key means, each stream's normaliser phi . k_mean + eps as well (w = 36 = 2 vectors + a tail
    # at AVX-512 float64, one vector + a tail at AVX2)
    k_means = _x((2, 3, 2, 36, 1), seed=4).abs_()
    for table_args in ((None, None), tables):
        phi, rotated, denom = native.pacs_exp_features(p, temps, *table_args, k_means, 1e-6)
        _equal_nan(phi, ref, rtol=1e-13, atol=1e-15)
        torch.testing.assert_close(denom, torch.matmul(ref, k_means) + 1e-6, rtol=1e-13, atol=0)
    with pytest.raises(RuntimeError, match="dtypes differ"):
        native.pacs_exp_features(p, temps, None, None, k_means.float(), 1e-6)


@pytest.mark.parametrize("rope", [False, True])
def test_pacs_backward_kernels_match_torch_ops(native, rope):
    b, h, n, d = 2, 3, 300, 10  # more tokens than one reduction chunk
    q, k = _x((b, h, n, d), token_major=True), _x((b, h, n, d), seed=1)
    q[0, 0, 0, :3] = 0.0
    temps = torch.rand(1, h, 2, 1, 2 * d, dtype=F64)
    p_q = native.pacs_halves(q, rope, False)[0]
    phi_q = native.pacs_exp_features(p_q, temps)[0]
    grad_phi_q = _x(tuple(phi_q.shape), seed=2)
    grad_q, grad_t = native.pacs_query_backward(q, p_q, phi_q, grad_phi_q, temps, rope, True)
    grad_pre = grad_phi_q * (phi_q + 1)
    ref_grad_q = _torch_op(pacs._unrelu, q, (grad_pre * temps).sum(2), rope)
    torch.testing.assert_close(grad_q, ref_grad_q, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(grad_t, (grad_pre * p_q.unsqueeze(2)).sum(3, keepdim=True), rtol=1e-12, atol=1e-12)
    phi_k = native.pacs_halves(k, rope, True)[0]
    grad_phi_k = _x(tuple(phi_k.shape), seed=3)
    ref_grad_k = _torch_op(pacs._unrelu, k, grad_phi_k * (phi_k + 1), rope)
    torch.testing.assert_close(native.pacs_key_backward(k, phi_k, grad_phi_k, rope), ref_grad_k, rtol=1e-14, atol=0)
    nan_k = k.clone()
    nan_k[0, 0, 0, 0] = float("nan")
    assert torch.isnan(native.pacs_key_backward(nan_k, phi_k, grad_phi_k, rope)[0, 0, 0, 0])


@pytest.mark.parametrize("rope", [False, True])
@pytest.mark.parametrize("masked", [False, True])
def test_pacs_op_with_native_kernels_equals_reference_forward_and_backward(native, rope, masked):
    from polaformer.ops import naive_pacs_linear_attention, pacs_linear_attention

    b, h, side, d, dv = 2, 3, 5, 8, 10
    n = side * side
    gen = torch.Generator().manual_seed(13)
    q, k, v = (torch.randn(b, h, n, c, generator=gen, dtype=F64).requires_grad_() for c in (d, d, dv))
    t_same = torch.rand(1, h, 1, 2 * d, generator=gen, dtype=F64).requires_grad_()
    t_opp = torch.rand(1, h, 1, 2 * d, generator=gen, dtype=F64).requires_grad_()
    sin, cos = rope_2d(rope_angles(2 * d * h, h, dtype=F64), side, side) if rope else (None, None)
    mask = (torch.rand(b, n, generator=gen) < 0.3) if masked else None
    fast = pacs_linear_attention(q, k, v, t_same, t_opp, sin, cos, key_padding_mask=mask)
    ref = naive_pacs_linear_attention(q, k, v, t_same, t_opp, sin, cos, key_padding_mask=mask)
    torch.testing.assert_close(fast, ref, rtol=1e-10, atol=1e-12)
    grad = torch.randn(ref.shape, generator=gen, dtype=F64)
    leaves = (q, k, v, t_same, t_opp)
    for a, r in zip(torch.autograd.grad(fast, leaves, grad), torch.autograd.grad(ref, leaves, grad)):
        torch.testing.assert_close(a, r, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("case", ["rope", "plain", "cross", "long", "narrow"])
def test_fused_pacs_op_equals_reference_forward_and_backward(native, case, monkeypatch):
    """The per-row fused kernels (the path the layers take) against the O(N²) reference in float64: RoPE or
    not, other key counts, more tokens than one reduction chunk, widths with vector tails, token-major
    (strided) q, k, v as the layers pass them."""
    from polaformer.ops import naive_pacs_linear_attention, pacs_linear_attention

    b, h, n, m, d, dv = {"rope": (2, 3, 30, 30, 8, 10), "plain": (2, 2, 13, 13, 6, 4),
                         "cross": (2, 2, 9, 21, 8, 6), "long": (1, 2, 600, 600, 16, 8),
                         "narrow": (3, 1, 7, 7, 18, 2)}[case]
    gen = torch.Generator().manual_seed(21)
    q = torch.randn(b, n, h, d, generator=gen, dtype=F64).transpose(1, 2).requires_grad_()
    k, v = (torch.randn(b, m, h, c, generator=gen, dtype=F64).transpose(1, 2).requires_grad_() for c in (d, dv))
    t_same, t_opp = (torch.rand(1, h, 1, 2 * d, generator=gen, dtype=F64).requires_grad_() for _ in range(2))
    sin = cos = None
    if case == "rope":
        sin, cos = rope_2d(rope_angles(2 * d * h, h, dtype=F64), 5, 6)
    elif case == "long":
        sin, cos = rope_2d(rope_angles(2 * d * h, h, dtype=F64), 20, 30)
    backward_calls = []
    real = pacs._pacs_backward_fused
    monkeypatch.setattr(pacs, "_pacs_backward_fused", lambda *a: backward_calls.append(1) or real(*a))
    leaves = (q, k, v, t_same, t_opp)
    fast = pacs_linear_attention(*leaves, sin, cos)
    ref = naive_pacs_linear_attention(*leaves, sin, cos)
    torch.testing.assert_close(fast, ref, rtol=1e-10, atol=1e-12)
    grad = torch.randn(ref.shape, generator=gen, dtype=F64)
    for a, r in zip(torch.autograd.grad(fast, leaves, grad), torch.autograd.grad(ref, leaves, grad)):
        torch.testing.assert_close(a, r, rtol=1e-9, atol=1e-11)
    assert backward_calls == [1]
    with torch.no_grad():
        torch.testing.assert_close(pacs_linear_attention(*leaves, sin, cos), ref, rtol=1e-10, atol=1e-12)


def test_fused_pacs_op_does_not_depend_on_thread_count(native):
    from polaformer.ops import pacs_linear_attention

    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 2, 700, 8, generator=gen).requires_grad_() for _ in range(3))
    temps = [torch.rand(1, 2, 1, 16, generator=gen).requires_grad_() for _ in range(2)]
    grad = torch.randn(2, 2, 700, 8, generator=gen)
    threads = torch.get_num_threads()
    results = []
    try:
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            out = pacs_linear_attention(q, k, v, *temps)
            results.append((out, *torch.autograd.grad(out, (q, k, v, *temps), grad)))
    finally:
        torch.set_num_threads(threads)
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)


def test_fused_pacs_op_hands_overflow_to_the_log_domain(native):
    """Products that overflow float32 (features near its largest value) make the fused forward report
    non-finite values; the op then redoes the call in the log domain, and gives the float64 result."""
    from polaformer.ops import naive_pacs_linear_attention, pacs_linear_attention

    gen = torch.Generator().manual_seed(2)
    q = torch.randn(1, 1, 6, 4, generator=gen)
    q[0, 0, 2, 1] = 89.0  # exp(0.99 · 89) = 2e38 is finite in float32; its products with S are not
    k, v = torch.randn(1, 1, 6, 4, generator=gen), 100 * torch.randn(1, 1, 6, 4, generator=gen)
    t_same, t_opp = torch.full((1, 1, 1, 8), 0.99), torch.full((1, 1, 1, 8), 0.97)
    results, finite = native.pacs_fused_forward(q, k, v, pacs._pacs_stacked_temperatures(t_same, t_opp, 4, False,
                                                                                        q.device))
    assert not finite
    out = pacs_linear_attention(q, k, v, t_same, t_opp)
    ref = naive_pacs_linear_attention(q.double(), k.double(), v.double(), t_same.double(), t_opp.double())
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-5)


def test_fused_pacs_kernels_reject_malformed_inputs(native):
    q = torch.randn(1, 2, 5, 4)
    temps = torch.rand(1, 2, 2, 1, 8)
    with pytest.raises(RuntimeError, match="even value width"):
        native.pacs_fused_forward(q, q, q[..., :3], temps)
    with pytest.raises(RuntimeError, match="batch and heads"):
        native.pacs_fused_forward(q, q[:, :1], q[:, :1], temps)
    with pytest.raises(RuntimeError, match="dtypes differ"):
        native.pacs_fused_forward(q, q.double(), q, temps)


@pytest.mark.parametrize("dtype", [F64, torch.float32])
def test_rotate_pairs_matches_apply_rope_forward_and_backward(native, dtype):
    from polaformer.ops import apply_rope, rotate_pairs

    b, h, side, d = 2, 3, 7, 36  # d: two AVX-512 float64 vectors and a tail
    sin, cos = (t.to(dtype) for t in rope_2d(rope_angles(d * h, h, dtype=F64), side, side))
    x = _x((b, h, side * side, d), dtype=dtype, token_major=True).requires_grad_()  # the layer's strided heads
    out, ref = rotate_pairs(x, sin, cos), apply_rope(x, sin, cos)
    assert out.is_contiguous() and out.grad_fn is not None and "RotatePairs" in type(out.grad_fn).__name__
    tol = dict(rtol=1e-14, atol=1e-15) if dtype == F64 else dict(rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out, ref, **tol)
    grad = torch.randn(out.shape, dtype=dtype).transpose(1, 2).contiguous().transpose(1, 2)  # strided gradient
    torch.testing.assert_close(torch.autograd.grad(out, x, grad)[0], torch.autograd.grad(ref, x, grad)[0], **tol)
    with pytest.raises(RuntimeError, match="even"):
        native.rope_pairs(x.detach()[..., :3], sin[:, :3].contiguous(), cos[:, :3].contiguous())


def test_rotate_pairs_falls_back_where_the_kernel_does_not_apply(native):
    from polaformer.ops import apply_rope, rotate_pairs

    sin, cos = rope_2d(rope_angles(16, 2, dtype=F64), 3, 3)
    x = _x((1, 2, 9, 8))
    trainable = cos.clone().requires_grad_()  # tables that take gradients: the autograd formula
    out = rotate_pairs(x, sin, trainable)
    assert "RotatePairs" not in type(out.grad_fn).__name__
    torch.testing.assert_close(out, apply_rope(x, sin, cos), rtol=0, atol=0)
    graph = torch.fx.symbolic_trace(lambda t: rotate_pairs(t, sin, cos))
    torch.testing.assert_close(graph(x), apply_rope(x, sin, cos), rtol=1e-14, atol=1e-15)

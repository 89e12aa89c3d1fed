"""Baseline efficient attentions as sequence token mixers.

Every class here is an ``nn.Module`` with::

    __init__(dim, num_heads, head_dim, *, max_seq_len=None, dropout=0.0, **options)
    forward(x, key_padding_mask=None) -> Tensor

``x`` is (B, N, dim); ``key_padding_mask`` is (B, N) bool, True at padded
tokens (the convention of ``nn.MultiheadAttention`` and of
:class:`~polaformer.layers.PolaSequenceAttention`). The output is (B, N, dim).
Padded keys never take part in any valid query's output; what a padded *query*
position outputs is unspecified but finite, also for a sequence that is padding
from end to end (it outputs ``ff.bias``). ``max_seq_len`` bounds ``N`` (None: no
bound); only :class:`LinformerAttention`, whose projection spans the positions,
needs it.

They follow the attention wrapper of the Skyformer code base
(``code/models/attention.py``, class ``Attention``), which the PolaFormer paper
used for its baseline rows: ``W_q, W_k, W_v = Linear(dim, heads·head_dim)``, a
core on (B, H, N, head_dim) tensors, then ``ff = Linear(heads·head_dim, dim)``.
As there, the core runs with autocast off and in at least float32
(:class:`QKVAttention`). Each class documents which upstream code its equations
and defaults follow and every place it departs from it.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..ops import elu_feature, focused_feature, full_precision, linear_attention

__all__ = [
    "QKVAttention",
    "SoftmaxAttention",
    "LinearAttention",
    "KernelizedAttention",
    "PerformerAttention",
    "NystromAttention",
    "LinformerAttention",
    "CosformerAttention",
    "SkyformerAttention",
    "FocusedLinearAttention",
    "check_mixer_sizes",
    "check_mixer_inputs",
    "iterative_pinv",
    "orthogonal_gaussian_features",
]


# ----------------------------------------------------------------------------- checks


def _check_int(name: str, value, minimum: int = 1) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        wanted = "a positive int" if minimum == 1 else f"an int >= {minimum}"
        raise ValueError(f"{name} must be {wanted}, got {value!r}")


def _check_odd_kernel(name: str, size: int | None) -> None:
    if size is not None and size != 0 and (not isinstance(size, int) or size < 1 or size % 2 == 0):
        raise ValueError(f"{name} must be an odd positive int (or 0/None for none), got {size!r}")


def check_mixer_sizes(dim: int, num_heads: int, head_dim: int, max_seq_len: int | None) -> None:
    """Raise ``ValueError`` unless the sizes are positive ints (``max_seq_len`` may be None)."""
    for name, value in (("dim", dim), ("num_heads", num_heads), ("head_dim", head_dim)):
        _check_int(name, value)
    if max_seq_len is not None:
        _check_int("max_seq_len", max_seq_len)


def check_mixer_inputs(x: torch.Tensor, key_padding_mask: torch.Tensor | None, dim: int,
                       max_seq_len: int | None) -> None:
    """Raise ``ValueError`` unless ``x`` is (B, N, dim) with ``N <= max_seq_len`` and the mask (B, N) bool."""
    if x.dim() != 3 or x.shape[-1] != dim:
        raise ValueError(f"expected x of shape (B, N, {dim}), got {tuple(x.shape)}")
    if max_seq_len is not None and x.shape[1] > max_seq_len:
        raise ValueError(f"sequence length {x.shape[1]} exceeds max_seq_len {max_seq_len}")
    if key_padding_mask is not None:
        if key_padding_mask.dtype != torch.bool:
            raise ValueError(f"key_padding_mask must be a bool tensor (True = padding), got {key_padding_mask.dtype}")
        if key_padding_mask.shape != x.shape[:2]:
            raise ValueError(
                f"key_padding_mask must be (B, N) = {tuple(x.shape[:2])}, got {tuple(key_padding_mask.shape)}"
            )


# ----------------------------------------------------------------------------- masking


def _keys_for_softmax(padding_mask: torch.Tensor) -> torch.Tensor:
    """(B, 1, 1, N) bool "may attend" mask; a sequence without any valid key may attend to all
    of its (padded) keys, so its rows stay finite instead of becoming 0/0."""
    allowed = ~padding_mask
    allowed = allowed | ~allowed.any(dim=-1, keepdim=True)
    return allowed[:, None, None, :]


def _zero_padded(t: torch.Tensor, padding_mask: torch.Tensor | None) -> torch.Tensor:
    """Zero the padded token rows of a (B, H, N, d) tensor (masked_fill: junk, even inf, is dropped)."""
    if padding_mask is None:
        return t
    return t.masked_fill(padding_mask[:, None, :, None], 0.0)


def _valid_counts(padding_mask: torch.Tensor | None, batch: int, n: int, device) -> torch.Tensor:
    """(B,) long: each sequence's number of valid tokens."""
    if padding_mask is None:
        return torch.full((batch,), n, dtype=torch.long, device=device)
    return (~padding_mask).sum(dim=-1)


# ----------------------------------------------------------------------------- shared math


def iterative_pinv(mat: torch.Tensor, iterations: int = 6) -> torch.Tensor:
    """Nyströmformer's iterative Moore–Penrose pseudo-inverse of a batch of square matrices.

    ``Z₀ = Aᵀ / max_j Σ_i A_ij`` and ``Z ← ¼ Z (13I − AZ(15I − AZ(7I − AZ)))``
    (``iterative_inv`` in Skyformer's ``attention_nystrom.py`` and
    ``attention_skyformer.py``). The initial scale is taken per matrix — the code's
    non-default ``init_option``; its default takes one maximum over the whole batch,
    which lets one sequence change another's result.
    """
    eye = torch.eye(mat.shape[-1], dtype=mat.dtype, device=mat.device)
    z = mat.transpose(-1, -2) / mat.sum(dim=-2).amax(dim=-1)[..., None, None]
    for _ in range(iterations):
        az = mat @ z
        z = (0.25 * z) @ (13 * eye - az @ (15 * eye - az @ (7 * eye - az)))
    return z


def orthogonal_gaussian_features(
    nb_features: int, head_dim: int, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Performer's (nb_features, head_dim) orthogonal random projection.

    Blocks of ``head_dim`` orthonormal rows (QR of a square Gaussian matrix),
    stacked and cut to ``nb_features`` rows, each row then rescaled to the norm of
    an independent Gaussian vector (``gaussian_orthogonal_random_matrix`` with
    ``scaling=0`` in Skyformer's ``performer.py``). Drawn in float64 on the CPU.

    The QR factor's columns are multiplied by the signs of ``diag(R)`` (the
    ``qr_uniform_q=True`` option there, off by default): without it, LAPACK's sign
    convention makes the directions non-uniform and the kernel estimate biased
    (measured here: 10–20 % error on ``exp(q·k)`` that does not shrink with more
    features, against ~2 % for the corrected draw at 65,536 features).
    """
    n_blocks = math.ceil(nb_features / head_dim)
    gauss = torch.randn(n_blocks, head_dim, head_dim, generator=generator, dtype=torch.float64)
    q, r = torch.linalg.qr(gauss)
    q = q * torch.sign(torch.diagonal(r, dim1=-2, dim2=-1))[:, None, :]  # signs fixed: Q is Haar-distributed
    rows = q.transpose(-2, -1).reshape(n_blocks * head_dim, head_dim)[:nb_features]
    norms = torch.randn(nb_features, head_dim, generator=generator, dtype=torch.float64).norm(dim=1)
    return rows * norms[:, None]


# ----------------------------------------------------------------------------- the wrapper


class QKVAttention(nn.Module):
    """Skyformer's attention wrapper around a core (``Attention`` in its ``models/attention.py``).

    ``W_q, W_k, W_v: Linear(dim, heads·head_dim)`` → split into (B, H, N, head_dim)
    → ``core(q, k, v, key_padding_mask)`` → merge heads → ``ff: Linear(heads·head_dim, dim)``.
    The core runs with autocast off, in float32 for half-precision inputs (as the
    original, which calls its cores on ``.float()`` tensors), and in float64 for
    float64 inputs. The core's rows at padded query positions are zeroed before
    ``ff`` (some cores leave large values there, e.g. cosFormer past ``π/2``), so a
    padded position outputs ``ff.bias`` and nothing big reaches a float16 cast.
    Subclasses only build their core; ``core`` is any module with that call.
    """

    def __init__(self, dim: int, num_heads: int, head_dim: int, core: nn.Module, *, max_seq_len: int | None = None):
        super().__init__()
        check_mixer_sizes(dim, num_heads, head_dim, max_seq_len)
        self.dim = dim
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.max_seq_len = max_seq_len
        inner = num_heads * head_dim
        self.W_q = nn.Linear(dim, inner)
        self.W_k = nn.Linear(dim, inner)
        self.W_v = nn.Linear(dim, inner)
        self.core = core
        self.ff = nn.Linear(inner, dim)

    def _split(self, t: torch.Tensor) -> torch.Tensor:
        b, n, _ = t.shape
        return t.reshape(b, n, self.num_heads, self.head_dim).transpose(1, 2)

    def forward(self, x: torch.Tensor, key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        check_mixer_inputs(x, key_padding_mask, self.dim, self.max_seq_len)
        b, n, _ = x.shape
        q, k, v = self._split(self.W_q(x)), self._split(self.W_k(x)), self._split(self.W_v(x))
        dtype = torch.promote_types(q.dtype, torch.float32)
        with full_precision(x.device.type):
            out = self.core(q.to(dtype), k.to(dtype), v.to(dtype), key_padding_mask)
            out = _zero_padded(out, key_padding_mask)
        out = out.to(q.dtype).transpose(1, 2).reshape(b, n, self.num_heads * self.head_dim)
        return self.ff(out)


# ----------------------------------------------------------------------------- cores


class _SoftmaxCore(nn.Module):
    def __init__(self, dropout: float):
        super().__init__()
        self.dropout = dropout

    def forward(self, q, k, v, padding_mask):
        mask = None if padding_mask is None else _keys_for_softmax(padding_mask)
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=self.dropout if self.training else 0.0
        )


class _LinearCore(nn.Module):
    def __init__(self, eps: float = 1e-6):
        super().__init__()
        self.eps = eps

    def forward(self, q, k, v, padding_mask):
        return linear_attention(elu_feature(q), elu_feature(k), v, eps=self.eps, key_padding_mask=padding_mask)


class _KernelizedCore(nn.Module):
    def __init__(self, dropout: float):
        super().__init__()
        self.drop_attn = nn.Dropout(dropout)

    def forward(self, q, k, v, padding_mask):
        c = q.shape[-1] ** -0.25
        q, k = q * c, k * c
        # q·k − |q|²/2 − |k|²/2 = −|q − k|²/2 ≤ 0: exp never overflows, even on junk rows.
        scores = q @ k.transpose(-2, -1) - 0.5 * (q * q).sum(-1, keepdim=True) - 0.5 * (k * k).sum(-1)[..., None, :]
        if padding_mask is not None:
            scores = scores.masked_fill(padding_mask[:, None, None, :], float("-inf"))
        return self.drop_attn(torch.exp(scores)) @ v


class _PerformerCore(nn.Module):
    def __init__(self, head_dim: int, nb_features: int, qk_scale: float | None, seed: int | None,
                 kernel_eps: float = 1e-4):
        super().__init__()
        self.head_dim = head_dim
        self.nb_features = nb_features
        self.qk_scale = head_dim**-0.5 if qk_scale is None else float(qk_scale)
        self.kernel_eps = kernel_eps
        self.register_buffer("projection_matrix", torch.empty(nb_features, head_dim))
        self.redraw_features(seed)

    @torch.no_grad()
    def redraw_features(self, seed: int | None = None) -> None:
        if seed is None:  # a seed from torch's global RNG: torch.manual_seed makes it reproducible
            seed = int(torch.randint(0, 2**62, (1,)).item())
        gen = torch.Generator().manual_seed(seed)
        w = orthogonal_gaussian_features(self.nb_features, self.head_dim, gen)
        self.projection_matrix.copy_(w.to(self.projection_matrix))

    def forward(self, q, k, v, padding_mask):
        c = self.qk_scale**0.5  # data normaliser applied to q and to k
        w = self.projection_matrix.to(q.dtype)
        ratio = self.nb_features**-0.5
        q, k = q * c, k * c
        k = _zero_padded(k, padding_mask)

        q_proj = q @ w.T  # (B, H, N, m)
        q_arg = q_proj - 0.5 * (q * q).sum(-1, keepdim=True) - q_proj.amax(dim=-1, keepdim=True).detach()
        phi_q = ratio * (torch.exp(q_arg) + self.kernel_eps)

        k_proj = k @ w.T
        pad = None if padding_mask is None else padding_mask[:, None, :, None]
        masked = k_proj if pad is None else k_proj.masked_fill(pad, float("-inf"))
        stab = masked.amax(dim=(-2, -1), keepdim=True).detach()  # per sequence and head, valid keys only
        stab = torch.nan_to_num(stab, neginf=0.0)  # a sequence without valid keys
        k_arg = k_proj - 0.5 * (k * k).sum(-1, keepdim=True) - stab
        if pad is not None:
            k_arg = k_arg.masked_fill(pad, float("-inf"))
        phi_k = ratio * (torch.exp(k_arg) + self.kernel_eps)
        if pad is not None:
            phi_k = phi_k.masked_fill(pad, 0.0)

        num = phi_q @ (phi_k.transpose(-2, -1) @ v)
        den = phi_q @ phi_k.sum(dim=-2).unsqueeze(-1)
        return num / den.clamp_min(torch.finfo(den.dtype).tiny)


class _NystromCore(nn.Module):
    def __init__(self, num_heads: int, num_landmarks: int, pinv_iterations: int, conv_kernel_size: int | None):
        super().__init__()
        self.num_landmarks = num_landmarks
        self.pinv_iterations = pinv_iterations
        if conv_kernel_size:
            self.conv = nn.Conv2d(num_heads, num_heads, (conv_kernel_size, 1), padding=(conv_kernel_size // 2, 0),
                                  bias=False, groups=num_heads)
        else:
            self.conv = None

    @staticmethod
    def segment_means(n: int, landmarks: int, dtype: torch.dtype, device) -> torch.Tensor:
        """(landmarks, n) matrix averaging contiguous segments; token j lies in segment ⌊j·L/n⌋."""
        seg = torch.arange(n, device=device) * landmarks // n
        onehot = F.one_hot(seg, landmarks).to(dtype).T
        return onehot / onehot.sum(dim=-1, keepdim=True)

    def forward(self, q, k, v, padding_mask):
        c = q.shape[-1] ** -0.25
        q = _zero_padded(q * c, padding_mask)
        k = _zero_padded(k * c, padding_mask)
        v = _zero_padded(v, padding_mask)
        key_mask = None if padding_mask is None else _keys_for_softmax(padding_mask)
        n = q.shape[-2]
        if n <= self.num_landmarks:  # every token would be a landmark: exact softmax attention
            scores = q @ k.transpose(-2, -1)
            if key_mask is not None:
                scores = scores.masked_fill(~key_mask, float("-inf"))
            out = torch.softmax(scores, dim=-1) @ v
        else:
            avg = self.segment_means(n, self.num_landmarks, q.dtype, q.device)
            q_l, k_l = avg @ q, avg @ k
            kernel_1 = torch.softmax(q @ k_l.transpose(-2, -1), dim=-1)
            kernel_2 = torch.softmax(q_l @ k_l.transpose(-2, -1), dim=-1)
            scores_3 = q_l @ k.transpose(-2, -1)
            if key_mask is not None:
                scores_3 = scores_3.masked_fill(~key_mask, float("-inf"))
            kernel_3 = torch.softmax(scores_3, dim=-1)
            out = (kernel_1 @ iterative_pinv(kernel_2, self.pinv_iterations)) @ (kernel_3 @ v)
        if self.conv is not None:
            out = out + self.conv(v)
        return out


class _LinformerCore(nn.Module):
    def __init__(self, num_heads: int, max_seq_len: int, linformer_k: int, share_kv: bool, learn_projection: bool):
        super().__init__()
        shape = (num_heads, linformer_k, max_seq_len)
        names = ("E",) if share_kv else ("E", "F")
        for name in names:
            t = torch.empty(shape)
            nn.init.normal_(t, std=0.02)
            if learn_projection:
                setattr(self, name, nn.Parameter(t))
            else:
                self.register_buffer(name, t)
        self.share_kv = share_kv

    def forward(self, q, k, v, padding_mask):
        n = q.shape[-2]
        e = self.E[..., :n].to(q.dtype)
        f = e if self.share_kv else self.F[..., :n].to(q.dtype)
        k = e @ _zero_padded(k, padding_mask)  # (B, H, k, d)
        v = f @ _zero_padded(v, padding_mask)
        attn = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=-1)
        return attn @ v


class _CosformerCore(nn.Module):
    def __init__(self, eps: float = 1e-6):
        super().__init__()
        self.eps = eps

    def forward(self, q, k, v, padding_mask):
        b, _, n, _ = q.shape
        q = F.relu(q)
        k = _zero_padded(F.relu(k), padding_mask)
        length = _valid_counts(padding_mask, b, n, q.device)[:, None].clamp_min(1).to(q.dtype)
        index = torch.arange(1, n + 1, dtype=q.dtype, device=q.device)
        angle = (0.5 * math.pi) * index / length  # (B, N): π/2 · i / M, M = this sequence's valid length
        sin, cos = angle.sin()[:, None, :, None], angle.cos()[:, None, :, None]
        q_ = torch.cat([q * sin, q * cos], dim=-1)
        k_ = torch.cat([k * sin, k * cos], dim=-1)
        kv = k_.transpose(-2, -1) @ v
        den = (q_ @ k_.sum(dim=-2).unsqueeze(-1)).clamp_min(self.eps)
        return (q_ @ kv) / den


class _SkyformerCore(nn.Module):
    def __init__(self, nb_features: int, pinv_iterations: int, seed: int, ridge: float = 0.1):
        super().__init__()
        self.nb_features = nb_features
        self.pinv_iterations = pinv_iterations
        self.seed = seed
        self.ridge = ridge

    def landmark_indices(self, valid_counts: torch.Tensor, n: int) -> torch.Tensor:
        """(B, nb_features) indices into ``cat([q, k])`` (length 2n): the first half are queries,
        the second half keys, each drawn uniformly (with replacement) from the sequence's valid
        tokens, with one vector of uniforms shared by the batch as in the original. Training
        draws from torch's global RNG; eval mode from a generator seeded with ``seed``."""
        m = self.nb_features
        if self.training:
            u = torch.rand(m, dtype=torch.float64, device=valid_counts.device)
        else:
            u = torch.rand(m, dtype=torch.float64, generator=torch.Generator().manual_seed(self.seed))
            u = u.to(valid_counts.device)
        counts = valid_counts.to(torch.float64)[:, None]
        idx = torch.floor(u[None, :] * counts).long()
        idx = torch.minimum(idx, (valid_counts[:, None] - 1).clamp_min(0))
        idx[:, m // 2:] += n
        return idx

    def forward(self, q, k, v, padding_mask):
        b, h, n, d = q.shape
        c = d**-0.25
        q = _zero_padded(q * c, padding_mask)
        k = _zero_padded(k * c, padding_mask)
        v = _zero_padded(v, padding_mask)
        idx = self.landmark_indices(_valid_counts(padding_mask, b, n, q.device), n)  # (B, m)
        m = idx.shape[-1]

        x = torch.cat([q, k], dim=2)  # (B, H, 2n, d)
        xs = x.gather(2, idx[:, None, :, None].expand(b, h, m, d))
        sq_x = 0.5 * (x * x).sum(-1, keepdim=True)
        sq_s = 0.5 * (xs * xs).sum(-1)[..., None, :]
        a_s = torch.exp(x @ xs.transpose(-2, -1) - sq_x - sq_s)  # Gaussian kernel vs landmarks (B, H, 2n, m)
        s_a_s = a_s.gather(2, idx[:, None, :, None].expand(b, h, m, m))
        s_a_s = s_a_s + self.ridge * torch.eye(m, dtype=q.dtype, device=q.device)

        d_inv = s_a_s.sum(dim=-1).rsqrt()  # symmetric degree normalisation before the pseudo-inverse
        normed = d_inv[..., :, None] * s_a_s * d_inv[..., None, :]
        inv = iterative_pinv(normed, self.pinv_iterations)
        q_feat = a_s[:, :, :n]
        k_feat = ((a_s[:, :, n:] * d_inv[..., None, :]) @ inv) * d_inv[..., None, :]
        k_feat = _zero_padded(k_feat, padding_mask)
        return q_feat @ (k_feat.transpose(-2, -1) @ v)


class _FocusedCore(nn.Module):
    def __init__(self, num_heads: int, head_dim: int, focusing_factor: float, kernel_size: int | None,
                 eps: float = 1e-6):
        super().__init__()
        self.focusing_factor = focusing_factor
        self.eps = eps
        self.scale = nn.Parameter(torch.zeros(1, num_heads, 1, head_dim))
        if kernel_size:
            self.dwc = nn.Conv1d(head_dim, head_dim, kernel_size, padding=kernel_size // 2, groups=head_dim)
        else:
            self.dwc = None

    def forward(self, q, k, v, padding_mask):
        scale = F.softplus(self.scale).to(q.dtype)
        phi_q = focused_feature(q / scale, self.focusing_factor)
        phi_k = focused_feature(k / scale, self.focusing_factor)
        out = linear_attention(phi_q, phi_k, v, eps=self.eps, key_padding_mask=padding_mask)
        if self.dwc is not None:
            b, h, n, d = v.shape
            local = self.dwc(_zero_padded(v, padding_mask).reshape(b * h, n, d).transpose(1, 2))
            out = out + local.transpose(1, 2).reshape(b, h, n, d)
        return out


# ----------------------------------------------------------------------------- the baselines


class SoftmaxAttention(QKVAttention):
    """Scaled dot-product softmax attention, O(N²) (``SoftmaxAttention`` in Skyformer's ``models/attention.py``).

    ``softmax(q kᵀ/√head_dim)`` with padded keys masked out, through
    ``F.scaled_dot_product_attention``; attention dropout ``dropout`` on the
    weights (Skyformer: ``attention_dropout`` 0.1). A sequence with no valid key
    attends over all of its padded keys (finite, unspecified output).
    Options: none.
    """

    def __init__(self, dim: int, num_heads: int, head_dim: int, *, max_seq_len: int | None = None,
                 dropout: float = 0.0):
        super().__init__(dim, num_heads, head_dim, _SoftmaxCore(dropout), max_seq_len=max_seq_len)


class LinearAttention(QKVAttention):
    """Kernelized linear attention with ``φ = ELU + 1`` (Katharopoulos et al., 2020), O(N).

    ``φq (Σ_j φk_j v_jᵀ / n) / (φq · mean_j φk_j + 1e-6)`` over the ``n`` valid keys, i.e.
    :func:`polaformer.ops.linear_attention` with ``elu_feature``. Katharopoulos adds
    ``eps`` to the unaveraged sum ``φq·Σφk``; the mean form is the same with ``eps``
    scaled by ``n`` (negligible). (The Nyströmformer repository's "linear" baseline,
    ``attention_linear.py``, drops the normaliser altogether and scales q, k by
    ``head_dim^-1/4``; we keep the normalised method of the paper.) No attention
    matrix exists, so ``dropout`` is unused. Options: none.
    """

    def __init__(self, dim: int, num_heads: int, head_dim: int, *, max_seq_len: int | None = None,
                 dropout: float = 0.0):
        super().__init__(dim, num_heads, head_dim, _LinearCore(), max_seq_len=max_seq_len)


class KernelizedAttention(QKVAttention):
    """Gaussian (RBF) kernel attention, O(N²) — Skyformer's "Kernelized" baseline.

    ``SoftmaxAttention_RBF`` in Skyformer's ``models/attention.py``: q and k are
    scaled by ``head_dim^-1/4`` and the weights are
    ``exp(q·k − |q|²/2 − |k|²/2) = exp(−|q − k|²/2)``, *not* row-normalised;
    padded keys get weight 0 (the original subtracts 1e9). Attention dropout
    ``dropout`` on the weights, as there. Options: none.
    """

    def __init__(self, dim: int, num_heads: int, head_dim: int, *, max_seq_len: int | None = None,
                 dropout: float = 0.0):
        super().__init__(dim, num_heads, head_dim, _KernelizedCore(dropout), max_seq_len=max_seq_len)


class PerformerAttention(QKVAttention):
    """Performer, FAVOR+ with positive random features (Choromanski et al., 2021), O(N·m).

    Facts from Skyformer's ``models/attention_performer.py`` and ``models/performer.py``
    (lucidrains' transcription of the JAX reference): Skyformer's config sets
    ``rp_dim = 128`` features and ``kernel_type = "exp"``, which builds
    ``FastAttention`` with ``generalized_attention=False`` — i.e. the softmax kernel
    ``φ(x) = m^-1/2 (exp(Wx − |x|²/2 − stab) + 1e-4)`` on ``x`` scaled by the data
    normaliser; ``W`` is an orthogonal Gaussian matrix (:func:`orthogonal_gaussian_features`,
    ``scaling=0``) drawn once at construction and kept as the buffer
    ``core.projection_matrix`` (no redraws during training, as there); output
    ``φq (φkᵀ v) / (φq · Σ φk)``.

    Stabilisers (``stab``, treated as constants in the backward pass; the original
    lets gradients through them): per query the maximum of its own projections (as
    in the original; it cancels in the ratio up to the ``1e-4`` term); for keys the
    maximum over the valid keys of
    the same sequence and head — the original takes one maximum over the whole
    batch tensor, padded keys included, which couples the sequences of a batch
    and breaks padding invariance. Padded keys get zero features (the original
    only zeroes k, whose feature is still ``m^-1/2(exp(−stab) + 1e-4) ≠ 0``, plus v).
    The orthogonal blocks get the QR sign fix (Haar-distributed directions), which
    the original leaves off by default; without it the estimate stays biased
    however many features are drawn.

    Options:
        nb_features: random features ``m`` (Skyformer's config: ``rp_dim`` 128).
        qk_scale: the softmax temperature that the kernel estimates, ``exp(q·k·qk_scale)``;
            None means ``head_dim^-1/2``, the one of :class:`SoftmaxAttention`. Skyformer's
            wrapper divides q and k by ``head_dim^1/4`` *and* ``softmax_kernel`` applies
            the data normaliser again, so its runs estimated ``exp(q·k/head_dim)``; pass
            ``qk_scale=1/head_dim`` to reproduce that.
        seed: seed of the generator for ``W``; None takes one from torch's global RNG
            (reproducible under ``torch.manual_seed``; layers get different features).
    ``dropout`` is unused (no attention matrix; the original has none either).
    """

    def __init__(self, dim: int, num_heads: int, head_dim: int, *, max_seq_len: int | None = None, dropout: float = 0.0,
                 nb_features: int = 128, qk_scale: float | None = None, seed: int | None = None):
        _check_int("nb_features", nb_features)
        core = _PerformerCore(head_dim, nb_features, qk_scale, seed)
        super().__init__(dim, num_heads, head_dim, core, max_seq_len=max_seq_len)

    def redraw_features(self, seed: int | None = None) -> None:
        """Draw a new random projection (seed None: from torch's global RNG)."""
        self.core.redraw_features(seed)


class NystromAttention(QKVAttention):
    """Nyströmformer (Xiong et al., 2021), O(N·L).

    As ``NystromAttention`` in Skyformer's ``models/attention_nystrom.py`` (the same
    file as mlpen/Nystromformer ``attention_nystrom.py``): q, k scaled by
    ``head_dim^-1/4`` and zeroed at padding; landmarks are means of contiguous
    segments of the (padded) sequence; ``softmax(q k̃ᵀ) · pinv(softmax(q̃ k̃ᵀ)) ·
    softmax(q̃ kᵀ − mask) v`` with the 6-step iterative pseudo-inverse
    (:func:`iterative_pinv`); only the third kernel masks padded keys, as there
    (the first two see the landmarks, which padding enters as zeros). No attention
    dropout, as there.

    Differences from the original: segments may differ in size by one token when
    ``N`` is not a multiple of ``num_landmarks`` (the original requires
    ``N = max_seq_len`` divisible); whenever ``N <= num_landmarks`` the layer
    computes exact softmax attention (the original only does so for
    ``num_landmarks == max_seq_len``); padded values are zeroed too; the pseudo-inverse
    scales its start per matrix, not by one batch-wide maximum.

    Padding: the result depends on the padded length. Landmarks average fixed
    stretches of the padded sequence, so padding changes which tokens share a
    landmark and dilutes the means with zeros; a sequence padded to a different
    length gets a different (approximate) output. Padded contents never matter:
    junk and zeros at the same padded length give the same valid outputs.

    Options:
        num_landmarks: L (Skyformer's config: 128).
        pinv_iterations: iterations of the pseudo-inverse (6 in both codes).
        conv_kernel_size: depthwise conv along the sequence on v, added to the
            output; None (default) as in Skyformer's config. The Nyströmformer
            repository's own config uses 35.
    """

    def __init__(self, dim: int, num_heads: int, head_dim: int, *, max_seq_len: int | None = None, dropout: float = 0.0,
                 num_landmarks: int = 128, pinv_iterations: int = 6, conv_kernel_size: int | None = None):
        _check_int("num_landmarks", num_landmarks)
        _check_odd_kernel("conv_kernel_size", conv_kernel_size)
        core = _NystromCore(num_heads, num_landmarks, pinv_iterations, conv_kernel_size)
        super().__init__(dim, num_heads, head_dim, core, max_seq_len=max_seq_len)


class LinformerAttention(QKVAttention):
    """Linformer (Wang et al., 2020), O(N·k).

    ``LinformerAttention`` in Skyformer's ``models/attention_linformer.py``: one
    projection ``E`` of shape (heads, k, max_seq_len), N(0, 0.02²), applied over the
    sequence axis to the keys *and* the values (zeroed at padding first), then
    ``softmax(q (E k)ᵀ/√head_dim) (E v)``; no attention dropout. Shorter inputs use
    ``E[..., :N]``.

    Padding: because padded keys and values are zero before the projection and the
    columns of ``E`` are tied to absolute positions, a right-padded sequence gets
    exactly its unpadded output (the zero columns add nothing) — unlike a Linformer
    that pads every input to ``max_seq_len`` with non-zero tokens.

    ``max_seq_len`` is required here: it is the length of ``E``.

    Options:
        linformer_k: projected length k (Skyformer's config: 128).
        share_kv: one ``E`` for keys and values (True, as Skyformer), or a second ``F``.
        learn_projection: ``E`` (and ``F``) are trained parameters (True, as in the
            Linformer paper). In Skyformer's code ``nn.Parameter(...).to(device)``
            yields a plain tensor, so its runs kept ``E`` at its random init; pass
            False for that (a buffer).
    """

    def __init__(self, dim: int, num_heads: int, head_dim: int, *, max_seq_len: int, dropout: float = 0.0,
                 linformer_k: int = 128, share_kv: bool = True, learn_projection: bool = True):
        _check_int("max_seq_len", max_seq_len)
        _check_int("linformer_k", linformer_k)
        core = _LinformerCore(num_heads, max_seq_len, linformer_k, share_kv, learn_projection)
        super().__init__(dim, num_heads, head_dim, core, max_seq_len=max_seq_len)


class CosformerAttention(QKVAttention):
    """cosFormer (Qin et al., 2022), non-causal, O(N).

    As OpenNLPLab/cosFormer ``cosformer.py``: ReLU features, re-weighted by position
    ``i = 1..N`` with ``[x·sin(π/2·i/M) ; x·cos(π/2·i/M)]`` so that
    ``φq_i·φk_j = relu(q_i)·relu(k_j)·cos(π/2·(i − j)/M)``; output
    ``φq (φkᵀ v) / max(φq · Σ φk, 1e-6)``. The original takes ``M`` = the padded
    length; here ``M`` is each sequence's number of valid tokens and padded keys get
    zero features, so a right-padded sequence gets exactly its unpadded output.
    No attention matrix, so ``dropout`` is unused (the original stores but never
    applies its dropout rate). Options: none.
    """

    def __init__(self, dim: int, num_heads: int, head_dim: int, *, max_seq_len: int | None = None,
                 dropout: float = 0.0):
        super().__init__(dim, num_heads, head_dim, _CosformerCore(), max_seq_len=max_seq_len)


class SkyformerAttention(QKVAttention):
    """Skyformer (Chen et al., 2021): Nyström approximation of the Gaussian kernel, O(N·m).

    As ``Skyformer`` in its ``models/attention_skyformer.py`` with its benchmark config
    (``nb_features`` 128, ``sketched_kernel = kernel_RS_RBF``, ``accumulation`` 1,
    random signs all 1): q, k scaled by ``head_dim^-1/4`` (the original hard-codes
    ``32^-1/4``, equal for head_dim 32) and zeroed at padding, v zeroed at padding.
    ``m`` landmarks are drawn uniformly from the valid tokens — the first ``m/2``
    among the queries, the rest among the keys — and with ``X = [q; k]``,
    ``A_S = exp(X Sᵀ − |X|²/2 − |S|²/2)`` (2N × m). ``SᵀAS = A_S[landmarks] + 0.1·I``
    is normalised symmetrically by its row sums ``D``, inverted with the 6-step
    iterative pseudo-inverse, and the output is
    ``A_S[queries] · (D·pinv(D SᵀAS D)·D · A_S[keys]ᵀ) v`` — an unnormalised
    Gaussian kernel attention like :class:`KernelizedAttention`. No dropout, as there.

    Sampling: one vector of uniforms per forward, shared by the batch and scaled by
    each sequence's valid length (as the original). In training mode it comes from
    torch's global RNG (as the original, which samples in eval too); in eval mode
    from a generator seeded with ``seed``, so evaluation is deterministic — a
    deviation. The pseudo-inverse starts from a per-matrix scale (see
    :func:`iterative_pinv`). Only ``accumulation = 1`` and all-one signs (the
    config) are implemented.

    Padding: landmarks are drawn among valid tokens only and padded keys/values
    are zero, so with the same draw a right-padded sequence gets exactly its
    unpadded output (in eval mode the draw is the same).

    Options:
        nb_features: landmarks m (Skyformer's config: 128).
        pinv_iterations: iterations of the pseudo-inverse (6 in the original).
        seed: seed of the eval-mode landmark draw.
    """

    def __init__(self, dim: int, num_heads: int, head_dim: int, *, max_seq_len: int | None = None, dropout: float = 0.0,
                 nb_features: int = 128, pinv_iterations: int = 6, seed: int = 0):
        _check_int("nb_features", nb_features, minimum=2)
        core = _SkyformerCore(nb_features, pinv_iterations, seed)
        super().__init__(dim, num_heads, head_dim, core, max_seq_len=max_seq_len)


class FocusedLinearAttention(QKVAttention):
    """FLatten Transformer's focused linear attention (Han et al., 2023), O(N).

    From LeapLabTHU/FLatten-Transformer (``models/flatten_pvt.py``,
    ``FocusedLinearAttention``): a learnable per-head, per-channel temperature
    ``s = softplus(scale)`` (init 0) divides q and k, the focused map
    :func:`polaformer.ops.focused_feature` (``relu(x)^p`` rescaled to the norm of
    ``relu(x)``, ``p = focusing_factor = 3``) makes the features, normalised as
    :func:`polaformer.ops.linear_attention` (``φq(φkᵀv/n)/(φq·mean φk + 1e-6)``),
    and a depthwise conv on v (FLatten's DWC, kernel 5, ``head_dim`` channels shared
    by the heads) is added. FLatten's DWC is 2-D over the image grid; here it is 1-D
    along the sequence, with padded values zeroed so that it sees the same zeros as
    its own zero padding (the output stays padding invariant).

    Differences: FLatten adds ``1e-6`` to ``relu(x)`` before dividing by ``s``,
    ``focused_feature`` after (negligible); FLatten's learnable positional encoding
    on the keys is left out (a sequence model brings its own positions).
    No attention matrix, so ``dropout`` is unused.

    Options:
        focusing_factor: p (FLatten default 3).
        kernel_size: DWC kernel (FLatten default 5); 0 or None for no DWC.
    """

    def __init__(self, dim: int, num_heads: int, head_dim: int, *, max_seq_len: int | None = None, dropout: float = 0.0,
                 focusing_factor: float = 3.0, kernel_size: int | None = 5):
        _check_odd_kernel("kernel_size", kernel_size)
        core = _FocusedCore(num_heads, head_dim, focusing_factor, kernel_size)
        super().__init__(dim, num_heads, head_dim, core, max_seq_len=max_seq_len)

"""The causal ops' torch forms over given features, autograd deriving the gradients: chunked-parallel (training:
inside a chunk the masked products ``tril(φq φkᵀ) v``, across chunks a running state ``S = Σ φkᵀv`` and key sum)
and recurrent (generation: one token at a time, carrying :class:`CausalState`)."""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F


class CausalState(NamedTuple):
    """What the recurrent form carries between tokens, per sequence and head.

    ``kv``: one ``Σ k_numᵀ v`` per stream, (B, H, F, dv_s); ``key_sum``: ``Σ φk`` (B, H, F); ``count``: the
    number of valid keys seen, (B, 1, 1) float.
    """

    kv: tuple[torch.Tensor, ...]
    key_sum: torch.Tensor
    count: torch.Tensor


class Stream(NamedTuple):
    phi_q: torch.Tensor  # (B, H, N, F) normaliser features
    q_num: torch.Tensor  # (B, H, N, F) numerator features (RoPE-rotated for PaCS)
    v: torch.Tensor  # (B, H, N, dv_s) this stream's value channels
    eps: torch.Tensor | float  # a number or per-row (B, H, N, 1)


def _empty_state(phi_k, k_num, streams) -> CausalState:
    b, h, _, f = phi_k.shape
    kv = tuple(phi_k.new_zeros(b, h, k_num.shape[-1], s.v.shape[-1]) for s in streams)
    return CausalState(kv, phi_k.new_zeros(b, h, f), phi_k.new_zeros(b, 1, 1))


def _split_chunks(x: torch.Tensor, c: int) -> torch.Tensor:
    """(B, H, N, X) -> (B, H, ceil(N / C), C, X), zero rows appended."""
    n = x.shape[-2]
    chunks = -(-n // c)
    return F.pad(x, (0, 0, 0, chunks * c - n)).reshape(*x.shape[:2], chunks, c, x.shape[-1])


def _chunked_numerator(q_num, k_num, v, kv0, chunk_size):
    """``(num, kv)``: ``num_t = q_num_t·kv0 + Σ_{s≤t} (q_num_t·k_num_s) v_s`` and ``kv = kv0 + Σ k_numᵀv``, in
    chunks of ``chunk_size`` tokens."""
    b, h, n, _ = k_num.shape
    c = min(chunk_size, n)
    qn, kn, vv = _split_chunks(q_num, c), _split_chunks(k_num, c), _split_chunks(v, c)
    chunk_kv = kn.transpose(-2, -1) @ vv  # (B, H, chunks, F, dv)
    kv_before = torch.cat([kv0[:, :, None], chunk_kv[:, :, :-1]], dim=2).cumsum(dim=2)
    causal_mask = torch.ones(c, c, dtype=torch.bool, device=k_num.device).tril()
    scores = (qn @ kn.transpose(-2, -1)).masked_fill(~causal_mask, 0.0)
    num = (qn @ kv_before + scores @ vv).reshape(b, h, -1, v.shape[-1])[:, :, :n]
    return num, kv_before[:, :, -1] + chunk_kv[:, :, -1]


def _chunked(streams, phi_k, k_num, keep, chunk_size, state):
    """The chunked-parallel form in torch for every stream over shared key features; returns (outputs, final
    state)."""
    b, h, n, f = phi_k.shape
    state = _empty_state(phi_k, k_num, streams) if state is None else state
    if keep is not None:
        phi_k, k_num = phi_k * keep, k_num * keep
        count = state.count[..., None] + keep.cumsum(dim=-2)  # (B, 1, N, 1)
    else:
        count = state.count[..., None] + torch.arange(1, n + 1, device=phi_k.device, dtype=phi_k.dtype)[:, None]
    c = min(chunk_size, n)
    # key sums up to each token: the previous chunks' total plus the running sum inside the chunk
    key_sum_in_chunk = _split_chunks(phi_k, c).cumsum(dim=-2)
    chunk_totals = key_sum_in_chunk[..., -1, :]
    key_sum_before = torch.cat([state.key_sum[:, :, None], chunk_totals[:, :, :-1]], dim=2).cumsum(dim=2)
    key_sum = key_sum_in_chunk + key_sum_before[..., None, :]
    outputs, final_kv = [], []
    for stream, kv0 in zip(streams, state.kv):
        num, kv = _chunked_numerator(stream.q_num, k_num, stream.v, kv0, chunk_size)
        den = (_split_chunks(stream.phi_q, c) * key_sum).sum(dim=-1, keepdim=True).reshape(b, h, -1, 1)[:, :, :n]
        outputs.append(num / (den + stream.eps * count.clamp_min(1.0)))
        final_kv.append(kv)
    return outputs, CausalState(tuple(final_kv), key_sum[:, :, -1, -1], count[:, :, -1])


def _recurrent(streams, phi_k, k_num, keep, state):
    """The recurrent form, one token at a time; returns (outputs, final state)."""
    state = _empty_state(phi_k, k_num, streams) if state is None else state
    kv, key_sum, count = list(state.kv), state.key_sum, state.count
    outputs = [[] for _ in streams]
    for t in range(phi_k.shape[-2]):
        pk, kn = phi_k[:, :, t], k_num[:, :, t]  # (B, H, F)
        if keep is not None:
            pk, kn = pk * keep[:, :, t], kn * keep[:, :, t]
            count = count + keep[:, :, t]
        else:
            count = count + 1
        key_sum = key_sum + pk
        for s, stream in enumerate(streams):
            kv[s] = kv[s] + kn[..., :, None] * stream.v[:, :, t, None, :]
            num = (stream.q_num[:, :, t, None, :] @ kv[s])[:, :, 0]
            den = (stream.phi_q[:, :, t] * key_sum).sum(dim=-1, keepdim=True)
            eps = stream.eps if isinstance(stream.eps, float) else stream.eps[:, :, t]
            outputs[s].append(num / (den + eps * count.clamp_min(1.0)))
    return [torch.stack(o, dim=2) for o in outputs], CausalState(tuple(kv), key_sum, count)


def torch_form(form, streams, phi_k, k_num, keep, chunk_size, state):
    """:func:`_chunked` or :func:`_recurrent`, as ``form`` names it; returns (outputs, final state)."""
    if form == "chunked":
        return _chunked(streams, phi_k, k_num, keep, chunk_size, state)
    return _recurrent(streams, phi_k, k_num, keep, state)

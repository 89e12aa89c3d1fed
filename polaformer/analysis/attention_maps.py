"""``polaformer analyze``: attention maps, positive-sequence entropy, gate correlation, Theorem 1.

Everything is computed from the queries/keys of a real :class:`~polaformer.layers.PolaLinearAttention`
layer applied to an image's patch tokens. The attention weights come from the explicit references
in :mod:`polaformer.ops` (``softmax_attention_weights``, ``linear_attention_weights``,
``pola_attention_weights``, ``pacs_attention_weights``), but only for the query rows needed: one row
for the maps, at most ``max_rows`` sampled rows for the entropies. No N×N matrix is built unless
N ≤ ``max_rows``, except by the rank of each layer's token mixing (:mod:`.rank`), which runs only on
layers of at most 256 tokens.

Positive-sequence entropy (paper Eq. 7): for a row ``x`` of non-negative weights with sum ``s``,
``PSE(x) = -Σ x_i/s · log(x_i/s)`` (``0 log 0 = 0``).
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ..engine.output import claim_outputs, write_output
from ..files import read_image_or_raise
from ..limits import check_allocation
from ..ops import (
    elu_feature,
    focused_feature,
    learnable_power,
    linear_attention_weights,
    pacs_attention_weights,
    pola_attention_weights,
    relu_feature,
    softmax_attention_weights,
)
from .rank import layer_ranks

__all__ = [
    "AnalyzeError",
    "LayerFeatures",
    "analyze",
    "capture_layer_features",
    "layer_features",
    "load_image",
    "positive_sequence_entropy",
    "power_entropy",
    "row_entropies",
    "sample_rows",
]

DEFAULT_MODEL = "pola_pvt_tiny"
DEFAULT_MAX_ROWS = 256
FOCUSING_FACTOR = 3.0  # FLatten's focused map
PACS_TEMPERATURE = 1.0  # exp(s·x) − 1 with s = 1
ENTROPY_TOL = 1e-6  # a row "drops" when its PSE is lower by more than this (nats)

# The maps drawn and measured; the same list orders the figure panels.
MAPS = ("softmax", "elu+1", "focused (p=3)", "pola same-sign", "pola opposite-sign")


OUTPUT_FILES = ("attention_maps.png", "entropy.png", "gates.png", "rank.png", "analysis.json")


class AnalyzeError(ValueError):
    """A user error of ``polaformer analyze`` (bad image, query outside the grid, no Pola layer)."""


# ---------------------------------------------------------------------------------------------
# Entropy


def positive_sequence_entropy(weights: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """PSE of each row of non-negative ``weights`` along ``dim`` (NaN for rows summing to 0)."""
    weights = weights.double()
    total = weights.sum(dim=dim, keepdim=True)
    p = weights / total
    h = -torch.special.xlogy(p, p).sum(dim=dim)
    return torch.where(total.squeeze(dim) > 0, h, torch.full_like(h, float("nan")))


def power_entropy(a: np.ndarray, p: float) -> float:
    """Entropy of ``a^p / Σ a^p`` for a positive sequence ``a``, computed stably in log space."""
    logits = p * np.log(np.asarray(a, dtype=np.float64))
    logits -= logits.max()
    w = np.exp(logits)
    w /= w.sum()
    nz = w > 0
    return float(-(w[nz] * np.log(w[nz])).sum())


# ---------------------------------------------------------------------------------------------
# Features of a layer


@dataclass
class LayerFeatures:
    """Scaled queries/keys of one PolaLinearAttention layer, as its forward computes them."""

    name: str
    q: torch.Tensor  # (1, H, N, d)
    k: torch.Tensor  # (1, H, M, d)
    g: torch.Tensor | None  # (1, N, C) gate; None without polarity coefficients
    power: torch.Tensor  # (1, H, 1, d)
    grid: tuple[int, int]  # query token grid (after the prefix tokens)
    key_grid: tuple[int, int]
    prefix: int  # leading non-patch tokens (class token)
    v: torch.Tensor  # (1, H, M, d) values
    polarity: bool  # False: one stream of relu(q)ᵖ·relu(k)ᵖ (paper Table 3 ablation)
    local_kind: str  # the layer's `local` switch: dwc, dcn or none
    local: torch.nn.Module | None  # that branch's module, None for none


def _pola_layers(model: torch.nn.Module):
    from ..layers import PolaLinearAttention

    return [(name, m) for name, m in model.named_modules() if isinstance(m, PolaLinearAttention)]


def layer_features(layer: torch.nn.Module, x: torch.Tensor, height: int, width: int, name: str = "") -> LayerFeatures:
    """q/k/v/g and power of one PolaLinearAttention ``layer`` on its input tokens ``x`` (B, N, C), as its forward
    computes them, in their dtype (with gradients where enabled)."""
    q, k, v, g = layer._project(x, height, width)
    b, n, c = x.shape
    n_kv = k.shape[1]
    key_grid = (height // layer.sr_ratio, width // layer.sr_ratio)
    if layer.positional_encoding is not None:
        k = k + layer._key_positions(key_grid)
    scale = F.softplus(layer.scale)
    heads = layer.num_heads
    q = (q / scale).reshape(b, n, heads, -1).transpose(1, 2)
    k = (k / scale).reshape(b, n_kv, heads, -1).transpose(1, 2)
    power = learnable_power(layer.power, layer.alpha)
    v = v.reshape(b, n_kv, heads, -1).transpose(1, 2)
    local = getattr(layer, layer.local, None) if layer.local != "none" else None
    return LayerFeatures(name, q, k, g, power, (height, width), key_grid, layer.num_prefix_tokens, v, layer.polarity,
                         layer.local, local)


@torch.no_grad()
def capture_layer_features(model: torch.nn.Module, image: torch.Tensor) -> list[LayerFeatures]:
    """Run ``model`` on ``image`` (1, C, H, W) and return q/k/g of every PolaLinearAttention layer."""
    layers = _pola_layers(model)
    if not layers:
        raise AnalyzeError(f"model {type(model).__name__} has no PolaLinearAttention layer to analyse")
    captured: dict[str, LayerFeatures] = {}

    def hook(name):
        def fn(layer, args, kwargs):
            x, height, width = (list(args) + [kwargs.get("height"), kwargs.get("width")])[:3]
            if x is None:
                x = kwargs["x"]
            f = layer_features(layer, x, height, width, name)
            captured[name] = dataclasses.replace(f, q=f.q.float(), k=f.k.float(), power=f.power.float(),
                                                 g=None if f.g is None else f.g.float(), v=f.v.float())
        return fn

    handles = [m.register_forward_pre_hook(hook(name), with_kwargs=True) for name, m in layers]
    try:
        model.eval()
        model(image)
    finally:
        for h in handles:
            h.remove()
    return [captured[name] for name, _ in layers if name in captured]


# ---------------------------------------------------------------------------------------------
# Weights of selected rows


def sample_rows(n: int, max_rows: int, seed: int = 0) -> torch.Tensor:
    """At most ``max_rows`` sorted row indices out of ``n`` (all of them when n ≤ max_rows)."""
    if n <= max_rows:
        return torch.arange(n)
    gen = torch.Generator().manual_seed(seed)
    return torch.randperm(n, generator=gen)[:max_rows].sort().values


def row_weights(feat: LayerFeatures, rows: torch.Tensor, head: int, fixed_power: float | None = None) -> dict:
    """Explicit weights (len(rows), M) of every map for one head; only ``rows`` of the queries."""
    q = feat.q[:, head:head + 1, rows]  # (1, 1, R, d)
    k = feat.k[:, head:head + 1]
    power = feat.power[:, head:head + 1]
    if fixed_power is not None:
        power = torch.full_like(power, fixed_power)
    out = {"softmax": softmax_attention_weights(q, k)}
    out["elu+1"] = linear_attention_weights(elu_feature(q), elu_feature(k))
    out["relu"] = linear_attention_weights(relu_feature(q), relu_feature(k))
    out["focused (p=3)"] = linear_attention_weights(focused_feature(q, FOCUSING_FACTOR),
                                                    focused_feature(k, FOCUSING_FACTOR))
    same, opposite = pola_attention_weights(q, k, power)
    out["pola same-sign"], out["pola opposite-sign"] = same, opposite
    out["pola p=3 same-sign"] = pola_attention_weights(q, k, torch.full_like(power, 3.0))[0]
    out["polarity p=1 same-sign"] = pola_attention_weights(q, k, torch.ones_like(power))[0]
    temp = q.new_full((2 * q.shape[-1],), PACS_TEMPERATURE)
    out["pacs same-sign (s=1)"] = pacs_attention_weights(q, k, temp, temp)[0]
    return {name: w[0, 0] for name, w in out.items()}


def row_entropies(feat: LayerFeatures, max_rows: int = DEFAULT_MAX_ROWS, seed: int = 0) -> dict[str, np.ndarray]:
    """PSE of ≤ ``max_rows`` sampled query rows of every head, per map (rows of all heads pooled)."""
    rows = sample_rows(feat.q.shape[2], max_rows, seed)
    result: dict[str, list] = {}
    for head in range(feat.q.shape[1]):
        for name, w in row_weights(feat, rows, head).items():
            result.setdefault(name, []).append(positive_sequence_entropy(w).numpy())
    return {name: np.concatenate(v) for name, v in result.items()}


# Theorem 1 comparisons: (candidate, baseline) pairs; "drops" = candidate PSE < baseline PSE.
COMPARISONS = (
    ("pola same-sign", "relu"), ("pola same-sign", "elu+1"),
    ("pola p=3 same-sign", "relu"), ("pola p=3 same-sign", "elu+1"),
    ("pacs same-sign (s=1)", "relu"), ("pacs same-sign (s=1)", "elu+1"),
    ("pola same-sign", "polarity p=1 same-sign"), ("pola p=3 same-sign", "polarity p=1 same-sign"),
    ("pacs same-sign (s=1)", "polarity p=1 same-sign"),
)


def theorem1_fractions(entropies: dict[str, np.ndarray]) -> dict[str, dict]:
    """For each comparison: rows compared, fraction whose PSE drops, fraction whose PSE rises."""
    out = {}
    for cand, base in COMPARISONS:
        a, b = entropies[cand], entropies[base]
        ok = np.isfinite(a) & np.isfinite(b)
        n = int(ok.sum())
        drop = int((a[ok] < b[ok] - ENTROPY_TOL).sum())
        rise = int((a[ok] > b[ok] + ENTROPY_TOL).sum())
        out[f"{cand} vs {base}"] = {
            "rows": n, "undefined_rows": int((~ok).sum()),
            "fraction_drop": drop / n if n else None, "fraction_rise": rise / n if n else None,
            "mean_pse": float(np.mean(a[ok])) if n else None, "mean_pse_baseline": float(np.mean(b[ok])) if n else None,
        }
    return out


# ---------------------------------------------------------------------------------------------
# Image and model


def load_image(path: str | None, size: int, channels: int) -> np.ndarray:
    """(size, size, 3) float image in [0, 1]: the file at ``path`` or scikit-image's astronaut,
    centre-cropped to a square and resized; grey images are expanded to 3 channels."""
    from PIL import Image

    if path is None:
        from skimage import data

        pil = Image.fromarray(data.astronaut())
    else:
        pil = read_image_or_raise(path, AnalyzeError)
    pil = pil.convert("RGB")
    w, h = pil.size
    side = min(w, h)
    pil = pil.crop(((w - side) // 2, (h - side) // 2, (w - side) // 2 + side, (h - side) // 2 + side))
    pil = pil.resize((size, size), Image.BICUBIC)
    return np.asarray(pil, dtype=np.float32) / 255.0


def image_tensor(rgb: np.ndarray, arch: str, model: torch.nn.Module) -> torch.Tensor:
    """Normalise the image the way the model was trained to see it."""
    cfg = getattr(model, "pretrained_cfg", {}) or {}
    in_chans = cfg.get("input_size", (3,))[0]
    if in_chans == 1:
        grey = rgb @ np.array([0.299, 0.587, 0.114], dtype=np.float32)
        x = torch.from_numpy(grey)[None, None]
        if "digits" in arch:  # the digits data: raw values 0..16, normalised with train statistics
            from ..data.digits import digits_split

            x_train = digits_split()[0]
            return (x * 16 - float(x_train.mean())) / float(x_train.std())
        mean, std = cfg.get("mean", (0.0,)), cfg.get("std", (1.0,))
        return (x - mean[0]) / std[0]
    x = torch.from_numpy(rgb).permute(2, 0, 1)[None]
    mean = torch.tensor(cfg.get("mean", (0.485, 0.456, 0.406))).view(1, -1, 1, 1)
    std = torch.tensor(cfg.get("std", (0.229, 0.224, 0.225))).view(1, -1, 1, 1)
    return (x - mean) / std


def build_model(name: str, checkpoint: str | None, model_kwargs: dict | None = None):
    """``(model, arch, trained)``; a training checkpoint (with 'arch') rebuilds its own model, switches
    included; otherwise ``model_kwargs`` (e.g. the Table 3 switches) go to the model."""
    import timm

    from .. import load_checkpoint, models  # noqa: F401  (registers the models)
    from ..checkpoint import read_checkpoint
    from ..engine.factory import create_model_from_checkpoint

    if checkpoint is not None:
        ckpt = read_checkpoint(Path(checkpoint), "cpu")
        if isinstance(ckpt, dict) and "arch" in ckpt and "model" in ckpt and "num_classes" in ckpt:
            model = create_model_from_checkpoint({"model_kwargs": {}, **ckpt}, checkpoint,
                                                 arch=name if name != DEFAULT_MODEL else None)
            return model, ckpt["arch"], True
    if not timm.is_model(name):
        raise AnalyzeError(f"unknown model {name!r} (not registered with timm)")
    try:
        model = timm.create_model(name, pretrained=False, **(model_kwargs or {}))
    except (TypeError, ValueError, AssertionError) as e:
        raise AnalyzeError(f"cannot build model {name!r}: {e}") from None
    if checkpoint is not None:
        load_checkpoint(model, checkpoint)
    return model, name, checkpoint is not None


def digits_theorem1(model: torch.nn.Module, max_rows: int, images: int = 64) -> dict:
    """Theorem 1 fractions on the digits test split (every row of every layer of ``images`` digits)."""
    from ..data.digits import digits_datasets

    test = digits_datasets(augment=False)[1]
    pooled: dict[str, list] = {}
    for i in range(min(images, len(test))):
        for f in capture_layer_features(model, test[i][0][None]):
            for name, v in row_entropies(f, max_rows).items():
                pooled.setdefault(name, []).append(v)
    return {"images": min(images, len(test)),
            "fractions": theorem1_fractions({k: np.concatenate(v) for k, v in pooled.items()})}


# ---------------------------------------------------------------------------------------------
# Figures


def _plot_maps(path, rgb, feat, query, weights, title, dpi):
    from matplotlib.figure import Figure  # no pyplot: no GUI backend, no global state

    gh, gw = feat.key_grid
    fig = Figure(figsize=(7.5, 5.6))
    axes = fig.subplots(2, 3)
    axes = axes.ravel()
    qh, qw = feat.grid
    size = rgb.shape[0]
    cy, cx = (query[0] + 0.5) * size / qh, (query[1] + 0.5) * size / qw
    axes[0].imshow(rgb)
    axes[0].plot([cx], [cy], marker="*", color="red", markersize=14, markeredgecolor="white")
    axes[0].set_title(f"image, query patch ({query[0]}, {query[1]})", fontsize=9)
    for ax, name in zip(axes[1:], MAPS):
        w = weights[name][feat.prefix:].reshape(gh, gw).numpy()
        ax.imshow(rgb)
        ax.imshow(w, cmap="jet", alpha=0.55, extent=(0, size, size, 0), interpolation="bilinear")
        ax.plot([cx], [cy], marker="*", color="white", markersize=10)
        ax.set_title(name, fontsize=9)
    for ax in axes:
        ax.axis("off")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    write_output(path, lambda f: fig.savefig(f, format="png", dpi=dpi))


def _plot_entropy(path, entropies, n_keys, title, dpi):
    from matplotlib.figure import Figure  # no pyplot: no GUI backend, no global state

    fig = Figure(figsize=(8, 4))
    ax = fig.subplots()
    data = [entropies[name][np.isfinite(entropies[name])] for name in MAPS]
    ax.violinplot([d if len(d) else [np.nan] for d in data], showmedians=True)
    ax.axhline(math.log(n_keys), color="grey", ls="--", lw=1, label=f"log N = {math.log(n_keys):.2f} (uniform)")
    ax.set_xticks(range(1, len(MAPS) + 1), MAPS, fontsize=8)
    ax.set_ylabel("positive-sequence entropy (nats)")
    ax.legend(fontsize=8, loc="lower left")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    write_output(path, lambda f: fig.savefig(f, format="png", dpi=dpi))


def gate_halves(feat: LayerFeatures, head_dim: int) -> tuple[np.ndarray, np.ndarray]:
    """Gate values multiplying the same-sign and the opposite-sign stream, paired channel by channel.

    Per head, the attention output is ``[same-sign stream ; opposite-sign stream]`` (the two
    halves of ``head_dim``), and the gate ``g`` multiplies it channel by channel.
    """
    g = feat.g[0, feat.prefix:]  # (N, C)
    g = g.reshape(g.shape[0], -1, 2, head_dim // 2)
    return g[:, :, 0].reshape(-1).numpy(), g[:, :, 1].reshape(-1).numpy()


def _pearson(a, b) -> float:
    if len(a) < 2 or np.std(a) == 0 or np.std(b) == 0:
        return float("nan")
    return float(np.corrcoef(a, b)[0, 1])


def _plot_ranks(path, ranks, title, dpi):
    from matplotlib.figure import Figure

    shown = [r for r in ranks if r["attention_rank"] is not None]
    x = np.arange(len(shown))
    fig = Figure(figsize=(max(5.0, 0.5 * len(shown) + 2), 3.2))
    ax = fig.subplots()
    ax.bar(x - 0.2, [r["attention_rank"] for r in shown], 0.4, label="attention")
    ax.bar(x + 0.2, [r["with_local_rank"] or 0 for r in shown], 0.4, label="attention + local branch")
    ax.plot(x, [r["tokens"] for r in shown], "k_", markersize=14, label="tokens (full rank)")
    ax.set_xticks(x, [r["layer"] for r in shown], rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("matrix rank")
    ax.set_title(title, fontsize=8)
    ax.legend(fontsize=7)
    fig.tight_layout()
    write_output(path, lambda f: fig.savefig(f, format="png", dpi=dpi))


def _plot_gates(path, same, opposite, r, title, dpi, max_points=20000):
    from matplotlib.figure import Figure  # no pyplot: no GUI backend, no global state

    idx = np.random.default_rng(0).permutation(len(same))[:max_points]
    fig = Figure(figsize=(4.8, 4.4))
    ax = fig.subplots()
    ax.scatter(same[idx], opposite[idx], s=2, alpha=0.3, rasterized=True)
    ax.set_xlabel("gate on the same-sign stream")
    ax.set_ylabel("gate on the opposite-sign stream")
    ax.set_title(f"{title}\nPearson r = {r:.3f} ({len(same)} token-channel pairs)", fontsize=8)
    fig.tight_layout()
    write_output(path, lambda f: fig.savefig(f, format="png", dpi=dpi))


# ---------------------------------------------------------------------------------------------
# The command


def analyze(
    out: str | Path,
    *,
    image: str | None = None,
    model_name: str = DEFAULT_MODEL,
    checkpoint: str | None = None,
    query: tuple[int, int] | None = None,
    layer: int = 0,
    img_size: int | None = None,
    max_rows: int = DEFAULT_MAX_ROWS,
    dpi: int = 60,
    model_kwargs: dict | None = None,
    overwrite: bool = False,
) -> dict:
    """Write ``attention_maps.png``, ``entropy.png``, ``gates.png`` (with a gate), ``rank.png`` (with a layer
    whose keys are its queries) and ``analysis.json`` to ``out``; any of them already there is refused before
    anything runs, unless ``overwrite``."""
    # the largest figure (8 x 5.6 inches) as RGBA pixels, before any is drawn
    check_allocation(f"a figure of 8 x 5.6 inches at --dpi {dpi}", 4 * int(8 * dpi) * int(5.6 * dpi), "cpu",
                     AnalyzeError, "use a lower --dpi")
    claim_outputs([Path(out) / name for name in OUTPUT_FILES], overwrite, "--out")
    torch.manual_seed(0)
    model, arch, trained = build_model(model_name, checkpoint, model_kwargs)
    cfg = getattr(model, "pretrained_cfg", {}) or {}
    size = img_size or cfg.get("input_size", (3, 224, 224))[-1]
    check_allocation(f"an image of --img-size {size} (3 x {size} x {size} float32)", 12 * size * size, "cpu",
                     AnalyzeError, "use a smaller --img-size")
    rgb = load_image(image, size, 3)
    try:
        feats = capture_layer_features(model, image_tensor(rgb, arch, model))
    except ValueError as e:
        if isinstance(e, AnalyzeError):
            raise
        raise AnalyzeError(f"model {arch} cannot take a {size}x{size} image: {e}") from None
    if not 0 <= layer < len(feats):
        raise AnalyzeError(f"--layer must be in 0..{len(feats) - 1} ({len(feats)} Pola layers), got {layer}")
    feat = feats[layer]
    qh, qw = feat.grid
    if query is None:
        query = (qh // 2, qw // 2)
    if not (0 <= query[0] < qh and 0 <= query[1] < qw):
        raise AnalyzeError(f"--query {query[0]} {query[1]} is outside the {qh}x{qw} query grid of layer {layer}")

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    weights_tag = "trained weights" if trained else "untrained weights"
    src = Path(image).name if image else "skimage astronaut"
    title = f"{arch} ({weights_tag}), layer {feat.name}, {src} {size}px"

    # (a) one query row, averaged over heads (each head's row sums to 1, so the mean does too)
    row = torch.tensor([feat.prefix + query[0] * qw + query[1]])
    per_head = [row_weights(feat, row, h) for h in range(feat.q.shape[1])]
    weights = {name: torch.stack([w[name][0] for w in per_head]).mean(0) for name in MAPS}
    _plot_maps(out / "attention_maps.png", rgb, feat, query, weights, title, dpi)

    # (b) entropy of sampled rows
    entropies = row_entropies(feat, max_rows)
    n_keys = feat.k.shape[2]
    _plot_entropy(out / "entropy.png", entropies, n_keys, f"PSE of {min(max_rows, feat.q.shape[2])} sampled query "
                  f"rows x {feat.q.shape[1]} heads over {n_keys} keys\n{title}", dpi)

    # (c) gates (none without polarity coefficients)
    files = ["attention_maps.png", "entropy.png"]
    r = None
    if feat.g is not None:
        same, opposite = gate_halves(feat, feat.q.shape[-1])
        r = _pearson(same, opposite)
        _plot_gates(out / "gates.png", same, opposite, r, f"gates of {feat.name}, {arch} ({weights_tag})", dpi)
        files.append("gates.png")

    # (d) rank of each layer's token mixing, without and with its local branch
    ranks = [layer_ranks(f) for f in feats]
    if any(r_["attention_rank"] is not None for r_ in ranks):
        _plot_ranks(out / "rank.png", ranks, f"rank of the token mixing per layer\n{arch} ({weights_tag})", dpi)
        files.append("rank.png")

    # Theorem 1 on every Pola layer
    per_layer = {}
    pooled: dict[str, list] = {}
    for f in feats:
        e = entropies if f is feat else row_entropies(f, max_rows)
        per_layer[f.name] = {"queries": f.q.shape[2], "keys": f.k.shape[2], "heads": f.q.shape[1],
                             "power_mean": float(f.power.mean()), "fractions": theorem1_fractions(e)}
        for name, v in e.items():
            pooled.setdefault(name, []).append(v)
    if "digits" in arch:  # also the model's own data: all rows of the first test digits
        result_digits = digits_theorem1(model, max_rows)
    else:
        result_digits = None
    result = {
        "model": arch, "weights": weights_tag, "checkpoint": checkpoint, "image": image or "skimage.data.astronaut",
        "img_size": size, "layer": feat.name, "query": list(query), "max_rows": max_rows,
        "entropy_tolerance": ENTROPY_TOL,
        "mean_pse": {name: float(np.nanmean(entropies[name])) for name in entropies},
        "log_num_keys": math.log(n_keys),
        "gate_pearson_r": r,
        "switches": {"polarity": feat.polarity, "polarity_coefficients": feat.g is not None,
                     "local": feat.local_kind},
        "rank": ranks,
        "theorem1": {"all_layers": theorem1_fractions({k: np.concatenate(v) for k, v in pooled.items()}),
                     "per_layer": per_layer},
        "theorem1_digits_test_images": result_digits,
        "files": files,
    }
    text = json.dumps(result, indent=2) + "\n"
    write_output(out / "analysis.json", lambda f: f.write(text.encode()))
    return result

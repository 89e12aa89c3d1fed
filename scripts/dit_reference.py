"""Make the PolaDiT reference data of tests/models/test_pola_dit.py and tests/tasks/test_diffusion.py from an
official PolaFormer++ checkout (not run in CI: the official code is not installed there).

    python scripts/dit_reference.py /path/to/PolaFormerPP

writes, under tests/data/pola_dit/,

- manifest.json: state_dict keys, shapes and parameter counts of the twelve official DiT configs, built on
  the meta device;
- tiny_float64.safetensors: a tiny official DiT's perturbed weights, inputs, its float32 timestep embedding
  table (``input.t_frequencies``) and float64 outputs, plus the official Gaussian diffusion's MSE and VLB
  terms for given noise and model outputs, and one step of its 250-step respaced sampler;
- sampling_float64.safetensors: a tiny 4-channel official DiT (float32 weights, run in float64) sampled by
  the official ``p_sample_loop`` / ``ddim_sample_loop`` with fixed noise (the start, each step's noise, the
  sample; for guidance the conditional half of the official doubled batch): DDPM
  with the fixed-large and the fixed-small variance, DDIM on the ``ddim10`` respacing, and DDPM with the
  learned variance and ``forward_with_cfg`` guidance; with the official timestep embedding of every step.

Last run on ZacharyMeng/PolaFormerPP at commit fd26f5e1c1bcc3210f4d583294ebf9a4d01d62dc (torch 2.14.1, CPU).
Only facts (names, shapes, numbers) are written, no official code.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import types
from pathlib import Path

import torch
from safetensors.torch import save_file

OUT = Path(__file__).resolve().parent.parent / "tests" / "data" / "pola_dit"
TINY = dict(input_size=8, patch_size=2, in_channels=3, hidden_size=16, depth=2, num_heads=2, num_classes=10,
            class_dropout_prob=0.1, learn_sigma=True)
# four latent channels, so that guidance on the first three differs from guidance on all
SAMPLING = dict(input_size=4, patch_size=2, in_channels=4, hidden_size=16, depth=2, num_heads=2, num_classes=10,
                class_dropout_prob=0.1, learn_sigma=True)
STEPS, CFG_SCALE, LABELS = 10, 4.0, (3, 7)
# name: (respacing, create_diffusion arguments, DDIM, guided, clip_denoised)
CHAINS = {
    "ddpm_fixed_large": (str(STEPS), dict(learn_sigma=False), False, False, False),
    "ddpm_fixed_small": (str(STEPS), dict(learn_sigma=False, sigma_small=True), False, False, True),
    "ddim": (f"ddim{STEPS}", dict(learn_sigma=False), True, False, False),
    "ddpm_learned_guided": (str(STEPS), dict(), False, True, False),
}


def _load_official(root: Path):
    dit = root / "downstream" / "dit"
    if not (dit / "models.py").is_file():
        raise SystemExit(f"no downstream/dit/models.py under {root}: give the path of an official checkout")
    if "einops" not in sys.modules:  # imported but unused by the DiT
        try:
            import einops  # noqa: F401
        except ImportError:
            sys.modules["einops"] = types.SimpleNamespace(rearrange=None)
    sys.path.insert(0, str(dit))  # its diffusion package imports itself by relative names only
    spec = importlib.util.spec_from_file_location("official_dit_models", dit / "models.py")
    models = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(models)
    from diffusion import create_diffusion
    # the official embedder computes in float32; feed its table to a float64 MLP
    models.TimestepEmbedder.forward = lambda self, t: self.mlp(
        self.timestep_embedding(t, self.frequency_embedding_size).to(self.mlp[0].weight.dtype))
    return models, create_diffusion


def manifest(models) -> dict:
    out = {}
    for name, factory in models.DiT_models.items():
        with torch.device("meta"):
            model = factory(input_size=32, num_classes=1000)
        out[name] = {
            "constructor": {"input_size": 32, "num_classes": 1000, "in_channels": 4, "learn_sigma": True,
                            "class_dropout_prob": 0.1, "patch_size": model.patch_size,
                            "hidden_size": model.pos_embed.shape[-1], "depth": len(model.blocks),
                            "num_heads": model.num_heads},
            "num_params": sum(p.numel() for p in model.parameters()),
            "state_dict": {k: list(v.shape) for k, v in model.state_dict().items()},
        }
    return out


def tiny_vectors(models, create_diffusion) -> dict:
    torch.manual_seed(0)
    model = models.DiT(**TINY).double().eval()
    embed = models.TimestepEmbedder
    with torch.no_grad():  # zero-initialised adaLN and output layers would hide everything: perturb all weights
        for name, p in model.named_parameters():
            if name != "pos_embed":
                p.add_(torch.randn_like(p) * 0.3)
    x = torch.randn(3, TINY["in_channels"], TINY["input_size"], TINY["input_size"], dtype=torch.float64)
    t = torch.tensor([0, 421, 999])
    y = torch.tensor([2, 7, TINY["num_classes"]])  # the last: the null class
    with torch.no_grad():
        out = model(x, t, y)
    tensors = {f"weights.{k}": v.contiguous() for k, v in model.state_dict().items()}
    tensors.update({"input.x": x, "input.t": t, "input.y": y, "output": out,
                    "input.t_frequencies": embed.timestep_embedding(t, model.t_embedder.frequency_embedding_size)})

    diffusion = create_diffusion(timestep_respacing="")
    x_start = torch.rand(4, 2, 4, 4, dtype=torch.float64) * 2 - 1
    noise = torch.randn_like(x_start)
    prediction = torch.randn(4, 4, 4, 4, dtype=torch.float64)
    prediction[:, 2:] = prediction[:, 2:].tanh()  # the variance interpolation lives in [-1, 1]
    steps = torch.tensor([0, 1, 500, 999])
    terms = diffusion.training_losses(lambda *args, **kwargs: prediction, x_start, steps, noise=noise)
    tensors.update({"diffusion.x_start": x_start, "diffusion.noise": noise, "diffusion.prediction": prediction,
                    "diffusion.t": steps, "diffusion.mse": terms["mse"], "diffusion.vb": terms["vb"],
                    "diffusion.loss": terms["loss"]})

    # one step of the official 250-step respaced sampler: the mean and log-variance of p(x_{t-1} | x_t)
    spaced = create_diffusion("250")
    x_t = torch.randn(2, 2, 4, 4, dtype=torch.float64)
    step_out = torch.randn(2, 4, 4, 4, dtype=torch.float64)
    step_out[:, 2:] = step_out[:, 2:].tanh()
    index = torch.tensor([100, 100])  # respaced index 100: original step 400
    p = spaced.p_mean_variance(lambda x, t, **kwargs: step_out, x_t, index, clip_denoised=False)
    tensors.update({"step.x_t": x_t, "step.prediction": step_out, "step.t": torch.tensor(spaced.timestep_map)[index],
                    "step.mean": p["mean"], "step.log_variance": p["log_variance"],
                    "step.timestep_map": torch.tensor(spaced.timestep_map)})
    return tensors


class _RecordedNoise:
    """``torch.randn_like`` while a sampler runs: the next of the given tensors (every step draws one)."""

    def __init__(self, noise):
        self.noise, self.drawn = list(noise), 0

    def __call__(self, like, **kwargs):
        out = self.noise[self.drawn]
        assert out.shape == like.shape, (out.shape, like.shape)
        self.drawn += 1
        return out.to(like.dtype)


def sampling_vectors(models, create_diffusion) -> dict:
    torch.manual_seed(1)
    model = models.DiT(**SAMPLING).eval()
    # perturbed in float32 (float32 weights, exact in the float64 model), less than the tiny model above: an
    # untrained network's chains grow with its outputs, and these stay within a few hundred
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name != "pos_embed":
                p.add_(torch.randn_like(p) * 0.1)
    tensors = {f"weights.{k}": v.contiguous() for k, v in model.state_dict().items()}
    model = model.double()
    channels, size = SAMPLING["in_channels"], SAMPLING["input_size"]
    labels = torch.tensor(LABELS)
    generator = torch.Generator().manual_seed(2)
    tensors["labels"] = labels
    steps_seen = set()

    def eps_only(x, t, y):  # a model without a learned variance: the ε half of the outputs
        return model(x, t, y)[:, :channels]

    for name, (respacing, options, ddim, guided, clip) in CHAINS.items():
        diffusion = create_diffusion(respacing, **options)
        steps_seen.update(diffusion.timestep_map)
        batch = 2 * len(labels) if guided else len(labels)  # the official guided batch holds the null half
        start = torch.randn(len(labels), channels, size, size, dtype=torch.float64, generator=generator)
        noise = torch.randn(STEPS, batch, channels, size, size, dtype=torch.float64, generator=generator)
        if guided:
            null = torch.full_like(labels, SAMPLING["num_classes"])
            fn, kwargs = model.forward_with_cfg, dict(y=torch.cat([labels, null]), cfg_scale=CFG_SCALE)
            x_t = torch.cat([start, start])
        else:
            fn, kwargs, x_t = eps_only, dict(y=labels), start
        loop = diffusion.ddim_sample_loop_progressive if ddim else diffusion.p_sample_loop_progressive
        recorded = _RecordedNoise(noise)
        randn_like, torch.randn_like = torch.randn_like, recorded
        try:
            *_, last = loop(fn, x_t.shape, noise=x_t, clip_denoised=clip, model_kwargs=kwargs, device="cpu")
        finally:
            torch.randn_like = randn_like
        assert recorded.drawn == STEPS, recorded.drawn
        tensors.update({f"{name}.start": start, f"{name}.noise": noise[:, :len(labels)].contiguous(),
                        f"{name}.sample": last["sample"][:len(labels)], f"{name}.timesteps": torch.tensor(
                            diffusion.timestep_map)})
    # the embedding is float32 by design and its last bits depend on the CPU's vector instructions: recorded
    steps = torch.tensor(sorted(steps_seen))
    tensors["embedding.t"] = steps
    tensors["embedding.table"] = models.TimestepEmbedder.timestep_embedding(steps, 256)
    return tensors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("official", type=Path, help="root of a PolaFormerPP checkout")
    args = parser.parse_args()
    models, create_diffusion = _load_official(args.official)
    OUT.mkdir(parents=True, exist_ok=True)
    record = {"source": "ZacharyMeng/PolaFormerPP downstream/dit/models.py", "tiny": TINY, "models": manifest(models)}
    (OUT / "manifest.json").write_text(json.dumps(record, indent=1) + "\n")
    save_file(tiny_vectors(models, create_diffusion), str(OUT / "tiny_float64.safetensors"))
    save_file(sampling_vectors(models, create_diffusion), str(OUT / "sampling_float64.safetensors"),
              metadata={"config": json.dumps(SAMPLING), "steps": str(STEPS), "cfg_scale": str(CFG_SCALE),
                        "chains": json.dumps({k: dict(respacing=v[0], **v[1], ddim=v[2], guided=v[3], clip=v[4])
                                              for k, v in CHAINS.items()})})


if __name__ == "__main__":
    main()

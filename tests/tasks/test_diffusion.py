"""The diffusion task: the loss and the samplers against the official Gaussian diffusion (float64 vectors of
scripts/dit_reference.py: its loss terms, a respaced step, whole DDPM/DDIM/guided chains of a tiny official DiT
with fixed noise), classifier-free guidance, 'polaformer diffusion train|sample|fid' end to end on digits
(pixels) and on an image folder through a local AutoencoderKL (latents), and one-line errors for bad inputs.

Tolerances (tests/README.md, tests/tolerances.py): float64 against the official at 1e-12 where both compute in
float64; where the official rounds its tables (diffusers' schedule, the respaced sampler's) to float32, its float32
rounding (u = 6e-8, amplified by at most 10 in the log-variances and the variational bound's differences: 1e-6; 1e-4
for the bound's KL, a difference of log-variances); the oracle samplers are checked against the image their exact
predictor implies: DDPM to float32 rounding over 50 steps (1e-5), DDIM to its own discretisation error (0.05)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors import safe_open
from safetensors.torch import load_file

from cli_helpers import error_line, run_main
from dit_helpers import use_recorded_embedding
from polaformer.models.pola_dit import PolaDiT
from polaformer.tasks.diffusion import RespacedDiffusion, diffusion_config, diffusion_loss, make_scheduler, sample
from polaformer.tasks.diffusion.gaussian import respaced_timesteps

REFERENCE = Path(__file__).resolve().parent.parent / "data" / "pola_dit" / "tiny_float64.safetensors"
SAMPLING = REFERENCE.with_name("sampling_float64.safetensors")
TINY = ["--opts", "model.hidden_size", "16", "model.depth", "1", "model.num_heads", "2", "train.eval_samples", "16"]


@pytest.mark.numerics
def test_loss_matches_official_mse_and_variational_bound():
    ref = load_file(str(REFERENCE))
    prediction = ref["diffusion.prediction"]
    terms = diffusion_loss(lambda x, t, y: prediction, make_scheduler(), ref["diffusion.x_start"], None,
                           t=ref["diffusion.t"], noise=ref["diffusion.noise"])
    torch.testing.assert_close(terms["mse"], ref["diffusion.mse"], rtol=1e-12, atol=0)
    # diffusers keeps its noise schedule in float32: x_t carries float32 rounding
    torch.testing.assert_close(terms["vb"], ref["diffusion.vb"], rtol=1e-4, atol=1e-6)


@pytest.mark.numerics
def test_ddpm_step_matches_the_official_respaced_sampler():
    ref = load_file(str(REFERENCE))
    diffusion = RespacedDiffusion(250)
    assert diffusion.timesteps == ref["step.timestep_map"].tolist()
    index = 100
    assert diffusion.timesteps[index] == int(ref["step.t"][0])
    mean, log_variance, _ = diffusion.p_mean_variance(ref["step.prediction"], index, ref["step.x_t"])
    # the official rounds its tables to float32 even for float64 samples
    torch.testing.assert_close(mean, ref["step.mean"], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(log_variance, ref["step.log_variance"], rtol=1e-6, atol=1e-7)


class _EpsOnly(torch.nn.Module):
    """A model without a learned variance: the ε half of a learned-variance PolaDiT's outputs (as the reference
    script samples the official one)."""

    learn_sigma = False

    def __init__(self, model: PolaDiT):
        super().__init__()
        self.model, self.null_class = model, model.null_class

    def forward(self, x, t, y):
        return self.model(x, t, y)[:, :x.shape[1]]


def _official_chains():
    with safe_open(str(SAMPLING), "pt") as f:
        meta = f.metadata()
    return load_file(str(SAMPLING)), json.loads(meta["config"]), json.loads(meta["chains"]), float(meta["cfg_scale"])


def _run_chain(ref, config, chain, name, cfg_scale, dtype, **options):
    model = PolaDiT(**config).eval()
    model.load_state_dict({k.removeprefix("weights."): v for k, v in ref.items() if k.startswith("weights.")})
    model = model.to(dtype)
    noise = torch.cat([ref[f"{name}.start"][None], ref[f"{name}.noise"]]).to(dtype)
    return sample(model if chain["guided"] else _EpsOnly(model), ref["labels"], tuple(noise.shape[2:]),
                  sampler="ddim" if chain["ddim"] else "ddpm", steps=len(ref[f"{name}.timesteps"]),
                  cfg_scale=cfg_scale if chain["guided"] else 1.0, clip_sample=chain["clip"], noise=noise, **options)


def _assert_relative(out, expected, tolerance):
    """Every element within ``tolerance`` of the sample's largest magnitude."""
    error = (out.double() - expected).abs().max() / expected.abs().max()
    assert error <= tolerance, f"relative error {error:.2e} (tolerance {tolerance:.0e})"


# the defaults must give the official chain; the options, where there is one, that of the official option
CHAINS = {
    "ddpm_fixed_large": {},  # a model without a learned variance: the official fixed-large default
    "ddpm_fixed_small": {"variance": "fixed_small"},  # the official sigma_small
    "ddim": {},  # the official 'ddimN' respacing, ending at alpha-bar 1
    "ddpm_learned_guided": {},  # forward_with_cfg: the first three output channels guided
}


@pytest.mark.numerics
@pytest.mark.parametrize("name", sorted(CHAINS))
def test_sampling_chains_equal_the_official(monkeypatch, name):
    """Whole 10-step chains of a tiny 4-channel official DiT with the official noise, in float64 and in float32
    (1e-5 of the sample's scale); the timestep embedding is the recorded official one (tests/dit_helpers.py)."""
    ref, config, chains, cfg_scale = _official_chains()
    use_recorded_embedding(monkeypatch, ref["embedding.t"], ref["embedding.table"])
    chain = chains[name]
    diffusion = RespacedDiffusion(len(ref[f"{name}.timesteps"]), ddim=chain["ddim"])
    assert diffusion.timesteps == ref[f"{name}.timesteps"].tolist()
    expected = ref[f"{name}.sample"]
    _assert_relative(_run_chain(ref, config, chain, name, cfg_scale, torch.float64, **CHAINS[name]), expected, 1e-6)
    _assert_relative(_run_chain(ref, config, chain, name, cfg_scale, torch.float32, **CHAINS[name]), expected, 1e-5)


@pytest.mark.parametrize("name, other", [
    ("ddpm_fixed_large", {"variance": "fixed_small"}),
    ("ddpm_learned_guided", {"guide_all_channels": True}),
])
def test_the_alternatives_are_options_that_differ(monkeypatch, name, other):
    """The posterior variance and guidance on every channel are options: with the same noise they move the
    official chain by a hundred times the fixture's tolerance or more."""
    ref, config, chains, cfg_scale = _official_chains()
    use_recorded_embedding(monkeypatch, ref["embedding.t"], ref["embedding.table"])
    out = _run_chain(ref, config, chains[name], name, cfg_scale, torch.float64, **other)
    expected = ref[f"{name}.sample"]
    assert (out - expected).abs().max() > 1e-3 * expected.abs().max()


def test_respacing_is_the_official_one():
    assert respaced_timesteps(250)[:3] == [0, 4, 8] and respaced_timesteps(250)[-2:] == [995, 999]
    assert respaced_timesteps(10) == [0, 111, 222, 333, 444, 555, 666, 777, 888, 999]
    assert respaced_timesteps(50, ddim=True) == list(range(0, 1000, 20))
    assert respaced_timesteps(30, ddim=True) == list(range(0, 1000, 34))  # the smallest stride giving 30
    with pytest.raises(ValueError, match=r"no integer stride gives 45 of 1000 steps \(nearest: 44, 46\)"):
        respaced_timesteps(45, ddim=True)
    # DDIM's last step lands on x_0 itself (alpha-bar 1 before the first kept step)
    assert RespacedDiffusion(10, ddim=True).tables["sqrt_prev"][0] == 1
    cfg = diffusion_config()
    assert cfg.sample.variance == "fixed_large" and cfg.sample.guide_all_channels is False


class _Oracle(torch.nn.Module):
    """The exact ε of a data set holding one image: (x_t − sqrt(ᾱ_t)·x*) / sqrt(1 − ᾱ_t)."""

    null_class, learn_sigma = 3, True
    target = torch.linspace(-0.9, 0.9, 16).reshape(1, 1, 4, 4)

    def forward(self, x, t, y):
        a = make_scheduler().alphas_cumprod[t].reshape(-1, 1, 1, 1)
        return torch.cat([(x - a.sqrt() * self.target) / (1 - a).sqrt(), torch.zeros_like(x)], dim=1)


@pytest.mark.numerics
@pytest.mark.parametrize("sampler, atol", [("ddpm", 1e-5), ("ddim", 0.05)])
def test_samplers_recover_the_image_an_exact_noise_predictor_implies(sampler, atol):
    out = sample(_Oracle(), torch.tensor([0, 1]), (1, 4, 4), sampler=sampler, steps=50, cfg_scale=2.0,
                 generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(out, _Oracle.target.expand(2, -1, -1, -1), rtol=0, atol=atol)


def test_bound_trains_only_the_variance_output():
    model = PolaDiT(input_size=4, patch_size=2, in_channels=1, hidden_size=8, depth=1, num_heads=2, num_classes=2)
    torch.nn.init.normal_(model.final_layer.linear.weight)
    x = torch.rand(3, 1, 4, 4) * 2 - 1
    terms = diffusion_loss(model, make_scheduler(), x, torch.tensor([0, 1, 0]),
                           generator=torch.Generator().manual_seed(0))
    terms["vb"].sum().backward()
    grad = model.final_layer.linear.weight.grad.reshape(2, 2, 2, 8)  # (p, q, channel, dim): channel 1 is v
    assert grad[..., 0, :].abs().max() == 0 and grad[..., 1, :].abs().max() > 0


class _LabelEcho(torch.nn.Module):
    """ε = ``scale``·label + ``shift`` everywhere, variance values 0.5."""

    null_class, learn_sigma = 5, True

    def __init__(self, scale=1.0, shift=0.0):
        super().__init__()
        self.scale, self.shift = scale, shift

    def forward(self, x, t, y):
        eps = (self.scale * y.to(x.dtype) + self.shift).reshape(-1, 1, 1, 1).expand_as(x)
        return torch.cat([eps, torch.full_like(x, 0.5)], dim=1)


@pytest.mark.parametrize("sampler", ["ddpm", "ddim"])
def test_guidance_mixes_conditional_and_null_predictions(sampler):
    labels = torch.tensor([1, 2])
    run = dict(sampler=sampler, steps=3)
    guided = sample(_LabelEcho(), labels, (1, 2, 2), cfg_scale=3.0, generator=torch.Generator().manual_seed(0), **run)
    # uncond + 3·(cond − uncond) with uncond = 5 (the null class): 3·label − 10
    expected = sample(_LabelEcho(3.0, -10.0), labels, (1, 2, 2), cfg_scale=1.0,
                      generator=torch.Generator().manual_seed(0), **run)
    torch.testing.assert_close(guided, expected, rtol=0, atol=0)
    unguided = sample(_LabelEcho(), labels, (1, 2, 2), cfg_scale=1.0, generator=torch.Generator().manual_seed(0), **run)
    assert not torch.equal(guided, unguided)
    with pytest.raises(ValueError, match="needs a model trained with class dropout"):
        sample(PolaDiT(input_size=4, patch_size=2, in_channels=1, hidden_size=8, depth=1, num_heads=2,
                       class_dropout_prob=0), labels, (1, 4, 4), cfg_scale=2.0)


def test_digits_train_sample_fid_end_to_end(tmp_path, capsys):
    out = tmp_path / "run"
    code, stdout, err = run_main(["diffusion", "train", "--steps", "3", "--batch-size", "8", "--image-size", "8",
                                  "--eval-every", "3", "--output", out, *TINY], capsys)
    assert code == 0, err
    record = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert record["step"] == 3 and record["ema_valid_loss"] > 0
    checkpoint = out / "last.pth"
    code, stdout, err = run_main(["diffusion", "sample", "--checkpoint", checkpoint, "--output", tmp_path / "s.png",
                                  "--classes", "3", "7", "--per-class", "2", "--steps", "2"], capsys)
    assert code == 0, err
    assert Image.open(tmp_path / "s.png").size == (16, 16)  # 2 classes x 2 samples of 8x8
    code, stdout, err = run_main(["diffusion", "sample", "--checkpoint", checkpoint, "--output",
                                  tmp_path / "s.safetensors", "--per-class", "1", "--steps", "2", "--sampler", "ddpm",
                                  "--cfg-scale", "1"], capsys)
    saved = load_file(str(tmp_path / "s.safetensors"))
    assert saved["images"].shape == (10, 1, 8, 8) and saved["labels"].tolist() == list(range(10))
    assert saved["images"].abs().max() <= 1
    code, stdout, err = run_main(["diffusion", "fid", "--checkpoint", checkpoint, "--per-class", "2", "--steps", "2"],
                                 capsys)
    assert code == 0, err
    assert "FID (digits features)" in stdout and "class accuracy" in stdout


def _folder(root: Path, size: int = 12) -> Path:
    for c, name in enumerate(("circle", "square")):
        (root / name).mkdir(parents=True)
        for i in range(3):
            pixels = torch.randint(0, 256, (size, size + 4, 3), generator=torch.Generator().manual_seed(10 * c + i))
            Image.fromarray(pixels.to(torch.uint8).numpy()).save(root / name / f"{i}.png")
    (root / "square" / "broken.png").write_bytes(b"not a png")
    return root


def _vae(path: Path) -> Path:
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    AutoencoderKL(block_out_channels=(8, 8), down_block_types=("DownEncoderBlock2D",) * 2,
                  up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=4, norm_num_groups=4,
                  layers_per_block=1).save_pretrained(path)
    return path


def test_latent_mode_on_an_image_folder(tmp_path, capsys):
    data, vae = _folder(tmp_path / "images"), _vae(tmp_path / "vae")
    out = tmp_path / "run"
    code, _, err = run_main(["diffusion", "train", "--data", data, "--channels", "3", "--image-size", "8",
                             "--vae", vae, "--steps", "2", "--batch-size", "4", "--output", out, *TINY,
                             "model.patch_size", "2", "data.valid_fraction", "0.3"], capsys)
    assert code == 0, err
    assert "skipping unreadable image" in err
    code, _, err = run_main(["diffusion", "sample", "--checkpoint", out / "last.pth", "--output",
                             tmp_path / "s.safetensors", "--per-class", "1", "--steps", "2"], capsys)
    assert code == 0, err
    assert load_file(str(tmp_path / "s.safetensors"))["images"].shape == (2, 3, 8, 8)  # decoded from 4x4x4 latents


@pytest.mark.parametrize("argv, message", [
    (["--vae", "{tmp}/no_vae"], "VAE folder not found: {tmp}/no_vae"),
    (["--data", "{tmp}/no_images"], "image folder not found: {tmp}/no_images"),
    (["--data", "{tmp}/empty", "--channels", "3"], "no class folders|no images|empty"),
    (["--image-size", "12"], "data.image_size must be a multiple of 8, got 12"),
    (["--image-size", "8", "--opts", "model.patch_size", "3"], "patch_size 3 must divide input_size 8"),
    (["--opts", "sample.sampler", "euler"], "sample.sampler must be one of ddpm, ddim"),
])
def test_bad_inputs_are_one_line_errors(tmp_path, capsys, argv, message):
    (tmp_path / "empty").mkdir()
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    code, _, err = run_main(["diffusion", "train", "--steps", "1", "--output", tmp_path / "run", *argv], capsys)
    assert code == 2
    line = error_line(err, logs_allowed=True)
    assert re.search(message.replace("{tmp}", str(tmp_path)), line), line


def test_vae_image_size_must_fit_the_downsampling(tmp_path, capsys):
    vae = _vae(tmp_path / "vae")
    code, _, err = run_main(["diffusion", "train", "--data", _folder(tmp_path / "images"), "--channels", "3",
                             "--image-size", "9", "--vae", vae, "--steps", "1", "--output", tmp_path / "run"], capsys)
    assert code == 2
    assert "data.image_size 9 is not a multiple of the VAE's downsampling 2" in error_line(err, logs_allowed=True)


def test_sample_and_fid_refuse_bad_requests(tmp_path, capsys):
    out = tmp_path / "run"
    code, _, err = run_main(["diffusion", "train", "--steps", "1", "--batch-size", "4", "--image-size", "8",
                             "--output", out, *TINY], capsys)
    assert code == 0, err
    for extra, message in ((["--classes", "10"], "classes must be in 0..9, got [10]"),
                           (["--output", tmp_path / "s.jpg"], "--output must end in .png or .safetensors"),
                           (["--sampler", "euler"], "unknown sampler 'euler' (known: ddpm, ddim)"),
                           (["--sampler", "ddim", "--steps", "45"], "no integer stride gives 45 of 1000 steps")):
        argv = ["diffusion", "sample", "--checkpoint", out / "last.pth", "--output", tmp_path / "s.png", *extra]
        code, _, err = run_main(argv, capsys)
        assert code == 2 and message in error_line(err), err
    code, _, err = run_main(["diffusion", "fid", "--checkpoint", out / "last.pth", "--features",
                             tmp_path / "inception.pth"], capsys)
    assert code == 2 and f"not found: {tmp_path / 'inception.pth'}" in error_line(err), err

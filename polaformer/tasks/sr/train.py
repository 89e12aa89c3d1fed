"""Training and evaluation of the PaCS super-resolution model as a step-based task of the one engine
(:mod:`polaformer.engine.loop`), with the official lightSR recipe as defaults: random aligned HR patches of 192
pixels, L1 loss, Adam (2e-4, betas 0.9/0.99), the learning rate halved at 50/80/90/95 % of the steps. Every
``eval_every`` steps the validation PSNR-Y/SSIM-Y (border = scale; the official test's partition of large
images, or tiled inference with ``eval.mode tile``), ``best.pth`` (highest PSNR-Y) and ``last.pth``;
``metrics.json`` also holds bicubic upsampling's scores on the same images."""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from ...checkpoint import CorruptCheckpointError, read_checkpoint
from ...engine.checkpoint import load_task_weights
from ...engine.config import COUNT, POSITIVE, POSITIVE_INT, Config, ConfigError, check_settings, configure, fraction
from ...engine.distributed import all_gather_object
from ...engine.loop import Engine, StepOutput, train
from ...engine.steps import StepTask, check_train_options, load_task_model, saved_config, step_settings, train_defaults
from ...limits import check_allocation
from ...models.pola_sr import PolaSR, chop_upscale, tiled_upscale
from .data import ImagePair, RandomPatches, folder_pairs, photo_pairs
from .metrics import sr_metrics, to_uint8

__all__ = ["EVAL_MODES", "OFFICIAL_PARAM_KEY", "RULES", "SRTask", "bicubic_upscale", "build_sr_model",
           "check_sr_config", "evaluate_sr", "load_sr_model", "model_upscaler", "official_state_dict", "sr_config",
           "sr_pairs", "train_sr"]

log = logging.getLogger(__name__)

BEST = "best.pth"
PHOTOS = "photos"  # a data path naming the embedded photos instead of a folder
# basicsr's path.param_key_g: what the official test configs load (training also writes params_ema)
OFFICIAL_PARAM_KEY = "params"
# chop: the official test's partition of large images (MambaIRv2LightModel.test); tile: ours, tiles averaged
EVAL_MODES = ("chop", "tile")
# the range of every numeric setting besides the engine options (engine/config.py checks them, naming the key)
RULES = {
    "model.scale": POSITIVE_INT, "model.embed_dim": POSITIVE_INT, "model.depths": POSITIVE_INT,
    "model.num_heads": POSITIVE_INT, "model.window_size": POSITIVE_INT, "model.mlp_ratio": POSITIVE,
    "data.patch_size": POSITIVE_INT, "data.repeats": POSITIVE_INT,
    "train.milestones": fraction(), "train.gamma": POSITIVE, "eval.tile": POSITIVE_INT, "eval.overlap": COUNT,
}


def sr_config(path=None, opts=(), overrides=None, *, check: bool = True) -> Config:
    """The defaults, then a YAML file, then ``KEY VALUE`` overrides, then ``overrides`` (``{'train.lr': 1e-4}``, from
    command-line flags) (:func:`~polaformer.engine.config.configure`); checked (:func:`check_sr_config`)
    unless ``check`` is false (a caller that hands it to :func:`train_sr`, which checks it)."""
    cfg = Config({
        "model": {"scale": 4, "embed_dim": 48, "depths": [5, 5, 5, 5], "num_heads": [4, 4, 4, 4],
                  "window_size": 16, "mlp_ratio": 1.0},
        # train_hr/valid_hr: a folder of HR images or 'photos'; *_lr: a folder of LR images ('' = bicubic from HR)
        "data": {"train_hr": PHOTOS, "train_lr": "", "valid_hr": PHOTOS, "valid_lr": "", "patch_size": 192,
                 "repeats": 100},
        "train": train_defaults("sr", steps=500000, batch_size=16, eval_every=5000, lr=2e-4,
                                milestones=[0.5, 0.8, 0.9, 0.95], gamma=0.5),
        # mode chop: the official test's partition; tile: tile x tile LR tiles overlapping by overlap, averaged
        "eval": {"mode": "chop", "tile": 192, "overlap": 16},
    })
    return configure(cfg, path, opts, overrides, check=check_sr_config if check else None)


def check_sr_config(cfg: Config) -> None:
    """Every setting in its range (:data:`RULES`), a known evaluation mode, tiles that overlap less than their side."""
    check_settings(cfg, RULES)
    check_train_options(cfg, "sr")
    if cfg.eval.mode not in EVAL_MODES:
        raise ConfigError(f"eval.mode must be one of {', '.join(EVAL_MODES)}, got {cfg.eval.mode!r}")
    if not 0 <= cfg.eval.overlap < cfg.eval.tile:
        raise ConfigError(f"eval.overlap must be in [0, eval.tile), got {cfg.eval.overlap} with tile {cfg.eval.tile}")


def build_sr_model(cfg: Config) -> PolaSR:
    m = cfg.model
    try:
        return PolaSR(upscale=m.scale, embed_dim=m.embed_dim, depths=tuple(m.depths), num_heads=tuple(m.num_heads),
                      window_size=m.window_size, mlp_ratio=m.mlp_ratio)
    except ValueError as e:
        raise ConfigError(f"cannot build the SR model: {e}") from None


def sr_pairs(hr: str, lr: str, scale: int, split: str) -> list[ImagePair]:
    """The pairs a data entry names: the embedded photos of ``split``, or a folder (with an LR folder or not)."""
    if hr == PHOTOS:
        if lr:
            raise ConfigError("the embedded photos make their own LR images; leave the LR folder empty")
        return photo_pairs(split, scale)
    return folder_pairs(hr, scale, lr or None)


@torch.no_grad()
def bicubic_upscale(lr: torch.Tensor, scale: int) -> torch.Tensor:
    """The baseline: (B, C, H, W) floats in [0, 1] upsampled by bicubic interpolation."""
    return F.interpolate(lr, scale_factor=scale, mode="bicubic", align_corners=False)


@torch.no_grad()
def evaluate_sr(upscale, pairs: list[ImagePair], scale: int, device="cpu") -> dict:
    """Mean PSNR-Y/SSIM-Y over ``pairs`` of ``upscale`` ((1, 3, h, w) floats → (1, 3, s·h, s·w)), with a border
    of ``scale``; ``images`` holds each image's scores."""
    return mean_scores(score_images(upscale, pairs, scale, device))


def score_images(upscale, pairs: list[ImagePair], scale: int, device="cpu") -> dict[str, dict]:
    """PSNR-Y/SSIM-Y of each of ``pairs`` (see :func:`evaluate_sr`), by image name."""
    images = {}
    for pair in pairs:
        sr = upscale(pair.lr[None].float().div(255).to(device))
        images[pair.name] = sr_metrics(to_uint8(sr[0]).cpu(), pair.hr, crop_border=scale)
    return images


def mean_scores(images: dict[str, dict]) -> dict:
    return {"psnr_y": sum(r["psnr_y"] for r in images.values()) / len(images),
            "ssim_y": sum(r["ssim_y"] for r in images.values()) / len(images), "images": images}


def model_upscaler(model: nn.Module, cfg: Config, progress: bool = False):
    """``model`` run on whole images as the configuration's ``eval`` section says: the official test's partition
    (``chop``) or tile by tile (``tile``); ``progress``: a bar of model calls on a terminal (a photo takes minutes
    on a CPU). An output larger than the memory available is refused first."""
    e, scale = cfg.eval, cfg.model.scale

    def run(lr):
        if e.mode == "tile":
            return tiled_upscale(model, lr, scale, tile=e.tile, overlap=e.overlap)
        return chop_upscale(model, lr, scale)

    def upscale(lr):
        b, c, h, w = lr.shape
        # at most the tiled sum, its count and their quotient: 2C + 1 float planes of the output's size
        check_allocation(f"the x{scale} output of a {w}x{h} image ({b} x {c} x {h * scale} x {w * scale})",
                         4 * b * (2 * c + 1) * h * scale * w * scale, lr.device, ConfigError, "upscale a smaller image")
        if not progress:
            return run(lr)
        with tqdm(desc=f"upscaling {w}x{h}", unit="call", leave=False, disable=None) as bar:
            handle = model.register_forward_hook(lambda *_: bar.update())  # one call per tile or piece
            try:
                return run(lr)
            finally:
                handle.remove()

    return upscale


class SRTask(StepTask):
    name = "sr"
    best_files = {BEST: "psnr_y"}
    resume_may_change = ("train.steps", "train.eval_every", "train.num_workers", "eval")

    def __init__(self, cfg: Config):
        super().__init__(cfg)
        d, scale = cfg.data, cfg.model.scale
        self.train_pairs = sr_pairs(d.train_hr, d.train_lr, scale, "train")
        self.valid_pairs = sr_pairs(d.valid_hr, d.valid_lr, scale, "valid")
        self.train_set = RandomPatches(self.train_pairs, scale, d.patch_size, d.repeats, cfg.train.seed)
        self.bicubic = evaluate_sr(lambda lr: bicubic_upscale(lr, scale), self.valid_pairs, scale)

    def build(self, engine: Engine, resuming: bool) -> nn.Module:
        return build_sr_model(self.cfg)

    def start_message(self, engine: Engine) -> str:
        return (self.opening(engine, f"the x{self.cfg.model.scale} SR model",
                             f"{len(self.train_pairs)} train / {len(self.valid_pairs)} valid images")
                + f" ({self.cfg.data.patch_size}-pixel HR patches)")

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        t = self.cfg.train
        return torch.optim.Adam(model.parameters(), lr=t.lr, betas=(0.9, 0.99), weight_decay=t.weight_decay)

    def build_scheduler(self, optimizer, updates_per_epoch: int, total_updates: int):
        t = self.cfg.train
        milestones = sorted({max(1, round(m * t.steps)) for m in t.milestones})
        return torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones, gamma=t.gamma)

    def step(self, model: nn.Module, batch, device: torch.device) -> StepOutput:
        lr, hr = (x.to(device, non_blocking=True) for x in batch)
        return StepOutput(F.l1_loss(model(lr).float(), hr), len(lr))

    def evaluate(self, model: nn.Module, engine: Engine) -> dict:
        """Each process scores every K-th image; the means are over all of them, in the order of one process."""
        was_training = model.training
        model.eval()
        ctx = engine.ctx
        mine = score_images(model_upscaler(model, self.cfg), self.valid_pairs[ctx.rank::ctx.world_size],
                            self.cfg.model.scale, engine.device)
        model.train(was_training)
        scores = {name: r for part in all_gather_object(mine, ctx) for name, r in part.items()}
        return mean_scores({pair.name: scores[pair.name] for pair in self.valid_pairs})

    def record(self, engine: Engine, train: dict, results: dict[str, dict]) -> dict:
        r = results["model"]
        return {"step": engine.num_updates, "lr": train["lr"], "train_l1": train["loss"], "psnr_y": r["psnr_y"],
                "ssim_y": r["ssim_y"], "elapsed_s": engine.elapsed}

    def describe(self, record: dict, improved: bool) -> str:
        return self.evaluation_line(record, improved, f"train L1 {record['train_l1']:.4f}, valid PSNR-Y "
                                                      f"{record['psnr_y']:.2f} dB, SSIM-Y {record['ssim_y']:.4f}")

    def summary(self, engine: Engine) -> dict:
        best = max(engine.history, key=lambda r: r["psnr_y"], default={})
        return self.run_summary(engine, {"scale": self.cfg.model.scale}, {
            "best_psnr_y": best.get("psnr_y"), "best_ssim_y": best.get("ssim_y"),
            "bicubic_psnr_y": self.bicubic["psnr_y"], "bicubic_ssim_y": self.bicubic["ssim_y"]})


def train_sr(cfg: Config, output, **options) -> dict:
    """Train as ``cfg`` says into ``output``; returns ``metrics.json``'s contents. ``options``: resume, overwrite,
    device, show_progress, allow_changed (:func:`~polaformer.engine.steps.step_settings`)."""
    check_sr_config(cfg)
    return train(SRTask(cfg), step_settings(cfg, output, **options))


def official_state_dict(checkpoint, path, param_key: str = OFFICIAL_PARAM_KEY) -> dict:
    """The weights basicsr's ``load_network`` takes from a file: its ``param_key`` entry (``params`` when that is
    missing, as there), with a leading ``module.`` (a DDP model's) stripped; a plain state dict as it is."""
    if not isinstance(checkpoint, dict):
        raise CorruptCheckpointError(path, "expected a state dict or basicsr's dict of them")
    if param_key not in checkpoint and OFFICIAL_PARAM_KEY in checkpoint:
        log.warning("%s has no %r entry: loading %r, as basicsr does", path, param_key, OFFICIAL_PARAM_KEY)
        param_key = OFFICIAL_PARAM_KEY
    if param_key in checkpoint:
        state_dict = checkpoint[param_key]
    elif checkpoint and all(isinstance(v, torch.Tensor) for v in checkpoint.values()):
        state_dict = checkpoint
    else:
        held = ", ".join(sorted(map(str, checkpoint))) or "nothing"
        raise CorruptCheckpointError(path, f"no {param_key!r} entry (it holds {held}); name the entry to load "
                                           f"with --param-key")
    if not isinstance(state_dict, dict):
        raise CorruptCheckpointError(path, f"its {param_key!r} entry is not a state dict")
    return {k.removeprefix("module."): v for k, v in state_dict.items()}


def load_sr_model(path, *, official_scale: int | None = None,
                  param_key: str = OFFICIAL_PARAM_KEY) -> tuple[PolaSR, Config]:
    """The model in a checkpoint of :func:`train_sr`, or, with ``official_scale``, the official lightSR model of
    that scale loaded from the authors' basicsr file (:func:`official_state_dict`: ``params`` unless
    ``param_key`` names another entry, such as ``params_ema``) or a plain state dict."""
    if official_scale is None:
        def rebuild(checkpoint):
            cfg = saved_config(checkpoint, sr_config(check=False), check_sr_config)
            return build_sr_model(cfg), cfg

        return load_task_model(path, SRTask.name, "SR", rebuild)
    cfg = sr_config(opts=["model.scale", str(official_scale)])
    state_dict = official_state_dict(read_checkpoint(path), path, param_key)
    model = build_sr_model(cfg)
    load_task_weights(model, state_dict, path)
    return model.eval(), cfg

"""Single-image super-resolution with the PaCS model (:mod:`polaformer.models.pola_sr`), trained through the one
engine: image pairs and training patches (:mod:`.data`), Y-channel PSNR/SSIM (:mod:`.metrics`), the task,
evaluation and checkpoint loading (:mod:`.train`)."""
from .data import ImagePair, RandomPatches, bicubic_downscale, folder_pairs, photo_pairs, read_image, save_image
from .metrics import rgb_to_y, sr_metrics, to_uint8
from .train import (
    EVAL_MODES,
    OFFICIAL_PARAM_KEY,
    SRTask,
    bicubic_upscale,
    build_sr_model,
    evaluate_sr,
    load_sr_model,
    model_upscaler,
    official_state_dict,
    sr_config,
    sr_pairs,
    train_sr,
)

__all__ = ["EVAL_MODES", "OFFICIAL_PARAM_KEY", "ImagePair", "RandomPatches", "SRTask", "bicubic_downscale",
           "bicubic_upscale", "build_sr_model", "evaluate_sr", "folder_pairs", "load_sr_model", "model_upscaler",
           "official_state_dict", "photo_pairs", "read_image", "rgb_to_y", "save_image", "sr_config", "sr_metrics",
           "sr_pairs", "to_uint8", "train_sr"]

"""The tasks, siblings over the one engine (:mod:`polaformer.engine`): each supplies its data, model, loss,
evaluation and ``polaformer`` command, and none imports another.

- :mod:`.classification`: image classification (the official recipes, the digits demo), evaluation, throughput
  and ablations (``polaformer train``, ``eval``, ``throughput``, ``ablate``);
- :mod:`.convert`: a trained softmax model turned into its Pola counterpart, then attention transfer and
  distillation fine-tuning (``polaformer convert``);
- :mod:`.dense`: detection and instance segmentation (torchvision) and semantic segmentation
  (segmentation_models_pytorch) on Pola backbones (``polaformer detect``, ``segment``);
- :mod:`.diffusion`: class-conditional image generation with PolaDiT, sampling, FID (``polaformer diffusion``);
- :mod:`.lm`: byte-level causal language models, bits per byte and sampling (``polaformer lm``);
- :mod:`.lra`: the Long Range Arena sequence tasks (``polaformer lra``);
- :mod:`.sr`: single-image super-resolution with the PaCS model (``polaformer sr``).
"""

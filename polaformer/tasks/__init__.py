"""The tasks, siblings over the one engine: each supplies a model, data, loss and evaluation.

- :mod:`.classification`: image classification (the official recipes, the digits demo), evaluation and
  throughput;
- :mod:`.lra`: the Long Range Arena sequence tasks;
- :mod:`.dense`: detection, instance and semantic segmentation on Pola backbones.
"""

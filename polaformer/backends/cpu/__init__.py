"""The CPU backend: native kernels (``csrc/``, built by :mod:`.native`), oneDNN products (:mod:`.onednn`),
fused convolutions (:mod:`.conv`) and the module swaps of :func:`polaformer.accelerate` (:mod:`.accelerate`).

Kept import-free: :mod:`polaformer.ops.dispatch` loads :mod:`.native` from here while the ops are imported."""

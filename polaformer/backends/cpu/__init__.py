"""The CPU kernels: native kernels (``csrc/``, built by :mod:`.native`), oneDNN products (:mod:`.onednn`) and
fused convolutions (:mod:`.conv`). The module swaps that put them into a model are :mod:`polaformer.acceleration`.

Kept import-free: :mod:`polaformer.ops.dispatch` loads :mod:`.native` from here while the ops are imported."""

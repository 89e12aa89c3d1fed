"""The kernels below the ops, one folder per device: the native CPU library and the CPU products
(:mod:`.cpu`), and the Triton toolkit the ops' kernels share (:mod:`.triton`). Nothing here imports the ops."""

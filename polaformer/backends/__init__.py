"""Kernels behind the ops and the module swaps of :func:`polaformer.accelerate`, one folder per device."""

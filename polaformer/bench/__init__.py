"""Every benchmark, behind ``polaformer bench`` (see docs/benchmarks.md).

One module per family, all on the shared machinery of :mod:`.harness` (timing with warm-up and
interleaved rounds, peak memory in fresh processes, the machine description, result files, plots):

- :mod:`.scaling`: ``polaformer bench`` itself: op time and memory against N, model images/s and memory
  against input size, Pola against softmax and linear baselines, with a matmul roofline;
- :mod:`.official`: whole models against the authors' code (``polaformer bench official``);
- :mod:`.native`: the native CPU kernels against the torch ops (``polaformer bench native``);
- :mod:`.pacs`: the fused PaCS op against its functional graph (``polaformer bench pacs``);
- :mod:`.dense`: backbones at detection resolutions (``polaformer bench dense``);
- :mod:`.deploy`: the CPU deployment options, eager to ONNX Runtime (``polaformer bench deploy``);
- :mod:`.lra`: the paper's Table 6 on the LRA model (``polaformer bench lra``).

The modules import their heavy dependencies themselves; importing this package loads none of them.
"""

"""Component ablations (PolaFormer paper, Table 3): train every row of an ablation file with several seeds.

An ablation file is a classification configuration (the official key tree, usually a recipe pulled in with
``BASE:``) plus an ``ABLATION`` node:

==========================  ===================================================================
``ABLATION.SEEDS``          seeds each row is trained with (``SEED`` is set to each in turn)
``ABLATION.REFERENCE``      what the rows' ``PAPER`` numbers are (a caption for table and chart)
``ABLATION.ROWS``           list of rows: ``NAME`` (folder name), ``LABEL`` (table text),
                            ``SWITCHES`` (model kwargs: ``polarity``, ``polarity_coefficients``,
                            ``local``), ``PAPER`` (the paper's top-1, or null)
==========================  ===================================================================

Each run trains in ``OUTPUT/<row>/seed<k>`` with :func:`~.train.run_training`; a run that already finished
there is read back instead of trained again (``overwrite`` retrains). The summary is written to
``OUTPUT/ablation.{md,csv,png}``: final test top-1 per row as mean ± sample std over the seeds, beside the
paper's number.
"""
from __future__ import annotations

import csv
import io
import json
import math
import os
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from ...engine.config import SEED, Config, ConfigError, configure
from ...engine.output import write_output
from ...files import read_text
from .config import _official_defaults, check_config, default_config, resolve_model_name

__all__ = ["AblationResult", "AblationRow", "load_ablation", "run_ablation", "write_report"]

SWITCH_KEYS = ("polarity", "polarity_coefficients", "local")
ROW_KEYS = {"NAME", "LABEL", "SWITCHES", "PAPER"}


@dataclass
class AblationRow:
    name: str
    label: str
    switches: dict
    paper: float | None = None
    top1: list[float] = field(default_factory=list)  # final test top-1 per seed
    wall_time_s: list[float] = field(default_factory=list)
    params: int = 0

    @property
    def mean(self) -> float:
        return statistics.fmean(self.top1) if self.top1 else math.nan

    @property
    def std(self) -> float:
        return statistics.stdev(self.top1) if len(self.top1) > 1 else 0.0


@dataclass
class AblationResult:
    rows: list[AblationRow]
    seeds: list[int]
    reference: str
    dataset: str
    model: str
    epochs: int
    files: list[Path]

    @property
    def wall_time_s(self) -> float:
        return sum(sum(row.wall_time_s) for row in self.rows)


def _defaults() -> Config:
    return Config({**_official_defaults(), "ABLATION": {"SEEDS": [0, 1, 2], "REFERENCE": "", "ROWS": []}})


def _parse_row(index: int, row) -> AblationRow:
    where = f"ABLATION.ROWS[{index}]"
    if not isinstance(row, dict):
        raise ConfigError(f"{where} must be a mapping with {', '.join(sorted(ROW_KEYS))}, got {row!r}")
    unknown = set(row) - ROW_KEYS
    if unknown:
        raise ConfigError(f"{where} has unknown keys {', '.join(sorted(unknown))} "
                          f"(known: {', '.join(sorted(ROW_KEYS))})")
    name = row.get("NAME")
    if not isinstance(name, str) or not name or os.sep in name or name.startswith("."):
        raise ConfigError(f"{where}.NAME must be a plain folder name, got {name!r}")
    switches = row.get("SWITCHES") or {}
    if not isinstance(switches, dict) or set(switches) - set(SWITCH_KEYS):
        raise ConfigError(f"{where}.SWITCHES takes only {', '.join(SWITCH_KEYS)}, got {switches!r}")
    paper = row.get("PAPER")
    if paper is not None and (isinstance(paper, bool) or not isinstance(paper, (int, float))):
        raise ConfigError(f"{where}.PAPER must be a number or null, got {paper!r}")
    return AblationRow(name, str(row.get("LABEL") or name), dict(switches), None if paper is None else float(paper))


def load_ablation(path: str | os.PathLike,
                  opts: Sequence[str] = ()) -> tuple[Config, list[AblationRow], list[int], str]:
    """``(training configuration without ABLATION, rows, seeds, reference)`` of an ablation file."""
    cfg = configure(_defaults(), path, opts)
    ablation = cfg.ABLATION
    rows = [_parse_row(i, row) for i, row in enumerate(ablation.ROWS)]
    if not rows:
        raise ConfigError(f"{path} has no ABLATION.ROWS")
    names = [row.name for row in rows]
    if len(set(names)) != len(names):
        raise ConfigError(f"ABLATION.ROWS names must differ, got {names}")
    seeds = list(ablation.SEEDS)
    integers = all(isinstance(s, int) and not isinstance(s, bool) for s in seeds)
    if not seeds or not integers or len(set(seeds)) != len(seeds):
        raise ConfigError(f"ABLATION.SEEDS must be distinct integers, got {seeds!r}")
    SEED.check("ABLATION.SEEDS", seeds)
    train_cfg = default_config().merge({k: v for k, v in cfg.to_dict().items() if k not in ("ABLATION", "BASE")})
    check_config(train_cfg)
    return train_cfg, rows, seeds, ablation.REFERENCE


def _finished(metrics_path: Path, epochs: int) -> dict | None:
    """A finished run's metrics.json (it is rewritten after every evaluation, so count the epochs)."""
    try:
        metrics = json.loads(read_text(metrics_path))
    except (OSError, ValueError):  # missing, unreadable (polaformer.files) or not JSON: not finished
        return None
    done = isinstance(metrics, dict) and len(metrics.get("epochs", [])) >= epochs and "final_test_top1" in metrics
    return metrics if done else None


def _count_params(row: AblationRow, arch: str, num_classes: int, kwargs: dict) -> int:
    """The parameters of ``row``'s model, built by the engine's factory: a switch the model refuses (``local:
    bogus``) is one line naming the row, before any row trains."""
    from ...engine.factory import ModelBuildError, create_model

    try:
        model = create_model(arch, num_classes, **kwargs)
    except ModelBuildError as e:
        raise ConfigError(f"ablation row {row.name!r} (SWITCHES {row.switches}): {e}") from None
    return sum(p.numel() for p in model.parameters())


def run_ablation(train_cfg: Config, rows: list[AblationRow], seeds: list[int], output: str | os.PathLike, *,
                 reference: str = "", overwrite: bool = False, log: TextIO | None = None) -> AblationResult:
    """Train every row with every seed under ``output``; then write the table and chart there."""
    from ...data import DATASETS
    from .train import TrainData, build_data, model_kwargs_from_config, run_training

    main = int(os.environ.get("RANK", "0")) == 0  # under torchrun only rank 0 reports
    log = log or sys.stderr
    output = Path(output)
    arch = resolve_model_name(train_cfg)
    # The embedded data sets are built once for all runs; a folder is read by each run (distributed samplers).
    data: TrainData | None = build_data(train_cfg) if train_cfg.DATA.DATASET in DATASETS else None
    data_kwargs, num_classes = (data.model_kwargs, data.num_classes) if data else ({}, train_cfg.MODEL.NUM_CLASSES)
    epochs = train_cfg.TRAIN.EPOCHS + train_cfg.TRAIN.COOLDOWN_EPOCHS
    total, done = len(rows) * len(seeds), 0

    def say(message: str) -> None:
        if main:
            print(f"ablation: {message}", file=log, flush=True)

    row_cfgs = []
    for row in rows:  # every row's model built once first: a bad switch fails before any training
        row_cfg = train_cfg.clone().defrost()
        row_cfg.MODEL.KWARGS.merge(row.switches)
        row.params = _count_params(row, arch, num_classes, model_kwargs_from_config(row_cfg, arch, data_kwargs))
        row_cfgs.append(row_cfg)
    for row, row_cfg in zip(rows, row_cfgs):
        for seed in seeds:
            done += 1
            run_dir = output / row.name / f"seed{seed}"
            metrics = None if overwrite else _finished(run_dir / "metrics.json", epochs)
            what = "read back" if metrics else "trained"
            if metrics is None:
                say(f"[{done}/{total}] {row.name} seed {seed}: training {epochs} epochs -> {run_dir}")
                run_cfg = row_cfg.clone()
                run_cfg.SEED, run_cfg.OUTPUT, run_cfg.OVERWRITE = seed, str(run_dir), True
                metrics = run_training(run_cfg, data=data)
            row.top1.append(float(metrics["final_test_top1"]))
            row.wall_time_s.append(float(metrics.get("wall_time_s", 0.0)))
            say(f"[{done}/{total}] {row.name} seed {seed} {what}: top-1 {row.top1[-1]:.2f}% "
                f"({row.wall_time_s[-1]:.0f}s)")
    result = AblationResult(rows, list(seeds), reference, train_cfg.DATA.DATASET, arch, epochs, [])
    if main:
        result.files = write_report(result, output)
        say(f"{total} runs, {result.wall_time_s:.0f}s of training -> {', '.join(str(f) for f in result.files)}")
    return result


def _mean_std(row: AblationRow) -> str:
    return f"{row.mean:.2f} ± {row.std:.2f}" if len(row.top1) > 1 else f"{row.mean:.2f}"


def _switch_text(row: AblationRow) -> tuple[str, str, str]:
    on = {True: "✓", False: "–"}
    return (on[row.switches.get("polarity", True)], on[row.switches.get("polarity_coefficients", True)],
            row.switches.get("local", "dwc"))


def _write_bytes(path: Path, data: bytes) -> None:
    write_output(path, lambda f: f.write(data))


def write_report(result: AblationResult, output: str | os.PathLike) -> list[Path]:
    """``ablation.md``, ``ablation.csv`` and ``ablation.png`` in ``output``; returns their paths."""
    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)
    paper_head = result.reference or "paper"
    seeds = ", ".join(str(s) for s in result.seeds)
    lines = [
        f"Final test top-1 (%) of `{result.model}` on `{result.dataset}`, {result.epochs} epochs, "
        f"mean ± sample std over seeds {seeds}; paper: {paper_head}.",
        "",
        "| row | polarity | Gˢ/Gᵒ | local | params | ours top-1 | paper top-1 | train time / seed |",
        "| --- | :-: | :-: | :-: | --: | --: | --: | --: |",
    ]
    for row in result.rows:
        polarity, coefficients, local = _switch_text(row)
        paper = "–" if row.paper is None else f"{row.paper:.1f}"
        seconds = statistics.fmean(row.wall_time_s) if row.wall_time_s else 0.0
        lines.append(f"| {row.label} | {polarity} | {coefficients} | {local} | {row.params:,} | {_mean_std(row)} | "
                     f"{paper} | {seconds:.0f} s |")
    md = output / "ablation.md"
    _write_bytes(md, ("\n".join(lines) + "\n").encode())

    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(["row", "label", *SWITCH_KEYS, "params", "seeds", "top1_mean", "top1_std", "top1_per_seed",
                     "paper_top1", "wall_time_s_per_seed"])
    for row in result.rows:
        writer.writerow([
            row.name, row.label, row.switches.get("polarity", True), row.switches.get("polarity_coefficients", True),
            row.switches.get("local", "dwc"), row.params, " ".join(str(s) for s in result.seeds),
            f"{row.mean:.3f}", f"{row.std:.3f}", " ".join(f"{t:.2f}" for t in row.top1),
            "" if row.paper is None else row.paper, " ".join(f"{t:.1f}" for t in row.wall_time_s),
        ])
    table = output / "ablation.csv"
    _write_bytes(table, buffer.getvalue().encode())

    chart = output / "ablation.png"
    _write_bytes(chart, _bar_chart(result))
    return [md, table, chart]


def _bar_chart(result: AblationResult) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result.rows
    xs = range(len(rows))
    width = 0.38
    fig, ax = plt.subplots(figsize=(1.6 + 1.5 * len(rows), 3.6), dpi=100)
    ours = ax.bar([x - width / 2 for x in xs], [r.mean for r in rows], width, yerr=[r.std for r in rows],
                  capsize=3, label=f"ours ({result.dataset}, {len(result.seeds)} seeds)", color="#3b75af")
    ax.bar_label(ours, labels=[f"{r.mean:.1f}" for r in rows], fontsize=7, padding=2)
    if any(r.paper is not None for r in rows):
        paper = ax.bar([x + width / 2 for x in xs], [r.paper if r.paper is not None else 0 for r in rows], width,
                       label=f"paper ({result.reference or 'reported'})", color="#ef8636")
        ax.bar_label(paper, labels=["" if r.paper is None else f"{r.paper:.1f}" for r in rows], fontsize=7, padding=2)
    ax.set_xticks(list(xs), [r.label for r in rows], fontsize=7)
    ax.set_ylabel("top-1 (%)")
    values = [r.mean - r.std for r in rows] + [r.paper for r in rows if r.paper is not None]
    ax.set_ylim(max(0.0, min(values) - 10), 100)
    ax.legend(fontsize=7, loc="lower right")
    ax.set_title(f"Table 3 ablation: {result.model}", fontsize=9)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    plt.close(fig)
    return buffer.getvalue()

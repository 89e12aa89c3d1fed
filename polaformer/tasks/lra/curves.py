"""Learning curves of ``polaformer lra train`` runs, drawn side by side from their ``metrics.json``."""
from __future__ import annotations

import json
from pathlib import Path

from ...engine.output import write_output
from ...files import UnreadableFileError, read_text
from .config import LRAConfigError

__all__ = ["plot_curves"]


def _read_run(folder: Path) -> dict:
    path = folder / "metrics.json"
    if not path.is_file():
        raise LRAConfigError(f"{folder} holds no metrics.json (is it an 'lra train' output folder?)")
    try:
        summary = json.loads(read_text(path))
    except UnreadableFileError as e:
        raise LRAConfigError(str(e)) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise LRAConfigError(f"{path} is not valid JSON: {e}") from None
    if not summary.get("history"):
        raise LRAConfigError(f"{path} has no evaluations")
    return summary


def plot_curves(runs: list[str | Path], out: str | Path, title: str | None = None) -> dict:
    """Dev accuracy and training loss against steps for each run; the majority-class rate as a line.

    Returns, per run, its label, best dev and test accuracy (what the figure's legend shows).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summaries = [_read_run(Path(folder)) for folder in runs]
    fig, (acc_ax, loss_ax) = plt.subplots(1, 2, figsize=(11, 4))
    table = []
    for summary in summaries:
        steps = [r["step"] for r in summary["history"]]
        label = summary["attention"]
        options = summary["config"].get("attention_options") or {}
        if options:
            label += " (" + ", ".join(f"{k}={v}" for k, v in options.items()) + ")"
        line, = acc_ax.plot(steps, [r["dev_accuracy"] for r in summary["history"]],
                            label=f"{label}: test {summary['test_accuracy']:.1f}%")
        loss_ax.plot(steps, [r["train_loss"] for r in summary["history"]], color=line.get_color(), label=label)
        table.append({"run": label, "best_dev_accuracy": summary["best_dev_accuracy"],
                      "test_accuracy": summary["test_accuracy"], "steps": summary["steps"],
                      "wall_time_s": summary["wall_time_s"]})
    majority = summaries[0]["majority_class_test_accuracy"]
    acc_ax.axhline(majority, color="grey", linestyle="--", label=f"majority class {majority:.1f}%")
    acc_ax.set(xlabel="step", ylabel="dev accuracy (%)", title="dev accuracy")
    loss_ax.set(xlabel="step", ylabel="training loss (mean since the last evaluation)", title="training loss")
    acc_ax.legend(fontsize=8)
    loss_ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(out)
    write_output(out, lambda f: fig.savefig(f, format=out.suffix.lstrip(".") or "png", dpi=80))
    plt.close(fig)
    return {"figure": str(out), "runs": table, "majority_class_test_accuracy": majority}

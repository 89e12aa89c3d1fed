"""A training run's output folder: locked for the run, cleared of what a killed write left, a finished run never
replaced by accident, and the metrics files.

:class:`RunFolder` holds the folder's :class:`~.output.OutputLock` (rank 0) from the moment the run is built, before
anything else, so that a busy or unwritable folder fails at once. A run's files are its last checkpoint, its best
checkpoints, ``metrics.jsonl`` (one JSON line per evaluation) and ``metrics.json`` (the task's summary).
"""
from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path

from ..checkpoint import CorruptCheckpointError, read_checkpoint
from ..files import atomic_write
from .config import ConfigError
from .output import OutputLock
from .parallel import SHARDED, remove_unused_folders

__all__ = ["METRICS_JSON", "METRICS_JSONL", "RunFolder", "write_json"]

METRICS_JSONL = "metrics.jsonl"
METRICS_JSON = "metrics.json"
_TEMPORARY = re.compile(r"^\..+\.[0-9a-f]{12}\.tmp$")  # atomic_write's temporary files


def write_json(path: Path, obj) -> None:
    atomic_write(path, lambda f: f.write((json.dumps(obj, indent=2) + "\n").encode()))


class RunFolder:
    """The output folder ``path`` of a run whose checkpoints are ``last_name`` and ``best_names``; ``lock``: hold
    its lock (rank 0), :meth:`release` gives it back."""

    def __init__(self, path: Path, last_name: str, best_names: Iterable[str], *, lock: bool):
        self.path = Path(path)
        self.names = (last_name, *best_names, METRICS_JSONL, METRICS_JSON)
        self.lock = OutputLock(self.path) if lock else None

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    @property
    def files(self) -> list[Path]:
        """The files of a run (this one or an earlier one) present in the folder."""
        return [self.path / name for name in self.names if (self.path / name).exists()]

    def check_start(self, *, continuing: bool, writable: bool) -> None:
        """Starting afresh (not ``continuing``: neither resuming nor overwriting) must not silently replace, and
        first empty the metrics of, an earlier run; with ``writable`` (rank 0) the files this run will replace must
        be replaceable (an immutable one would fail only at the first checkpoint)."""
        for path in self.files if writable else []:
            try:
                open(path, "ab").close()  # writes nothing
            except OSError as e:
                raise ConfigError(f"cannot write {path}: {(e.strerror or str(e)).lower()}") from None
        found = [path.name for path in self.files]
        if found and not continuing:
            raise ConfigError(
                f"the output folder {self.path} already holds a run ({', '.join(found)}): --resume auto "
                "continues it, --overwrite replaces it, or choose another --output"
            )

    def prepare(self, history: list[dict], *, replace: bool) -> None:
        """Before the first update (rank 0): remove what a killed write left, every file of an earlier run when
        ``replace``, shard folders no checkpoint names; ``metrics.jsonl`` then holds exactly ``history``, the
        evaluations of the checkpoint the run continues from."""
        for path in self.path.iterdir():
            if _TEMPORARY.match(path.name):
                path.unlink(missing_ok=True)
        if replace:  # no file of the old run stays
            for path in self.files:
                path.unlink()
        remove_unused_folders(self.path, self.shard_folders_in_use())
        lines = "".join(json.dumps(record) + "\n" for record in history)
        atomic_write(self.path / METRICS_JSONL, lambda f: f.write(lines.encode()))

    def shard_folders_in_use(self) -> set[str]:
        """The shard folders the run's checkpoint files name."""
        used = set()
        for path in self.files:
            if path.suffix == ".pth":
                try:
                    folder = read_checkpoint(path).get(SHARDED)
                except (CorruptCheckpointError, OSError, AttributeError):
                    continue
                if isinstance(folder, str):
                    used.add(folder)
        return used

    def append_record(self, record: dict, summary: dict) -> None:
        """One evaluation's line in ``metrics.jsonl``, and ``metrics.json`` rewritten as ``summary``."""
        with open(self.path / METRICS_JSONL, "a") as f:
            f.write(json.dumps(record) + "\n")
        self.write_summary(summary)

    def write_summary(self, summary: dict) -> None:
        write_json(self.path / METRICS_JSON, summary)

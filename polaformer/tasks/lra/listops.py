"""ListOps: the Long Range Arena's nested-list-operations task, generated and tokenised.

ListOps sources are prefix expressions over the digits 0-9 with four operators, e.g.
``( ( ( [MAX 2 ) 9 ) ] )`` = 9. The label is the value of the expression, so the task has ten classes.

The generator reproduces LRA's ``lra_benchmarks/data/listops.py`` (google-research/long-range-arena)
with our own code:

- a node below ``max_depth`` is an operator with probability 0.25, otherwise a value drawn uniformly
  from 0-9; a node at ``max_depth`` is always a value. An operator takes 2..``max_args`` arguments
  and is drawn uniformly from ``[MIN``, ``[MAX``, ``[MED`` (median, floored, as ``int(np.median)``
  does for non-negative values) and ``[SM`` (sum modulo 10). The random draws happen in the same
  order as in LRA's ``generate_tree`` (leaf test, value or argument count, arguments, operator), so
  with ``random.seed(seed)`` both draw the same trees.
- the *length* of a tree counts operators, values and one closing ``]`` per operator; parentheses
  are not counted. A tree is kept when ``min_length < length < max_length`` (both bounds exclusive,
  as in LRA), and examples are unique across all three splits.
- a tree is written the way LRA's ``to_string`` writes its nested pairs: an operator with ``k``
  arguments opens ``k + 1`` parentheses, each argument and the final ``]`` closes one. The files are
  ``basic_{train,val,test}.tsv``, tab-separated with the header ``Source\\tTarget``, written with
  Python's ``csv`` module as LRA does (so lines end in ``\\r\\n``).

LRA draws a set of trees and splits it in set-iteration order; we split in the order examples were
drawn. Both are a uniformly random assignment of i.i.d. examples, but ours is reproducible.

Tokenisation (:func:`encode_listops`) follows LRA's input pipeline: see the function for both
variants and the evidence.
"""
from __future__ import annotations

import csv
import io
import json
import logging
import random
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import numpy as np
from tqdm import tqdm

__all__ = [
    "LISTOPS_VOCAB",
    "OPERATORS",
    "encode_listops",
    "encode_listops_array",
    "evaluate_listops",
    "generate_listops",
]

log = logging.getLogger(__name__)

OPERATORS = ("[MIN", "[MAX", "[MED", "[SM")
END = "]"
VALUE_P = 0.25  # LRA: a node below max depth is an operator when random() <= 0.25
_VALUES = range(10)

# Fixed vocabulary; 0 is padding. Digits first so that id - 1 is the digit's value.
LISTOPS_VOCAB: dict[str, int] = {
    **{str(d): d + 1 for d in range(10)},
    "[MIN": 11,
    "[MAX": 12,
    "[MED": 13,
    "[SM": 14,
    END: 15,
}
_SPLIT_FILES = {"train": "basic_train.tsv", "val": "basic_val.tsv", "test": "basic_test.tsv"}


def _median_floor(args: Sequence[int]) -> int:
    ordered = sorted(args)
    mid = len(ordered) // 2
    if len(ordered) % 2:
        return ordered[mid]
    return (ordered[mid - 1] + ordered[mid]) // 2


def _apply(op: str, args: Sequence[int]) -> int:
    if op == "[MIN":
        return min(args)
    if op == "[MAX":
        return max(args)
    if op == "[MED":
        return _median_floor(args)
    return sum(args) % 10  # [SM


def evaluate_listops(source: str) -> int:
    """The value (label) of a ListOps source; parentheses are ignored, as LRA's tokeniser drops them.

    Raises ``ValueError`` on an unknown token, an operator without arguments, an unmatched ``]``, or
    anything other than exactly one top-level expression.
    """
    stack: list[tuple[str, list[int]]] = []
    result: int | None = None
    for token in source.split():
        if token in ("(", ")"):
            continue
        if token in OPERATORS:
            stack.append((token, []))
            continue
        if token == END:
            if not stack:
                raise ValueError(f"ListOps source has an unmatched {END!r}")
            op, args = stack.pop()
            if not args:
                raise ValueError(f"ListOps operator {op} has no arguments")
            value = _apply(op, args)
        elif len(token) == 1 and token.isdigit():
            value = int(token)
        else:
            raise ValueError(f"unknown ListOps token {token!r}")
        if stack:
            stack[-1][1].append(value)
        elif result is None:
            result = value
        else:
            raise ValueError("ListOps source has more than one top-level expression")
    if stack:
        raise ValueError(f"ListOps source ends inside an open {stack[-1][0]} (missing {END!r})")
    if result is None:
        raise ValueError("ListOps source is empty")
    return result


def encode_listops(source: str, style: Literal["lra", "skyformer"] = "lra") -> list[int]:
    """Token ids (see :data:`LISTOPS_VOCAB`, 0 = padding) of a ListOps source.

    - ``"lra"`` (default): LRA's current ``lra_benchmarks/listops/input_pipeline.py`` removes the
      parentheses, keeps ``]`` (renamed ``X`` there so its alphanumeric tokeniser keeps it) and keeps
      ``[MIN`` etc. as single tokens. Every token the generator counts in a length is kept, so a
      sequence is never longer than the generator's ``max_length``. The ``]`` tokens carry the tree
      structure; without them the expression is ambiguous.
    - ``"skyformer"``: the version of that pipeline Skyformer ships (``src/preprocess/
      lra_listops_input_pipeline.py``, LRA's release of Nov 2020) tokenises with tfds' alphanumeric
      ``Tokenizer``, which drops every bracket, ``]`` included (LRA issue #14). The Skyformer
      pickles, on which the PolaFormer paper reports ListOps, hold these sequences.

    Their pipelines number tokens in the order of a Python ``set``, so ids differ from run to run;
    ours are fixed. Unknown tokens raise ``ValueError``.
    """
    if style not in ("lra", "skyformer"):
        raise ValueError(f"unknown ListOps tokenisation {style!r}; expected 'lra' or 'skyformer'")
    ids = []
    for token in source.split():
        if token in ("(", ")") or (token == END and style == "skyformer"):
            continue
        token_id = LISTOPS_VOCAB.get(token)
        if token_id is None:
            raise ValueError(f"unknown ListOps token {token!r}")
        ids.append(token_id)
    return ids


_ASCII_ALLOWED = b"()[]0123456789MINAXEDS "
_OP_BYTES = ((b"[MIN", b"\x01"), (b"[MAX", b"\x02"), (b"[MED", b"\x03"), (b"[SM", b"\x04"))
_BYTE_IDS = np.zeros(256, dtype=np.uint8)
for _code, _op in enumerate(OPERATORS, start=1):
    _BYTE_IDS[_code] = LISTOPS_VOCAB[_op]
for _digit in range(10):
    _BYTE_IDS[ord(str(_digit))] = _digit + 1
_BYTE_IDS[ord(END)] = LISTOPS_VOCAB[END]


def encode_listops_array(source: str, style: Literal["lra", "skyformer"] = "lra") -> np.ndarray:
    """:func:`encode_listops` as a ``uint8`` array, about twice as fast on well-formed sources.

    Each operator becomes one byte, brackets and spaces are deleted, and a lookup table maps bytes
    to ids. The result is accepted only if every byte maps to a token and the number of ids equals
    the number of whitespace-separated tokens that should survive, which holds exactly when every
    token is valid; anything else goes through :func:`encode_listops` for its precise error.
    """
    raw = source.encode("ascii", "replace")
    drop = b"() ]" if style == "skyformer" else b"() "
    if style in ("lra", "skyformer") and not raw.translate(None, _ASCII_ALLOWED):
        packed = raw
        for op, code in _OP_BYTES:
            packed = packed.replace(op, code)
        ids = _BYTE_IDS[np.frombuffer(packed.translate(None, drop), dtype=np.uint8)]
        if b"  " in raw or raw[:1] == b" " or raw[-1:] == b" ":
            num_tokens = len(raw.split())
        else:
            num_tokens = raw.count(b" ") + 1 if raw else 0
        expected = num_tokens - raw.count(b"(") - raw.count(b")")
        if style == "skyformer":
            expected -= raw.count(b"]")
        if ids.all() and len(ids) == expected:
            return ids
    return np.asarray(encode_listops(source, style), dtype=np.uint8)


def _draw_tree(rng: random.Random, depth: int, max_depth: int, max_args: int, out: list[str]) -> tuple[int, int]:
    """Append one (sub)tree's tokens to ``out``; return ``(value, length)``."""
    r = rng.random() if depth < max_depth else 1.0
    if r > VALUE_P:
        value = rng.choice(_VALUES)
        out.append(str(value))
        return value, 1
    num_args = rng.randint(2, max_args)
    out.extend(["("] * (num_args + 1))
    op_slot = len(out)
    out.append("")  # the operator is drawn after its arguments, as in LRA
    args = []
    length = 2  # operator and closing bracket
    for _ in range(num_args):
        value, sub_length = _draw_tree(rng, depth + 1, max_depth, max_args, out)
        out.append(")")
        args.append(value)
        length += sub_length
    op = rng.choice(OPERATORS)
    out[op_slot] = op
    out.append(END)
    out.append(")")
    return _apply(op, args), length


def _histogram(lengths: list[int], min_length: int, max_length: int, bins: int = 10) -> list[list[int]]:
    """``[[low, high, count], ...]``: ten bins ``[low, high)`` spanning ``[min_length, max_length]``."""
    edges = np.linspace(min_length, max_length, bins + 1).round().astype(int)
    counts = np.histogram(lengths, bins=edges)[0] if lengths else np.zeros(bins, dtype=int)
    return [[int(lo), int(hi), int(n)] for lo, hi, n in zip(edges[:-1], edges[1:], counts)]


def _write_tsv(path: Path, rows: list[tuple[str, int]]) -> None:
    from polaformer.checkpoint import atomic_write

    text = io.StringIO(newline="")
    writer = csv.writer(text, delimiter="\t")  # LRA's writer: default dialect, "\r\n" line ends
    writer.writerow(["Source", "Target"])
    writer.writerows(rows)
    data = text.getvalue().encode("utf-8")
    atomic_write(path, lambda f: f.write(data))


def generate_listops(
    out_dir: str | Path,
    *,
    train: int = 96000,
    val: int = 2000,
    test: int = 2000,
    min_length: int = 500,
    max_length: int = 2000,
    max_depth: int = 10,
    max_args: int = 10,
    seed: int = 0,
    progress: bool = True,
    overwrite: bool = False,
) -> dict:
    """Write ``basic_{train,val,test}.tsv`` and ``report.json`` to ``out_dir``; return the report.

    Defaults are LRA's. Trees are drawn by rejection (about 8% of draws fall in 500..2000): about
    3 s per 2,000 kept examples on one CPU core, 2-3 minutes for the full 100,000; a tqdm bar shows
    progress. Each file
    is written to a temporary name and renamed, so a crash never leaves half a split behind.

    The report holds ``params``, ``draws``, ``seconds``, ``length_histogram`` over all examples,
    and per split (``splits[name]``) ``file``, ``examples``, ``labels`` (count per label "0".."9"),
    ``min_length``, ``max_length``, ``mean_length`` (0 for an empty split) and its own
    ``length_histogram``. Files already in ``out_dir`` are replaced only with ``overwrite``
    (:class:`FileExistsError` otherwise, before any work). A histogram is a list of ``[low, high, count]`` for ten
    bins ``[low, high)`` over ``[min_length, max_length]``; a length is what LRA counts (operators, values, ``]``).
    """
    counts = {"train": train, "val": val, "test": test}
    for name, count in counts.items():
        if count < 0:
            raise ValueError(f"{name} must be >= 0, got {count}")
    if max_depth < 1:
        raise ValueError(f"max_depth must be >= 1, got {max_depth}")
    if max_args < 2:
        raise ValueError(f"max_args must be >= 2, got {max_args}")
    if max_length - min_length < 2:
        raise ValueError(
            f"no length lies strictly between min_length={min_length} and max_length={max_length}"
        )
    out_dir = Path(out_dir)
    existing = [name for name in (*_SPLIT_FILES.values(), "report.json") if (out_dir / name).exists()]
    if existing and not overwrite:
        raise FileExistsError(f"{out_dir} already holds a data set ({', '.join(existing)}): --overwrite "
                              "replaces it, or choose another --out")
    total = sum(counts.values())
    rng = random.Random(seed)
    seen: set[str] = set()
    rows: list[tuple[str, int, int]] = []
    draws = 0
    since_last_new = 0
    stall_limit = 1_000_000
    start = time.perf_counter()
    with tqdm(total=total, desc="ListOps", unit="ex", disable=not progress) as bar:
        while len(rows) < total:
            tokens: list[str] = []
            value, length = _draw_tree(rng, 1, max_depth, max_args, tokens)
            draws += 1
            since_last_new += 1
            if min_length < length < max_length:
                source = " ".join(tokens)
                if source not in seen:
                    seen.add(source)
                    rows.append((source, value, length))
                    since_last_new = 0
                    bar.update(1)
            if since_last_new >= stall_limit:
                raise ValueError(
                    f"no new example in {stall_limit} draws after {len(rows)} of {total}: these "
                    f"parameters admit too few distinct ListOps examples"
                )
    seconds = time.perf_counter() - start

    report: dict = {
        "params": {
            "train": train, "val": val, "test": test, "min_length": min_length,
            "max_length": max_length, "max_depth": max_depth, "max_args": max_args, "seed": seed,
        },
        "draws": draws,
        "seconds": round(seconds, 3),
        "splits": {},
    }
    begin = 0
    for name, count in counts.items():
        part = rows[begin : begin + count]
        begin += count
        _write_tsv(out_dir / _SPLIT_FILES[name], [(source, value) for source, value, _ in part])
        labels = np.bincount([value for _, value, _ in part], minlength=10)
        lengths = [length for _, _, length in part]
        report["splits"][name] = {
            "file": _SPLIT_FILES[name],
            "examples": len(part),
            "labels": {str(d): int(labels[d]) for d in range(10)},
            "min_length": min(lengths, default=0),
            "max_length": max(lengths, default=0),
            "mean_length": round(float(np.mean(lengths)), 1) if lengths else 0.0,
            "length_histogram": _histogram(lengths, min_length, max_length),
        }
    report["length_histogram"] = _histogram([length for _, _, length in rows], min_length, max_length)

    from polaformer.checkpoint import atomic_write

    report_bytes = (json.dumps(report, indent=2) + "\n").encode("utf-8")
    atomic_write(out_dir / "report.json", lambda f: f.write(report_bytes))
    log.info(
        "ListOps: %d/%d/%d examples from %d draws in %.1f s -> %s",
        train, val, test, draws, seconds, out_dir,
    )
    return report

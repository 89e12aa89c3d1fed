"""The ListOps generator: LRA's algorithm and file format, checked on small generated sets."""
from __future__ import annotations

import csv
import json
import random

import pytest

from polaformer.tasks.lra.data import load_lra_split
from polaformer.tasks.lra.listops import (
    LISTOPS_VOCAB,
    OPERATORS,
    encode_listops,
    encode_listops_array,
    evaluate_listops,
    generate_listops,
)

SMALL = dict(train=60, val=15, test=15, progress=False)


def read_rows(path):
    with open(path, newline="", encoding="utf-8") as f:
        rows = list(csv.reader(f, delimiter="\t"))
    assert rows[0] == ["Source", "Target"]
    return rows[1:]


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    out = tmp_path_factory.mktemp("listops")
    return out, generate_listops(out, seed=3, **SMALL)


@pytest.mark.parametrize(
    "source, value",
    [
        ("( ( ( [MAX 2 ) 9 ) ] )", 9),
        ("( ( ( [MIN 4 ) ( ( ( [SM 7 ) 8 ) ] ) ) ] )", 4),
        ("( ( ( [MED 1 ) 2 ) ] )", 1),  # median of an even count is floored, as int(np.median)
        ("( ( ( ( ( [MED 3 ) 4 ) 5 ) 6 ) ] )", 4),
        ("( ( ( [MED 9 ) 0 ) 5 ) ] )", 5),
        ("( ( ( [SM 9 ) 8 ) ] )", 7),
        ("[MAX 1 [MIN 5 6 ] ]", 5),  # parentheses are optional
        ("7", 7),
    ],
)
def test_evaluate_listops(source, value):
    assert evaluate_listops(source) == value


@pytest.mark.parametrize(
    "source, fragment",
    [
        ("[MAX 1 2", "missing ']'"),
        ("1 ]", "unmatched"),
        ("[MAX ]", "no arguments"),
        ("1 2", "more than one top-level"),
        ("( )", "empty"),
        ("[MAX 12 ]", "unknown ListOps token '12'"),
    ],
)
def test_evaluate_listops_rejects_malformed_sources(source, fragment):
    with pytest.raises(ValueError, match=fragment.replace("[", r"\[")):
        evaluate_listops(source)


def test_vocabulary_fits_32_with_0_for_padding():
    assert sorted(LISTOPS_VOCAB.values()) == list(range(1, 16))
    assert set(OPERATORS) < set(LISTOPS_VOCAB)


def test_rows_are_labelled_unique_and_in_length(generated):
    out, report = generated
    sources = {}
    for split, count in (("train", 60), ("val", 15), ("test", 15)):
        rows = read_rows(out / f"basic_{split}.tsv")
        assert len(rows) == count
        for source, target in rows:
            assert int(target) == evaluate_listops(source)
            # the generator's length (operators, values, one "]" per operator) is what LRA's
            # tokenisation keeps, and LRA keeps 500 < length < 2000
            length = len(encode_listops(source))
            assert 500 < length < 2000
            assert source.count("(") == source.count(")")
            sources[source] = split
        assert report["splits"][split]["examples"] == count
    assert len(sources) == 90  # unique across all splits


def test_file_format_is_lras_csv_writer(generated):
    out, _ = generated
    raw = (out / "basic_val.tsv").read_bytes()
    assert raw.startswith(b"Source\tTarget\r\n") and raw.endswith(b"\r\n")
    first = raw.split(b"\r\n")[1].decode()
    assert first.startswith("( ( ") and first.split("\t")[0].endswith(" ] )")
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no temp files left over


def test_report(generated):
    out, report = generated
    assert json.loads((out / "report.json").read_text()) == report
    assert report["params"]["seed"] == 3 and report["draws"] >= 90
    for split in ("train", "val", "test"):
        part = report["splits"][split]
        assert sum(part["labels"].values()) == part["examples"]
        assert sum(n for _, _, n in part["length_histogram"]) == part["examples"]
        assert 500 < part["min_length"] <= part["mean_length"] <= part["max_length"] < 2000
    bins = report["length_histogram"]
    assert len(bins) == 10 and bins[0][0] == 500 and bins[-1][1] == 2000
    assert all(hi == next_lo for (_, hi, _), (next_lo, _, _) in zip(bins, bins[1:]))
    assert sum(n for _, _, n in bins) == 90


def test_seed_determinism(tmp_path, generated):
    out, _ = generated
    generate_listops(tmp_path / "same", seed=3, **SMALL)
    generate_listops(tmp_path / "other", seed=4, **SMALL)
    for split in ("train", "val", "test"):
        name = f"basic_{split}.tsv"
        assert (tmp_path / "same" / name).read_bytes() == (out / name).read_bytes()
    assert (tmp_path / "other" / "basic_train.tsv").read_bytes() != (out / "basic_train.tsv").read_bytes()


def _pair_tree_sources(seed, count, min_length, max_length, max_depth=10, max_args=10):
    """LRA's tree as nested pairs, written out pair by pair: a second route to the same strings."""
    rng = random.Random(seed)

    def tree(depth):
        if (rng.random() if depth < max_depth else 1) > 0.25:
            return rng.choice(range(10)), 1
        children = [tree(depth + 1) for _ in range(rng.randint(2, max_args))]
        node = (rng.choice(OPERATORS), children[0][0])
        for child, _ in children[1:]:
            node = (node, child)
        return (node, "]"), 2 + sum(n for _, n in children)

    def text(node):
        return str(node) if not isinstance(node, tuple) else f"( {text(node[0])} {text(node[1])} )"

    kept = []
    while len(kept) < count:
        node, length = tree(1)
        if min_length < length < max_length and text(node) not in kept:
            kept.append(text(node))
    return kept


def test_same_trees_as_pair_construction(tmp_path):
    generate_listops(tmp_path, train=12, val=4, test=4, min_length=30, max_length=300, seed=11, progress=False)
    ours = [s for split in ("train", "val", "test") for s, _ in read_rows(tmp_path / f"basic_{split}.tsv")]
    assert ours == _pair_tree_sources(11, 20, 30, 300)


def test_small_parameters(tmp_path):
    report = generate_listops(tmp_path, train=20, val=5, test=5, min_length=3, max_length=12, max_depth=3, max_args=3,
                              progress=False)
    for split in ("train", "val", "test"):
        for source, target in read_rows(tmp_path / f"basic_{split}.tsv"):
            assert 3 < len(encode_listops(source)) < 12 and int(target) == evaluate_listops(source)
    assert report["splits"]["val"]["examples"] == 5
    empty = generate_listops(tmp_path / "no_test", train=3, val=1, test=0, min_length=3, max_length=12, progress=False)
    assert empty["splits"]["test"] == {**empty["splits"]["test"], "examples": 0, "min_length": 0, "mean_length": 0.0}
    assert (tmp_path / "no_test" / "basic_test.tsv").read_bytes() == b"Source\tTarget\r\n"
    with pytest.raises(ValueError, match="no length lies strictly between"):
        generate_listops(tmp_path, min_length=5, max_length=6, progress=False)
    with pytest.raises(ValueError, match="too few distinct"):
        generate_listops(tmp_path / "tiny", train=10_000, val=0, test=0, min_length=1, max_length=4, max_depth=2,
                         max_args=2, progress=False)


def test_loader_reads_generated_files(generated):
    out, _ = generated
    rows = read_rows(out / "basic_test.tsv")
    ds = load_lra_split("listops", out, "test")
    assert len(ds) == len(rows)
    for (tokens, label), (source, target) in zip(ds, rows):
        assert label == int(target) and tokens.tolist() == encode_listops(source)
        assert tokens.max().item() < 32 and tokens.min().item() >= 1
    dev = load_lra_split("listops", out, "dev", listops_tokens="skyformer", limit=5)
    val_rows = read_rows(out / "basic_val.tsv")[:5]
    assert [t.tolist() for t, _ in dev] == [encode_listops(s, "skyformer") for s, _ in val_rows]


def test_fast_encoder_agrees_with_reference(generated):
    out, _ = generated
    for source, _ in read_rows(out / "basic_train.tsv"):
        for style in ("lra", "skyformer"):
            assert encode_listops_array(source, style).tolist() == encode_listops(source, style)
    for odd in ["( [MIN  3 ] )", " [SM 1 2 ] ", "[MIN\t3 ]"]:
        assert encode_listops_array(odd).tolist() == encode_listops(odd)
    for bad in ["( [MIN 12 ] )", "[MIN 1 ]]", "[SMIN 3 ]", "[MIN (3 ]", "é"]:
        with pytest.raises(ValueError, match="unknown ListOps token"):
            encode_listops_array(bad)

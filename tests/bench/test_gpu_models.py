"""`polaformer bench gpu-models --smoke`: the rows and columns of a CPU run through the command line, the official
pair checked equal before it is timed (when the official files can be extracted from local mirrors), the time
limit, and one-line errors for bad options."""
import csv
import platform
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from cli_helpers import run_main
from conftest import REPO
from polaformer.bench import gpu_models
from polaformer.cli import main

ENVIRONMENT = ("device", "driver", "torch", "triton")


@pytest.fixture(autouse=True)
def torch_ops_only(monkeypatch):
    """The torch ops, not the native CPU kernels: these runs check the command, and should not wait on a native
    build that another process holds."""
    monkeypatch.setenv("POLAFORMER_NATIVE", "0")


@pytest.mark.slow
def test_smoke_writes_a_row_per_model_impl_mode_and_variant(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("POLAFORMER_OFFICIAL_DIR", raising=False)
    monkeypatch.delenv("POLAFORMERPP_OFFICIAL_DIR", raising=False)
    out = tmp_path / "gpu_models.csv"
    assert main(["bench", "gpu-models", "--smoke", "--models", "pola_pvt_v2_b0", "pola_lm_small", "--dense",
                 "--out", str(out)]) == 0
    rows = list(csv.DictReader(out.open()))
    assert list(rows[0]) == ["model", "impl", "counterpart", "mode", "variant", "batch", "resolution", "tokens",
                             "unit", "items_per_s", "ms", "peak_mib", "error", "max_abs_diff", *ENVIRONMENT]
    # classification eager, classification compiled, then the LM, then the dense rows
    assert [(r["model"], r["impl"], r["mode"], r["variant"]) for r in rows] == [
        ("pola_pvt_v2_b0", impl, mode, variant) for variant in ("eager", "compile") for mode in ("train", "infer")
        for impl in ("ours", "softmax")
    ] + [("pola_lm_small", impl, mode, variant) for variant in ("eager", "compile") for mode in ("train", "infer")
         for impl in ("ours", "softmax")
    ] + [("pola_pvt_v2_b0", impl, "fwd_bwd", variant) for variant in ("eager", "compile")
         for impl in ("ours", "softmax")]
    counterparts = {r["counterpart"] for r in rows if r["impl"] == "softmax"}
    assert counterparts == {"pvt_v2_b0", "pola_lm_small attention=softmax"}
    for r in rows:
        assert r["batch"] == "1" and r["peak_mib"] == ""
        assert (r["device"], r["torch"]) == (f"cpu ({platform.machine()})", torch.__version__)
        if r["variant"] == "compile":  # compiled rows are GPU-only
            assert r["error"] == "CUDA only" and r["ms"] == ""
            continue
        assert r["error"] == "" and float(r["ms"]) > 0, r
        items = int(r["batch"]) * (int(r["tokens"]) if r["model"] == "pola_lm_small" else 1)
        assert float(r["items_per_s"]) == pytest.approx(items / float(r["ms"]) * 1e3)
    assert [(r["resolution"], r["tokens"], r["unit"]) for r in rows if r["model"] == "pola_lm_small"][0] == (
        "", "64", "tokens/s")
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("pola_")]
    assert len(lines) == len(rows)  # one progress line per row
    assert lines[0].startswith("pola_pvt_v2_b0 ours train eager b1 64: ")


def _extract(mirror: Path, dest: Path, *paths) -> bool:
    if not (mirror / "HEAD").is_file() or shutil.which("git") is None:
        return False
    dest.mkdir(parents=True)
    archive = subprocess.run(["git", "--git-dir", str(mirror), "archive", "HEAD", "--", *paths], capture_output=True)
    if archive.returncode != 0:
        return False
    return subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout).returncode == 0


def test_official_pair_is_checked_equal_before_timing(tmp_path, monkeypatch):
    root = tmp_path / "PolaFormerPP"
    if not _extract(Path("/work/.mirror/ZacharyMeng+PolaFormerPP/repo"), root, "downstream/dit/models.py"):
        pytest.skip("no local mirror of ZacharyMeng/PolaFormerPP to extract the official DiT from "
                    "(scripts/prepare_official.sh names the mirrors)")
    monkeypatch.setenv("POLAFORMERPP_OFFICIAL_DIR", str(root))
    rows = gpu_models.run_gpu_models(models=["pola_dit_s_2"], impls=["ours", "official"], modes=["infer"],
                                     variants=["eager"], smoke=True, log=lambda line: None)
    assert [(r["impl"], r["error"]) for r in rows] == [("ours", None), ("official", None)]
    assert rows[1]["max_abs_diff"] < 1e-5 and rows[1]["tokens"] == 16 and rows[1]["resolution"] == 8

    checked = []  # a pair whose outputs differ is a row with the reason, and is not timed
    monkeypatch.setattr(gpu_models, "_check_official", lambda *a: checked.append(a) or (_ for _ in ()).throw(
        AssertionError("pola_dit_s_2: outputs differ by 0.5")))
    rows = gpu_models.run_gpu_models(models=["pola_dit_s_2"], impls=["official"], modes=["infer"],
                                     variants=["eager"], smoke=True, log=lambda line: None)
    assert len(checked) == 1
    assert [(r["impl"], r["ms"], r["error"]) for r in rows] == [
        ("official", None, "pola_dit_s_2: outputs differ by 0.5")]


def test_a_compiled_row_times_the_compiled_model_and_a_failed_compile_is_its_error(monkeypatch):
    family = gpu_models.FAMILIES["pola_lm_small"]
    model = gpu_models._create("pola_lm_tiny", {}, family, 16)
    plan = gpu_models.Plan(steps=1, warmup=1, compile_on_cpu=True)
    compiled = []
    monkeypatch.setattr(torch, "compile", lambda m: compiled.append(m) or m)
    fields = gpu_models._measure(model, family=family, mode="train", variant="compile", batch=2, size=16,
                                 device=torch.device("cpu"), plan=plan)
    assert compiled == [model] and fields["error"] is None and fields["ms"] > 0
    assert fields["items_per_s"] == pytest.approx(2 * 16 / fields["ms"] * 1e3)  # the LM counts tokens

    def broken(m):
        raise RuntimeError("inductor: no C++ compiler\nmore")
    monkeypatch.setattr(torch, "compile", broken)
    fields = gpu_models._measure(model, family=family, mode="infer", variant="compile", batch=2, size=16,
                                 device=torch.device("cpu"), plan=plan)
    assert (fields["ms"], fields["error"]) == (None, "inductor: no C++ compiler")


def test_dense_only_runs_the_backbone_rows_alone(tmp_path):
    out = tmp_path / "dense.csv"
    assert main(["bench", "gpu-models", "--smoke", "--models", "pola_pvt_v2_b0", "pola_lm_small", "--dense-only",
                 "--variants", "eager", "--out", str(out)]) == 0
    rows = list(csv.DictReader(out.open()))
    assert [(r["model"], r["impl"], r["mode"], r["resolution"]) for r in rows] == [
        ("pola_pvt_v2_b0", impl, "fwd_bwd", "64") for impl in ("ours", "softmax")]


def test_dense_rows_take_the_dense_batch():
    plan = gpu_models.Plan(impls=("ours",), dense=True, model_rows=False, dense_batch=3, steps=1, warmup=0,
                           dense_sizes=(64,))
    rows = []
    gpu_models._run_dense(gpu_models.FAMILIES["pola_pvt_v2_b0"], "eager", plan, torch.device("cpu"), rows.append,
                          print, None)
    assert [(r["mode"], r["batch"], r["error"]) for r in rows] == [("fwd_bwd", 3, None)]
    with pytest.raises(ValueError, match="no rows to run"):
        gpu_models.run_gpu_models(models=["pola_pvt_v2_b0"], model_rows=False, smoke=True)


def test_past_the_time_limit_no_row_starts():
    lines, written = [], []
    rows = gpu_models.run_gpu_models(models=["pola_lm_small"], smoke=True, time_limit=1e-9, log=lines.append,
                                     on_row=written.append)
    assert rows == [] and written == [[]] and lines == ["time limit of 1e-09 s reached: 0 rows"]


def error_line(err: str) -> str:
    """The one line of ``err``: this command's usage error."""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("polaformer bench gpu-models: error: "), err
    return lines[0]


@pytest.mark.parametrize("args, message", [
    (["--models", "pola_nope"], "--models: unknown pola_nope"),
    (["--impls", "theirs"], "--impls: unknown theirs"),
    (["--modes", "eval"], "--modes: unknown eval"),
    (["--variants", "graph"], "--variants: unknown graph"),
    (["--batch-scale", "2"], "--batch-scale must be in (0, 1], got 2.0"),
    (["--time-limit", "0"], "--time-limit must be > 0, got 0.0"),
    (["--warmup", "-1"], "--warmup must be >= 0, got -1"),
    (["--dense-batch", "0"], "--dense-batch"),
    (["--dense-only", "--models", "pola_lm_small"], "--dense-only: none of --models is a backbone"),
])
def test_bad_options_are_one_line_errors(tmp_path, capsys, args, message):
    out = tmp_path / "rows.csv"
    code, _, err = run_main(["bench", "gpu-models", "--smoke", "--out", out, *args], capsys)
    assert code == 2 and message in error_line(err) and not out.exists()


def test_without_a_gpu_the_full_run_says_so(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, _, err = run_main(["bench", "gpu-models", "--out", tmp_path / "rows.csv"], capsys)
    assert code == 2 and "needs a CUDA device (or --smoke" in error_line(err)


def test_the_gpu_script_runs_the_command_under_a_timeout():
    script = (REPO / "scripts" / "gpu_models_check.sh").read_text()
    assert "bench gpu-models" in script and "timeout -s INT -k 15" in script
    assert "POLAFORMER_OFFICIAL_DIR" in script and "POLAFORMERPP_OFFICIAL_DIR" in script


def test_reduce_overhead_rows_compile_with_cuda_graphs_and_sizes_replace_a_familys(monkeypatch):
    """``--variants reduce-overhead``: torch.compile's CUDA-graph mode; ``--size``: the LM at another length."""
    family = gpu_models.FAMILIES["pola_lm_small"]
    model = gpu_models._create("pola_lm_tiny", {}, family, 16)
    compiled = []
    monkeypatch.setattr(torch, "compile", lambda m, **options: compiled.append(options) or m)
    fields = gpu_models._measure(model, family=family, mode="train", variant="reduce-overhead", batch=2, size=16,
                                 device=torch.device("cpu"), plan=gpu_models.Plan(steps=1, warmup=0,
                                                                                  compile_on_cpu=True))
    assert compiled == [{"mode": "reduce-overhead"}] and fields["error"] is None
    built = []
    monkeypatch.setattr(gpu_models, "_build", lambda family, impls, size, log: built.append(size) or [])
    plan = gpu_models.Plan(models=("pola_lm_small",), sizes={"pola_lm_small": 8192}, steps=1, warmup=0)
    gpu_models._run_family(family, "eager", plan, torch.device("cpu"), print, print, None)
    assert built == [8192]


@pytest.mark.parametrize("size, message", [
    ("pola_lm_small", "--size takes NAME=SIZE with a whole number, got 'pola_lm_small'"),
    ("no_such_model=64", "--size: unknown model 'no_such_model'"),
])
def test_bad_sizes_are_one_line(tmp_path, capsys, size, message):
    assert main(["bench", "gpu-models", "--smoke", "--size", size, "--out", str(tmp_path / "x.csv")]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err

"""``compile`` and ``grad_checkpointing`` from every task's configuration (``train.*``; classification's
``TRAIN.COMPILE`` / ``TRAIN.USE_CHECKPOINT``), through the real commands, each run tiny: gradient checkpointing
recomputes the blocks' forward passes and ends on the same weights; ``torch.compile`` (the 'eager' backend: dynamo
captures the graphs, no code generation) trains the same run."""
import pytest
import torch
import torch._dynamo
from torch import nn

from cli_helpers import quiet
from polaformer.cli import main
from polaformer.engine.distributed import DistContext
from polaformer.engine.parallel import COMPILE_MODES, check_execution, prepare_model
from polaformer.tasks.lra.listops import generate_listops
from tolerances import adam_drift_bound, assert_trainings_agree

DIT = ["--opts", "model.hidden_size", "16", "model.depth", "2", "model.num_heads", "2", "train.eval_samples", "8"]
DEIT = ["--backbone", "pola_deit_tiny_patch16_224", "--backbone-kwarg", "depth=2", "--backbone-kwarg", "embed_dim=16",
        "--backbone-kwarg", "num_heads=1"]
PVT = ["--backbone", "pola_pvt_tiny", "--backbone-kwarg", "depths=[1, 1, 1, 1]", "--backbone-kwarg",
       "embed_dims=[16, 32, 64, 64]", "--backbone-kwarg", "num_heads=[1, 2, 2, 2]", "--backbone-kwarg",
       "mlp_ratios=[2, 2, 2, 2]"]
DENSE = ["--steps", "2", "--batch-size", "1", "--no-progress", "--device", "cpu", "--train-size", "2",
         "--val-size", "1"]

# task -> (argv of a tiny run into {out} whose last option is --opts, its keys: compile, grad checkpointing)
STEP_KEYS = ("train.compile", "train.grad_checkpointing")
TASKS = {
    "lm": (["lm", "train", "--context", "16", "--steps", "2", "--batch-size", "4", "--eval-every", "2", "--max-bytes",
            "20000", "--device", "cpu", "--output", "{out}", "--opts", "train.eval_batches", "1",
            "train.warmup_steps", "1", "model.name", "pola_lm_tiny"], STEP_KEYS),
    "sr": (["sr", "train", "--scale", "2", "--train-hr", "{root}/hr", "--valid-hr", "{root}/hr", "--patch-size", "16",
            "--steps", "2", "--batch-size", "2", "--eval-every", "2", "--device", "cpu", "--output", "{out}", "--opts",
            "model.embed_dim", "8", "model.depths", "[2]", "model.num_heads", "[2]", "model.window_size", "8",
            "data.repeats", "2", "eval.tile", "16", "eval.overlap", "4"], STEP_KEYS),
    "diffusion": (["diffusion", "train", "--steps", "2", "--batch-size", "4", "--image-size", "8", "--eval-every", "2",
                   "--device", "cpu", "--output", "{out}", *DIT, "train.ema_decay", "0"], STEP_KEYS),
    "lra": (["lra", "train", "--task", "listops", "--data", "{root}/listops", "--batch-size", "4", "--eval-every", "2",
             "--steps", "2", "--device", "cpu", "--output", "{out}", "--opts", "model.dim", "8", "model.hidden_dim",
             "8", "model.num_heads", "1", "model.head_dim", "8", "model.num_layers", "2", "train.warmup_steps", "1"],
            STEP_KEYS),
    "classification": (["train", "--model", "pola_deit_digits", "--model-kwarg", "depth=2", "--epochs", "1",
                        "--batch-size", "512", "--device", "cpu", "--output", "{out}", "--opts", "MODEL.DROP_PATH_RATE",
                        "0", "TRAIN.WARMUP_EPOCHS", "0"], ("TRAIN.COMPILE", "TRAIN.USE_CHECKPOINT")),
    "detect": (["detect", "train", "--detector", "fcos", *DEIT, *DENSE, "--output", "{out}",
                "--opts", "train.seed", "0"], STEP_KEYS),
    "segment": (["segment", "train", "--decoder", "fpn", *PVT, *DENSE, "--output", "{out}",
                 "--opts", "train.seed", "0"], STEP_KEYS),
}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    import numpy as np
    from PIL import Image

    root = tmp_path_factory.mktemp("data")
    generate_listops(root / "listops", train=16, val=8, test=8, min_length=10, max_length=30, max_depth=3, seed=0,
                     progress=False)
    (root / "hr").mkdir()
    for i in range(2):
        pixels = np.random.RandomState(i).randint(0, 255, (32, 40, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(root / "hr" / f"{i}.png")
    return root


class Forwards:
    """Counts module forward calls while training (a recomputed block runs its forward twice)."""

    def __enter__(self):
        self.count = 0
        self.handle = nn.modules.module.register_module_forward_hook(self._hook)
        return self

    def _hook(self, module, args, output):
        self.count += 1

    def __exit__(self, *exc):
        self.handle.remove()


def run(task: str, root, out, *settings) -> tuple[dict, int]:
    """The tiny run of ``task`` with config ``settings`` (``KEY VALUE`` ...): its last weights, forward calls."""
    argv, _ = TASKS[task]
    argv = [a.replace("{out}", str(out)).replace("{root}", str(root)) for a in argv] + [str(s) for s in settings]
    torch.manual_seed(0)
    with quiet(), Forwards() as forwards:
        assert main(argv) == 0, argv
    last = out / ("checkpoint.pth" if task == "classification" else "last.pth")  # the digits demo's LAST_CHECKPOINT
    return torch.load(last, weights_only=True)["model"], forwards.count


_baselines: dict = {}


def baseline(task, data, tmp_path_factory):
    if task not in _baselines:
        _baselines[task] = run(task, data, tmp_path_factory.mktemp(f"{task}_plain"))
    return _baselines[task]


@pytest.mark.parametrize("task", list(TASKS))
def test_grad_checkpointing_recomputes_and_trains_the_same_weights(task, data, tmp_path_factory, tmp_path):
    plain, plain_forwards = baseline(task, data, tmp_path_factory)
    weights, forwards = run(task, data, tmp_path / "run", TASKS[task][1][1], "true")
    assert forwards > plain_forwards, (forwards, plain_forwards)  # the blocks ran again in the backward pass
    assert weights.keys() == plain.keys()
    # the same operations on the same values: recomputation gives the activations again bit for bit
    for key in plain:
        assert torch.equal(weights[key], plain[key]), key


# One run per path the key takes to the engine, to keep the suite short: the step tasks' (engine/steps.py
# step_settings: diffusion and lra here, lm and sr the same way), classification's and the dense runner's (segment;
# detect the same way, without dynamo tracing a torchvision detector, minutes on a 2-core CPU).
COMPILED = ("diffusion", "lra", "classification", "segment")


@pytest.mark.slow
@pytest.mark.filterwarnings(r"ignore:Using `torch\.compile\(module\)` when there are global hooks")
@pytest.mark.parametrize("task", COMPILED)
def test_compile_trains_the_compiled_model(task, data, tmp_path_factory, tmp_path):
    """Compiled, the model runs as plain torch modules (the CPU backend's fused ones are not traced) whose float32
    sums may round otherwise; AdamW can turn that rounding of a near-zero gradient into an update of up to its
    learning rate, so the weights agree as two trainings that differ by rounding do (tolerances.assert_trainings_agree:
    2 steps at rates up to 3e-3, the drift bound of the largest of these tasks' betas)."""
    plain, _ = baseline(task, data, tmp_path_factory)
    torch._dynamo.reset()
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    weights, _ = run(task, data, tmp_path / "run", TASKS[task][1][0], "eager")
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > before  # dynamo captured the model's graphs
    assert weights.keys() == plain.keys()  # no '_orig_mod.' prefix: checkpoints hold the plain model's keys
    assert_trainings_agree(weights, plain, adam_drift_bound([3e-3] * 2, (0.9, 0.999)))


@pytest.mark.parametrize("settings, message", [
    (["train.parallel", "zero"], "train.parallel must be one of ddp, fsdp, got 'zero'"),
    (["train.compile", "no_such_backend"],
     "train.compile: unknown torch.compile mode or backend 'no_such_backend' "
     "(modes: default, reduce-overhead, max-autotune, max-autotune-no-cudagraphs, lite"),
    (["train.compile", "[1]"], "train.compile must be true, false, a torch.compile mode or backend name"),
    (["train.grad_checkpointing", "1"], "train.grad_checkpointing expects bool"),
])
def test_bad_execution_settings_are_one_line(settings, message, tmp_path, capsys):
    argv = [a.replace("{out}", str(tmp_path / "x")) for a in TASKS["diffusion"][0]]
    assert main([*argv, *settings]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


def test_compile_modes_are_inductors(monkeypatch):
    """``train.compile`` takes inductor's modes by name (``reduce-overhead``: the compiled forward and backward
    each replayed as one CUDA graph), backends by name, or true for inductor's default."""
    import torch._inductor

    assert set(COMPILE_MODES) == set(torch._inductor.list_mode_options())
    compiled = []
    monkeypatch.setattr(torch, "compile", lambda model, **options: compiled.append(options) or model)
    for setting in ("reduce-overhead", "max-autotune-no-cudagraphs", True, "aot_eager"):
        check_execution("ddp", setting, False, ("parallel", "compile", "grad_checkpointing"))
        prepare_model(torch.nn.Linear(2, 2), ctx=DistContext(), device=torch.device("cpu"), parallel="ddp",
                      compile=setting, grad_checkpointing=False, amp_dtype=None)
    assert compiled == [{"backend": "inductor", "mode": "reduce-overhead"},
                        {"backend": "inductor", "mode": "max-autotune-no-cudagraphs"}, {"backend": "inductor"},
                        {"backend": "aot_eager"}]


def test_fsdp_is_refused_where_the_task_does_not_shard(tmp_path, capsys):
    argv = [a.replace("{out}", str(tmp_path / "x")) for a in TASKS["segment"][0]]
    assert main([*argv, "train.parallel", "fsdp"]) == 2
    err = capsys.readouterr().err
    assert "train.parallel fsdp is not supported for detection and segmentation models: use ddp" in err, err

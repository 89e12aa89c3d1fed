"""Every engine option, declared once: its name, type, range or choices, default and meaning.

An engine option is a setting of how a run trains that the training commands share: its length (steps or epochs),
batch, learning rate, weight decay, warm-up, seed, loader workers, precision, parallelism, compilation, gradient
checkpointing, clipping, weight EMA, checkpoint and log cadence. :data:`OPTIONS` declares each once, and everything
else reads that declaration:

- every task's configuration tree: the ``train`` section of the lower-case trees (:func:`train_section`, which
  :func:`polaformer.engine.steps.train_defaults` returns), and classification's official upper-case tree, where an
  option lives at its ``official`` key (``DATA.BATCH_SIZE``, ``TRAIN.BASE_LR``; ``TRAIN.<NAME>`` where the official
  code has none). :func:`add_official`, :func:`official_values` and :func:`keyed_values` are the one adapter
  between the official keys and the options;
- the checks of a configuration, once, naming the key (:func:`check_options`);
- every ``train`` command's flag, its type and range, and its help text ending with the key it sets
  (:mod:`polaformer.cli.common`);
- the engine's :class:`~.task.LoopSettings` (:func:`loop_kwargs`) and what a resumed run may change
  (:func:`resumable_keys`).

A task has an option unless the declaration limits it to some tasks (``tasks``) or leaves some out (``not_in``): a
task is named as its ``train`` command's configuration is (``classification``, ``dense``, ``lm``, ``lra``, ``sr``,
``diffusion``, ``convert``). Adding an option is one entry of :data:`OPTIONS` (and, for an option the loop reads, its
:class:`~.task.LoopSettings` field).

This module imports no torch: the command line's parser reads it.
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from .config import COUNT, NON_NEGATIVE, POSITIVE, POSITIVE_INT, SEED, Config, ConfigError, Range

__all__ = ["CLASSIFICATION", "OPTIONS", "Option", "PARALLEL", "REQUIRED", "add_official", "check_options",
           "keyed_values", "loop_kwargs", "official_values", "options_of", "resumable_keys", "section_values",
           "set_values", "train_section"]

CLASSIFICATION = "classification"  # the task whose tree is the official one
PARALLEL = ("ddp", "fsdp")


class _Required:
    """The default of an option every task sets itself (the official tree has it)."""

    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED = _Required()
_NO_CLIPPING = NON_NEGATIVE.but(optional=True, note="0 or null: no clipping")


@dataclass(frozen=True)
class Option:
    """One engine option. ``kind``: ``int``, ``float``, ``bool``, ``str``, ``'number'`` (an int or a float) or
    ``'any'`` (YAML: true, false, null or a name); ``range``/``choices``: the values it takes; ``official``: its key
    in classification's tree, ``switch`` the boolean key there that turns it on; ``loop``: the LoopSettings field it
    sets ('': its name; None: the task reads it); ``zero_off``: 0 means off (the loop gets None); ``may_change``: a
    resumed run may change it (how long or how the run runs, not what it computes); ``flags``: its command-line
    options ('--NAME' when empty); ``or_else``: the option that may replace it (null allowed only where the task has
    that one too)."""

    name: str
    help: str
    kind: Any = int
    default: Any = REQUIRED
    range: Range | None = None
    choices: tuple = ()
    official: str = ""
    switch: str = ""
    tasks: tuple[str, ...] = ()
    not_in: tuple[str, ...] = ()
    loop: str | None = ""
    zero_off: bool = False
    may_change: bool = False
    flags: tuple[str, ...] = ()
    metavar: str | None = None
    or_else: str = ""

    def has(self, task: str | None) -> bool:
        """Whether ``task``'s configuration holds this option (None: a step task with no option of its own)."""
        return (not self.tasks or task in self.tasks) and task not in self.not_in

    def key(self, task: str | None) -> str:
        """Its dotted key in ``task``'s configuration."""
        if task == CLASSIFICATION:
            return self.official or f"TRAIN.{self.name.upper()}"
        return f"train.{self.name}"

    @property
    def loop_field(self) -> str | None:
        return self.name if self.loop == "" else self.loop

    def rule(self, task: str | None) -> Range | None:
        """The range checked in ``task``: null only where the option that may replace it exists."""
        if self.range is None or not self.or_else or _option(self.or_else).has(task):
            return self.range
        return self.range.but(optional=False, note="")

    def describe(self, task: str | None = None) -> str:
        """What follows "must" in an error: ``be a positive integer``, ``be one of ddp, fsdp``..."""
        if self.kind is bool:
            return "be true or false"
        if self.choices:
            return f"be one of {', '.join(self.choices)}"
        rule = self.rule(task)
        return rule.describe() if rule is not None else f"be a {getattr(self.kind, '__name__', self.kind)}"

    def accepts(self, value: Any, task: str | None = None) -> bool:
        if self.kind is bool:
            return isinstance(value, bool)
        if self.choices:
            return value in self.choices
        rule = self.rule(task)
        return rule is None or rule.accepts(value)


OPTIONS: tuple[Option, ...] = (
    Option("steps", "optimizer steps", range=POSITIVE_INT.but(optional=True, note="null: from the epochs"),
           not_in=(CLASSIFICATION,), may_change=True, metavar="N", or_else="epochs"),
    Option("epochs", "passes over the training set", kind="number",
           range=POSITIVE.but(optional=True, note="null: from the steps"), tasks=(CLASSIFICATION, "dense"),
           official="TRAIN.EPOCHS", may_change=True, metavar="N", or_else="steps"),
    Option("start_epoch", "epoch to start from (the schedule counts the earlier ones)", default=0, range=COUNT,
           tasks=(CLASSIFICATION,), official="TRAIN.START_EPOCH", may_change=True, metavar="N"),
    Option("batch_size", "examples per batch of each process", range=POSITIVE_INT, official="DATA.BATCH_SIZE",
           metavar="B"),
    Option("accumulation_steps", "batches per optimizer step (gradient accumulation)", default=1,
           range=COUNT.but(note="0 or 1: none"), official="TRAIN.ACCUMULATION_STEPS", metavar="N"),
    Option("lr", "peak learning rate", kind=float, range=POSITIVE, official="TRAIN.BASE_LR", loop=None, metavar="LR"),
    Option("weight_decay", "weight decay", kind=float, default=0.0, range=NON_NEGATIVE, official="TRAIN.WEIGHT_DECAY",
           loop=None, metavar="WD"),
    Option("warmup_steps", "linear warm-up steps", default=0, range=COUNT, tasks=("convert", "dense", "lm", "lra"),
           loop=None, metavar="N"),
    Option("warmup_epochs", "linear warm-up, in epochs", range=COUNT, tasks=(CLASSIFICATION,),
           official="TRAIN.WARMUP_EPOCHS", loop=None, metavar="N"),
    Option("eval_every", "evaluate every N steps", default=None,
           range=POSITIVE_INT.but(optional=True, note="null: at the end only"), not_in=(CLASSIFICATION,),
           may_change=True, metavar="N"),
    Option("save_every", "also write the last checkpoint every N steps", default=0,
           range=COUNT.but(note="0: only when evaluating"), official="TRAIN.SAVE_FREQ_STEPS",
           loop="save_every_steps", may_change=True, metavar="N"),
    Option("save_every_epochs", "epochs between last checkpoints (the last epoch always)", default=1,
           range=POSITIVE_INT, tasks=(CLASSIFICATION,), official="SAVE_FREQ", may_change=True, metavar="N"),
    Option("seed", "seed of initialisation, data order and augmentation", default=0, range=SEED, official="SEED",
           metavar="S"),
    Option("num_workers", "data loading processes", default=0, range=COUNT, official="DATA.NUM_WORKERS",
           may_change=True, flags=("--workers",), metavar="N"),
    Option("pin_memory", "page-locked batches for the copy to the GPU", kind=bool, default=True,
           official="DATA.PIN_MEMORY", may_change=True),
    Option("amp", "mixed precision: bfloat16 on the CPU, amp_dtype on CUDA", kind=bool, default=False,
           official="AMP"),
    Option("amp_dtype", "mixed precision on CUDA: float16 (with a GradScaler) or bfloat16", kind=str,
           default="float16", choices=("float16", "bfloat16"), official="AMP_DTYPE", loop="amp_cuda_dtype"),
    Option("parallel", "under torchrun: ddp (each process holds the model) or fsdp (each holds a shard)", kind=str,
           default="ddp", choices=PARALLEL, official="TRAIN.PARALLEL", may_change=True),
    Option("compile", "torch.compile: false or null off, true inductor, an inductor mode (reduce-overhead: CUDA "
           "graphs), or a backend name", kind="any", default=None, official="TRAIN.COMPILE", may_change=True,
           metavar="BACKEND"),
    Option("grad_checkpointing", "recompute each block's activations in the backward pass", kind=bool,
           default=False, official="TRAIN.USE_CHECKPOINT", may_change=True,
           flags=("--grad-checkpointing", "--use-checkpoint")),
    Option("find_unused_parameters", "DDP's find_unused_parameters", kind=bool, default=False,
           official="TRAIN.FIND_UNUSED_PARAMETERS"),
    Option("clip_grad_norm", "clip the gradients' norm to this", kind=float, default=None, range=_NO_CLIPPING,
           official="TRAIN.CLIP_GRAD", zero_off=True, flags=("--clip-grad-norm", "--clip-grad"), metavar="NORM"),
    Option("clip_grad_value", "clip every gradient element to [-V, V]", kind=float, default=None, range=_NO_CLIPPING,
           zero_off=True, metavar="V"),
    Option("ema_decay", "decay of a weight EMA evaluated beside the weights", kind=float, default=0.0,
           range=Range(low=0, high=1, high_open=True, note="0: no EMA"),
           official="TRAIN.EMA.DECAY", switch="TRAIN.EMA.ENABLE", zero_off=True, metavar="D"),
    Option("print_freq", "batches between log lines", default=0, range=COUNT.but(note="0: none"),
           official="PRINT_FREQ", may_change=True, metavar="N"),
)


def _option(name: str) -> Option:
    for option in OPTIONS:
        if option.name == name:
            return option
    raise KeyError(f"no engine option {name!r} (options: {', '.join(option.name for option in OPTIONS)})")


def options_of(task: str | None) -> Iterator[Option]:
    """The options ``task``'s configuration holds, in the order of :data:`OPTIONS`."""
    return (option for option in OPTIONS if option.has(task))


def train_section(task: str | None, values: Mapping[str, Any]) -> dict:
    """A lower-case task's ``train`` section: each of its options at the task's value (``values``) or its default,
    then the task's own keys (the other ``values``)."""
    values = dict(values)
    section = {}
    for option in options_of(task):
        if option.name in values:
            section[option.name] = values.pop(option.name)
        elif option.default is REQUIRED:
            raise TypeError(f"the {task or 'step'} task gives no value of the engine option {option.name!r}")
        else:
            section[option.name] = option.default
    foreign = [name for name in values if any(option.name == name for option in OPTIONS)]
    if foreign:
        raise TypeError(f"the engine option {foreign[0]!r} is not one of the {task or 'step'} task's")
    return {**section, **values}


def add_official(tree: dict) -> dict:
    """The official tree (nested dicts) with every classification option the official code lacks at its key."""
    for option in options_of(CLASSIFICATION):
        *parents, leaf = option.key(CLASSIFICATION).split(".")
        node = tree
        for name in parents:
            node = node.setdefault(name, {})
        if leaf not in node:
            if option.default is REQUIRED:
                raise TypeError(f"the official tree has no {option.key(CLASSIFICATION)} for {option.name!r}")
            node[leaf] = option.default
    return tree


def _get(cfg: Config | Mapping, dotted: str) -> Any:
    node: Any = cfg
    for part in dotted.split("."):
        node = node[part]
    return node


def official_values(cfg: Config) -> dict[str, Any]:
    """The value of every classification option in the official tree ``cfg`` (an option its ``switch`` turns off
    is None)."""
    values = {}
    for option in options_of(CLASSIFICATION):
        value = _get(cfg, option.key(CLASSIFICATION))
        values[option.name] = value if not option.switch or _get(cfg, option.switch) else None
    return values


def section_values(train: Config | Mapping) -> dict[str, Any]:
    """The value of every option a lower-case ``train`` section holds."""
    return {option.name: train[option.name] for option in OPTIONS if option.name in train}


def keyed_values(task: str | None, values: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """The ``(key, value)`` pairs that set the options ``values`` (``{name: value}``, None values skipped) in
    ``task``'s tree; in the official tree an option with a ``switch`` sets it too (off for 0)."""
    pairs = []
    for name, value in values.items():
        if value is None:
            continue
        option = _option(name)
        if task == CLASSIFICATION and option.switch:
            pairs.append((option.switch, value != 0))
            if value == 0:
                continue
        pairs.append((option.key(task), value))
    return pairs


def set_values(cfg: Config, task: str | None, values: Mapping[str, Any], source: str = "the command line") -> None:
    """Set the options ``values`` (``{name: value}``, None values skipped) in ``task``'s tree ``cfg``
    (:func:`keyed_values`), naming ``source`` in an error."""
    for key, value in keyed_values(task, values):
        cfg.set_path(key, value, source=source)


def check_options(cfg: Config, task: str | None, error: type[Exception] = ConfigError, *,
                  unsharded: str | None = None) -> None:
    """Every option of ``task``'s tree ``cfg`` (classification's official one, or a tree with a ``train``
    section) against its declaration, one line naming the key; ``unsharded``: the task's models, when it does not
    train them with ``parallel: fsdp``."""
    keys = {option.name: option.key(task) for option in options_of(task)}
    values = {name: _get(cfg, key) for name, key in keys.items() if _has(cfg, key)}  # an option switched off too
    for name, value in values.items():
        option = _option(name)
        if not option.accepts(value, task):
            raise error(f"{keys[name]} must {option.describe(task)}, got {value!r}")
    execution = ("parallel", "compile", "grad_checkpointing")
    if all(name in values for name in execution):
        from .parallel import check_execution  # a backend's name is checked against torch's list

        try:
            check_execution(*(values[name] for name in execution), tuple(keys[name] for name in execution))
        except ConfigError as e:
            raise error(str(e)) from None
        if unsharded and values["parallel"] == "fsdp":
            raise error(f"{keys['parallel']} fsdp is not supported for {unsharded}: use ddp")


def _has(cfg: Config | Mapping, dotted: str) -> bool:
    try:
        _get(cfg, dotted)
    except KeyError:
        return False
    return True


def loop_kwargs(values: Mapping[str, Any]) -> dict[str, Any]:
    """The :class:`~.task.LoopSettings` fields the options ``values`` (``{name: value}``) set."""
    kwargs = {}
    for name, value in values.items():
        option = _option(name)
        if option.loop_field is not None:
            kwargs[option.loop_field] = (value or None) if option.zero_off else value
    return kwargs


def resumable_keys(task: str | None) -> tuple[str, ...]:
    """The keys of ``task``'s options a resumed run may change (how long and how the run runs)."""
    return tuple(option.key(task) for option in options_of(task) if option.may_change)

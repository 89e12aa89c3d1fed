"""The engine in parts (issue 53): no class of polaformer/engine/ over 300 lines, the loop module holding the loop
and the run's state (folder, resume, saving) in modules of their own, the names it held still importable from it."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ENGINE = Path(__file__).resolve().parents[2] / "polaformer" / "engine"
MAX_CLASS_LINES = 300


def _classes():
    for path in sorted(ENGINE.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                yield path.name, node.name, node.end_lineno - node.lineno + 1


def test_the_walk_sees_the_engine_classes():
    names = {name for _, name, _ in _classes()}
    assert {"Engine", "Task", "LoopSettings", "RunFolder", "Config"} <= names


@pytest.mark.parametrize("module, name, lines", list(_classes()))
def test_no_engine_class_is_over_300_lines(module, name, lines):
    assert lines <= MAX_CLASS_LINES, f"{module}: class {name} has {lines} lines"


def _defined(module: str) -> set[str]:
    tree = ast.parse((ENGINE / module).read_text())
    return {node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))}


def test_the_loop_module_holds_the_loop_and_the_state_lives_apart():
    assert _defined("loop.py") >= {"Engine", "train"}
    assert _defined("resume.py") >= {"find_resume", "check_same_settings", "restore"}
    assert _defined("state.py") >= {"save", "training_state", "rng_state"}
    assert "RunFolder" in _defined("folder.py")
    assert not _defined("loop.py") & (_defined("resume.py") | _defined("state.py") | _defined("folder.py"))


def test_the_names_of_the_loop_module_still_import_from_it():
    from polaformer.engine import loop, resume, state, task

    assert (loop.Task, loop.LoopSettings, loop.StepOutput) == (task.Task, task.LoopSettings, task.StepOutput)
    assert (loop.Window, loop.seed_everything, loop.flat_settings) == (state.Window, state.seed_everything,
                                                                       resume.flat_settings)

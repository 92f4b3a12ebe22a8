"""One exception hierarchy: every public error lives in checkpointless.errors."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

import checkpointless
from checkpointless import errors

PACKAGE = Path(checkpointless.__file__).parent


def test_no_public_exception_class_outside_errors_module() -> None:
    strays = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "errors.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                bases = {b.id for b in node.bases if isinstance(b, ast.Name)}
                if bases & {"Exception", "BaseException", "RuntimeError", "ValueError", "OSError"} or any(
                    b.endswith("Error") for b in bases
                ):
                    strays.append(f"{path.relative_to(PACKAGE)}:{node.name}")
    assert strays == []


def test_every_error_has_the_root_except_the_interrupt_and_the_dismissal() -> None:
    classes = [c for _, c in inspect.getmembers(errors, inspect.isclass) if c.__module__ == errors.__name__]
    assert len(classes) >= 10
    for cls in classes:
        if cls in (errors.JobInterrupted, errors.Dismissed):
            # except Exception in a callback cannot eat Ctrl-C, nor keep a process let go training
            assert not issubclass(cls, Exception)
        else:
            assert issubclass(cls, errors.CheckpointlessError), cls


@pytest.mark.parametrize(
    ("module", "name"),
    [
        ("checkpointless.comm", "CollectiveError"),
        ("checkpointless.state", "IntegrityError"),
        ("checkpointless.session", "FatalError"),
        ("checkpointless.control.plan", "PlanError"),
        ("checkpointless.control.coordinator", "JobFailed"),
        ("checkpointless.control.client", "JobStopped"),
        ("checkpointless.launch.store", "LaunchError"),
        ("checkpointless.recipes.config", "RecipeError"),
        ("checkpointless.faults", "InjectedFault"),
    ],
)
def test_old_import_paths_name_the_same_class(module: str, name: str) -> None:
    mod = __import__(module, fromlist=[name])
    assert getattr(mod, name) is getattr(errors, name)


def test_user_input_errors_are_one_line_exit_2() -> None:
    from checkpointless.cli import main

    # a recipe error raised deep in the loader reaches the user as one line, exit 2
    assert issubclass(errors.RecipeError, errors.UserInputError)
    assert issubclass(errors.LaunchError, errors.UserInputError)
    assert main(["run", "/nonexistent/recipe.yaml"]) == 2


class _BrokenGroup:
    def __init__(self, exc: Exception) -> None:
        self.exc = exc

    def allreduce(self, tensors: list[object]) -> object:
        raise self.exc


def test_a_collective_failure_is_a_collective_error_and_a_bug_is_not() -> None:
    """Only what the backend raises (RuntimeError, torch's DistError) means a peer is gone."""
    import torch

    from checkpointless.comm import Group

    group = Group.wrap(_BrokenGroup(RuntimeError("Connection closed by peer")), 3, 0, 1)
    with pytest.raises(errors.CollectiveError, match="gen 3: allreduce failed: Connection closed"):
        group.allreduce_([torch.zeros(1)])
    group.pg = _BrokenGroup(TypeError("allreduce(): incompatible function arguments"))
    with pytest.raises(TypeError):
        group.allreduce_([torch.zeros(1)])

"""The code base passes ruff's lint and format checks (configured in pyproject.toml)."""

import ast
import subprocess
import sys

import pytest

from tests.conftest import ROOT


def test_ruff_check_and_format():
    for args in (["check", "."], ["format", "--check", "."]):
        result = subprocess.run(
            [sys.executable, "-m", "ruff", *args], cwd=ROOT, capture_output=True, text=True
        )
        assert result.returncode == 0, result.stdout + result.stderr


def _private_members_of_the_core() -> set[str]:
    """The private names the library core defines on its classes (methods, and attributes set on self)."""
    names = set()
    for path in (ROOT / "mixhook").rglob("*.py"):
        if {"app", "integrations"} & set(path.relative_to(ROOT / "mixhook").parts):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                for item in ast.walk(node):
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        names.add(item.name)
                    elif isinstance(item, ast.Attribute) and ast.unparse(item.value) == "self":
                        names.add(item.attr)
    return {n for n in names if n.startswith("_") and not n.endswith("__")}


def test_the_adapters_and_the_app_use_the_cores_public_api_only():
    """No adapter or app module reads or sets a private member of the core's objects (it would break
    silently when the engine changes): what they need is public (draw_for, unpin, seed_per_rank, ...)."""
    private = _private_members_of_the_core()
    found = []
    for folder in ("integrations", "app"):
        for path in (ROOT / "mixhook" / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if (
                    isinstance(node, ast.Attribute)
                    and node.attr in private
                    and ast.unparse(node.value) not in ("self", "cls")
                ):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert not found, found


@pytest.mark.slow
def test_no_core_module_reads_another_modules_private_members():
    """Inside the core, a module reads only its own classes' private members: a collaborator (padding
    masks, the gradient pass, the compiled path) gets what it needs as public members or as callables its
    owner hands it, so that each module can change without another breaking silently."""
    import torch

    core = [
        path
        for path in (ROOT / "mixhook").rglob("*.py")
        if not {"app", "integrations"} & set(path.relative_to(ROOT / "mixhook").parts)
    ]
    trees = {path: ast.parse(path.read_text()) for path in core}
    owners: dict[str, set] = {}
    for path, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                for item in ast.walk(node):
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        owners.setdefault(item.name, set()).add(path)
                    elif isinstance(item, ast.Attribute) and ast.unparse(item.value) == "self":
                        owners.setdefault(item.attr, set()).add(path)
    found = []
    for path, tree in trees.items():
        for node in ast.walk(tree):
            name = None
            if isinstance(node, ast.Attribute) and ast.unparse(node.value) not in ("self", "cls"):
                name = node.attr
            elif (
                isinstance(node, ast.Call)
                and ast.unparse(node.func) in ("getattr", "setattr", "hasattr")
                and len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant)
                and ast.unparse(node.args[0]) not in ("self", "cls")
            ):
                name = node.args[1].value
            if (
                isinstance(name, str)
                and name.startswith("_")
                and not name.endswith("__")
                and name in owners
                and path not in owners[name]
                and not hasattr(torch.Tensor, name)  # (torch's own, e.g. a view's _base)
            ):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert not found, found


def test_the_engines_modules_import_one_another_one_way_only():
    """Issue 57: no import circle in mixhook/engine (type-only imports under TYPE_CHECKING included): each
    module can be read, and changed, knowing what it stands on."""
    engine = ROOT / "mixhook" / "engine"
    names = {path.stem for path in engine.glob("*.py")}
    imports: dict[str, set] = {}
    for path in engine.glob("*.py"):
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                found.update([node.module.split(".")[0]] if node.module else [a.name for a in node.names])
        imports[path.stem] = found & names
    done: set = set()

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            raise AssertionError(" -> ".join([*path[path.index(module) :], module]))
        if module not in done:
            for other in sorted(imports[module]):
                visit(other, [*path, module])
            done.add(module)

    for module in sorted(imports):
        visit(module, [])


_DRAWS = {"rand", "randn", "randint", "randperm"}


def test_a_draw_from_a_given_generator_is_made_on_its_device():
    """A tensor drawn from a generator the user may have put on a GPU names that generator's device:
    torch refuses a CUDA generator for a CPU draw ("Expected a 'cpu' device type for generator"), which
    FMix, PuzzleMix, OneOf and timm's adapter did on the first GPU run, where no CPU test could see it.
    The app's data samplers draw from CPU generators they make themselves, so the app is left out."""
    found = []
    for path in (ROOT / "mixhook").rglob("*.py"):
        if "app" in path.relative_to(ROOT / "mixhook").parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            names = {k.arg for k in node.keywords}
            if node.func.attr in _DRAWS and "generator" in names and "device" not in names:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert not found, found

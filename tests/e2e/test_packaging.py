"""The two layers of the package: the library core imports and works with torch alone (the app's
dependencies made unimportable; the trainer adapters then refuse in one line naming the extra), and the
app, built into a wheel, carries its configs so the layer browser works from the installed files outside
a checkout."""

import json
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from harness.readme import quoted_block
from tests.conftest import ROOT

pytestmark = pytest.mark.process  # each test's property is a fresh interpreter or the built wheel

# what the app and the tests use, none of which the core may need
BLOCKED = ("hydra", "omegaconf", "torchvision", "sklearn", "matplotlib", "tqdm", "yaml", "numpy", "scipy",
           "timm", "transformers", "tensorboard", "optuna", "submitit", "lightning",
           "accelerate")  # fmt: skip
# the modules that import what an extra installs (the trainer adapters their framework, Co-Mixup's kernels
# numba): without it, one ImportError naming the extra
ADAPTERS = {
    "mixhook.integrations.lightning": "integrations",
    "mixhook.integrations.transformers": "integrations",
    "mixhook.integrations.lm": "integrations",
    "mixhook.solvers.swap_kernels": "comixup",
}

BLOCKER = f"""
import importlib.abc, sys, warnings
warnings.filterwarnings("ignore", "Failed to initialize NumPy")
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {BLOCKED!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}} (blocked)", name=name)
sys.meta_path.insert(0, Block())
"""

CORE_USE = """
import pkgutil, importlib, sys, torch, torch.nn.functional as F
from torch import nn
import mixhook
core, adapters = [], {adapters!r}
def walk(package):  # every module of the core, the app's package never entered
    for m in pkgutil.iter_modules(package.__path__, package.__name__ + "."):
        if m.name == "mixhook.app" or m.name.endswith("__main__"):
            continue
        if m.name in adapters:
            try:
                importlib.import_module(m.name)
            except ImportError as error:
                assert f"pip install 'mixhook[{adapters[m.name]}]'" in str(error), error
            else:
                raise AssertionError(m.name + " imported without its framework")
            continue
        core.append(m.name)
        module = importlib.import_module(m.name)
        if m.ispkg:
            walk(module)
walk(mixhook)
model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)).train()
mix = mixhook.ManifoldMixup("1", generator=torch.Generator().manual_seed(0))
stats = mixhook.ActivationStats(["0"])
with mixhook.attach(model, mix, mixhook.GradScale("2", 0.5), stats):
    x, y = torch.randn(6, 4), torch.randint(0, 3, (6,))
    mix.loss(F.cross_entropy, model(x), y).backward()
assert mix.last is not None and stats.rows(), "nothing mixed or recorded"
leaked = sorted(m for m in sys.modules if m.startswith("mixhook.app") or m.split(".")[0] in {blocked!r})
print(len(core), "core modules;", "leaked:", leaked)
"""


# One process with the app's dependencies blocked runs each part below in turn (its own globals, its stdout
# and stderr caught, its exit status kept) and prints what each did as JSON: the tests of this module read
# their part. A process is what these test (what imports with torch alone), and one start does for all.
DRIVER = """
import contextlib, io, json, sys, traceback
found = {}
for name, code in json.loads(sys.argv[1]).items():
    out, err, status = io.StringIO(), io.StringIO(), 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            exec(compile(code, name, "exec"), {"__name__": "__main__"})
        except SystemExit as exit:  # (as the interpreter ends on it)
            status = exit.code if isinstance(exit.code, int) else 0 if exit.code is None else 1
            if isinstance(exit.code, str):
                print(exit.code, file=sys.stderr)
        except BaseException:
            traceback.print_exc()
            status = 1
    found[name] = {"returncode": status, "stdout": out.getvalue(), "stderr": err.getvalue()}
print(json.dumps(found))
"""


@pytest.fixture(scope="module")
def torch_alone(tmp_path_factory):
    """What each part did in one process where the app's dependencies cannot be imported: ``{part: its
    returncode, stdout and stderr}``."""
    report_dir = tmp_path_factory.mktemp("report")
    parts = {
        "core": CORE_USE.replace("{blocked!r}", repr(BLOCKED)).replace("{adapters!r}", repr(ADAPTERS)),
        "layer_browser": "import sys, mixhook_cli; sys.argv = ['mixhook-layers']; mixhook_cli.layers()",
        "train": "import sys, mixhook_cli; sys.argv = ['mixhook-train']; mixhook_cli.train()",
        "readme": readme_block("**Manifold Mixup in your own loop.**"),
        "report": f"import runpy, sys; sys.argv = ['report', {str(report_dir)!r}]; "
        "runpy.run_module('mixhook.app.report', run_name='__main__')",
    }
    result = subprocess.run(
        [sys.executable, "-c", BLOCKER + DRIVER, json.dumps(parts)], capture_output=True, text=True, cwd=ROOT
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return {name: SimpleNamespace(**part) for name, part in json.loads(result.stdout).items()}


@pytest.mark.slow
def test_the_core_imports_and_trains_with_torch_alone(torch_alone):
    result = torch_alone["core"]  # (the first part: nothing of the core imported before it)
    assert result.returncode == 0, result.stderr
    count, _, leaked = result.stdout.strip().partition(" core modules; leaked: ")
    assert int(count) >= 10 and leaked == "[]", result.stdout


@pytest.mark.slow
def test_the_layer_browser_without_the_app_says_what_to_install(torch_alone):
    for part, command in (("layer_browser", "mixhook-layers"), ("train", "mixhook-train")):
        result = torch_alone[part]
        assert result.returncode == 2
        assert result.stderr.strip().splitlines() == [
            f"error: {command} is part of the experiment app, which needs hydra: pip install 'mixhook[app]'"
        ]


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """The wheel built from a copy of the sources and installed by pip into a fresh virtual environment
    outside any checkout, its dependencies this environment's (the app extra's: a further copy of torch
    would take minutes and gigabytes): ``(the environment's bin folder, a working folder elsewhere)``."""
    tmp = tmp_path_factory.mktemp("wheel")
    source = tmp / "source"  # a copy: building writes build/ and *.egg-info beside the sources
    for package in ("mixhook", "mixhook_cli"):
        shutil.copytree(ROOT / package, source / package, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
         str(tmp / "dist"), str(source)],
        check=True, capture_output=True,
    )  # fmt: skip
    (wheel,) = (tmp / "dist").glob("mixhook-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "mixhook/app/conf/config.yaml" in names and "mixhook_cli/__init__.py" in names
    assert "mixhook/app/conf/experiment/_recipes/verma2019.yaml" in names
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "mixhook-train = mixhook_cli:train" in zipfile.ZipFile(wheel).read(entry_points).decode()
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True)
    python = venv / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    # this environment's packages after the new one's own (its .pth files, an editable mixhook's, not run)
    (Path(purelib) / "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
        check=True, capture_output=True,
    )  # fmt: skip
    elsewhere = tmp / "elsewhere"
    elsewhere.mkdir()
    where = subprocess.run(
        [str(python), "-c", "import mixhook, mixhook_cli; print(mixhook.__file__, mixhook_cli.__file__)"],
        capture_output=True, text=True, cwd=elsewhere, check=True,
    )  # fmt: skip
    assert all(path.startswith(purelib) for path in where.stdout.split()), where.stdout
    return venv / "bin", elsewhere


QUICK = ["trainer.epochs=1", "data.train_size=200", "trainer.progress_bar=false"]


@pytest.mark.slow
def test_the_installed_commands_train_sweep_browse_and_refuse_outside_a_checkout(installed):
    """Issue 98: ``pip install 'mixhook[app]'`` gives ``mixhook-train`` (what ``python train.py`` does: a
    run, a sweep with its report, exit 2 and one line for a bad override) and ``mixhook-layers``, run from
    the installed files in a folder that is no checkout."""
    bin_dir, elsewhere = installed

    def command(name, *args):
        return subprocess.run(
            [str(bin_dir / name), *args], capture_output=True, text=True, cwd=elsewhere, timeout=600
        )

    run = command("mixhook-train", *QUICK, "hydra.run.dir=one")
    assert run.returncode == 0, run.stderr[-2000:]
    summary = json.loads((elsewhere / "one" / "summary.json").read_text())
    assert summary["task"] == "classification" and 0 <= summary["test_acc"] <= 1
    assert (elsewhere / "one" / "train.log").is_file()  # (the job's name: the same as python train.py's)
    sweep = command("mixhook-train", "-m", "seed=0,1", *QUICK, "hydra.sweep.dir=sweep")
    assert sweep.returncode == 0, sweep.stderr[-2000:]
    assert sorted(p.parent.name for p in (elsewhere / "sweep").glob("*/summary.json")) == ["0", "1"]
    assert (elsewhere / "sweep" / "summary.md").is_file()  # (the sweep's report)
    bad = command("mixhook-train", "mixup.alpha=-1")
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
    assert bad.stderr.startswith("error: ") and "alpha" in bad.stderr
    listing = command("mixhook-layers", "mixup=cutmix")
    assert listing.returncode == 0 and listing.stderr == "", listing.stderr  # (the listing alone)
    assert listing.stdout.startswith("PreActResNet on a digits batch of shape (2, 1, 8, 8):")
    assert "layer4.0.shortcut" in listing.stdout
    help_ = command("mixhook-layers", "--help")
    assert help_.returncode == 0 and help_.stdout.startswith("usage: mixhook-layers [OVERRIDE ...]")


def readme_block(heading: str) -> str:
    """The first ```python block under ``heading`` in README.md."""
    return "\n".join(quoted_block(heading, language="python"))


@pytest.mark.slow
def test_the_readmes_first_library_example_runs_with_torch_alone(torch_alone):
    code = readme_block("**Manifold Mixup in your own loop.**")
    assert "import torch" in code and "mix.attach(model)" in code
    result = torch_alone["readme"]
    assert result.returncode == 0, result.stderr[-3000:]
    layer, lam, index = result.stdout.split(" ", 2)
    assert layer in ("input", "layer1", "layer2") and 0 < float(lam) < 1 and len(eval(index)) == 8


@pytest.mark.slow
def test_importing_the_core_prints_nothing_and_numpy_comes_with_it():
    # torch warns "Failed to initialize NumPy" when numpy is missing: the core's install brings it
    from importlib.metadata import requires

    assert any(r.split(";")[0].strip() == "numpy" for r in requires("mixhook"))
    result = subprocess.run(
        [sys.executable, "-W", "error", "-c", "import mixhook"], capture_output=True, text=True, cwd=ROOT
    )
    assert result.returncode == 0 and result.stdout == result.stderr == "", result.stderr


@pytest.mark.slow
def test_the_sweep_report_without_the_app_says_what_to_install(torch_alone):
    result = torch_alone["report"]
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "error: sweep reports are part of the experiment app, which needs matplotlib: "
        "pip install 'mixhook[app]'"
    ]

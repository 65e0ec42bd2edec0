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


def _imports() -> dict[str, dict[str, str]]:
    """Every module of the package (dotted name) and what it imports of the package, type-only and
    function-level imports included: ``{module: {imported module: "path:line"}}``. ``from . import x``
    imports the module ``x``, not its package's ``__init__``; a name that is no module is imported from
    the module (or package) named."""
    modules = {}
    for path in (ROOT / "mixhook").rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, dict[str, str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        found: dict[str, str] = {}
        for node in ast.walk(ast.parse(path.read_text())):
            where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in modules]
                if len(subs) < len(node.names):
                    subs.append(target)
                found.update({m: where for m in subs if m in modules and m != name})
            elif isinstance(node, ast.Import):
                found.update({a.name: where for a in node.names if a.name in modules and a.name != name})
        graph[name] = found
    return graph


def _first_circle(graph: dict[str, dict[str, str]]) -> str | None:
    """One circle of ``graph`` as its imports (``a -> b (path:line) -> a (path:line)``), or ``None``."""
    done: set = set()

    def visit(node: str, path: list[str]) -> str | None:
        if node in path:
            loop = [*path[path.index(node) :], node]
            return " -> ".join(
                [loop[0], *(f"{b} ({graph[a][b]})" for a, b in zip(loop, loop[1:], strict=False))]
            )
        if node in done:
            return None
        for other in sorted(graph.get(node, {})):
            found = visit(other, [*path, node])
            if found:
                return found
        done.add(node)
        return None

    for node in sorted(graph):
        found = visit(node, [])
        if found:
            return found
    return None


def test_the_package_imports_one_way_only_module_by_module_and_room_by_room():
    """Issues 57 and 83: no import circle between the package's modules (function-level and type-only
    imports included), nor between its rooms (a subpackage, or a module of the package's top level), so
    every room stands on the floors below it and each module can be read, and changed, knowing what it
    stands on. No arrow points up: the layer browser's command lives beside the package
    (``mixhook_cli``, ``mixhook-layers``), not in ``mixhook.layers``. A circle is named import by import."""
    graph = _imports()
    assert not [m for m in graph if m.endswith("__main__")], "a command inside the package's rooms"
    circle = _first_circle(graph)
    assert circle is None, f"an import circle: {circle}"

    def room(module: str) -> str:
        return module.split(".")[1] if "." in module else module

    rooms: dict[str, dict[str, str]] = {}
    for module, out in graph.items():
        for other, where in out.items():
            if room(other) != room(module):
                rooms.setdefault(room(module), {}).setdefault(room(other), where)
    circle = _first_circle(rooms)
    assert circle is None, f"an import circle between rooms: {circle}"


def test_the_import_check_names_a_circle_import_by_import():
    """The check above, shown able to fail: a circle of two modules named with the lines that close it."""
    graph = {"a": {"b": "a.py:3"}, "b": {"c": "b.py:4"}, "c": {"a": "c.py:5"}, "d": {"a": "d.py:1"}}
    assert _first_circle(graph) == "a -> b (a.py:3) -> c (b.py:4) -> a (c.py:5)"
    assert _first_circle({"a": {"b": "a.py:1"}, "b": {}}) is None


_DRAWS = {"rand", "randn", "randint", "randperm"}


def test_a_draw_from_a_given_generator_is_made_on_its_device():
    """A tensor drawn from a generator the user may have put on a GPU names that generator's device:
    torch refuses a CUDA generator for a CPU draw ("Expected a 'cpu' device type for generator"), which
    FMix, PuzzleMix, OneOf and timm's adapter did on the first GPU run, where no CPU test could see it.
    The app's data samplers draw from CPU generators they make themselves, so the app is left out."""
    found = []
    for path in (ROOT / "mixhook").rglob("*.py"):
        if "app" in path.relative_to(ROOT / "mixhook").parts or path.name == "__main__.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            names = {k.arg for k in node.keywords}
            if node.func.attr in _DRAWS and "generator" in names and "device" not in names:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert not found, found


def _assigned(node: ast.AST) -> set[str]:
    """The attributes of ``self`` an assignment ``node`` sets (tuples unpacked)."""
    targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
    names = set()
    for target in targets:
        for t in target.elts if isinstance(target, ast.Tuple) else [target]:
            if isinstance(t, ast.Attribute) and ast.unparse(t.value) == "self":
                names.add(t.attr)
    return names


def _set_in(cls: type, name: str, seen: set) -> set[str]:
    """The attributes of ``self`` that ``cls.name`` sets, with the methods it calls on ``self`` and the
    ``_fresh`` of ``super()`` (read from the source)."""
    import inspect
    import textwrap

    function = getattr(cls, name, None)
    if function is None or name in seen or not inspect.isfunction(function):
        return set()
    seen.add(name)
    found = set()
    for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(function)))):
        found |= _assigned(node)
        if isinstance(node, ast.Call) and ast.unparse(node.func).startswith("self."):
            found |= _set_in(cls, node.func.attr, seen)
        if isinstance(node, ast.Call) and ast.unparse(node.func) == "super()._fresh":
            base = next(b for b in cls.__mro__[1:] if "_fresh" in vars(b))
            found |= _set_in(base, "_fresh", set())
    return found


def test_what_fresh_sets_is_what_a_copy_leaves_out():
    """Issue 83: a hook's per-attachment state is what its ``_fresh`` sets, and what a copy (deepcopy,
    pickle, a spawned worker) leaves out is its classes' ``_TRANSIENT``: the two are one list, held here for
    every class of the package that has a ``_fresh`` (read from the code: ``self.x = ...`` in ``_fresh`` or
    a method it calls on ``self``), so a new piece of state cannot be forgotten by a copy (a copy that kept
    ``_sharded`` would think a model sharded that is not)."""
    import importlib
    import inspect

    classes = set()
    for path in (ROOT / "mixhook").rglob("*.py"):
        if "app" in path.relative_to(ROOT / "mixhook").parts or path.name == "__main__.py":
            continue
        module = importlib.import_module(
            ".".join(path.relative_to(ROOT).with_suffix("").parts).replace(".__init__", "")
        )
        classes |= {c for c in vars(module).values() if inspect.isclass(c) and "_fresh" in vars(c)}
    assert len(classes) >= 7  # (LayerHook, Mixer, AutoMix, OneOf, MomentumCopy, NEFTune, NoiseFiT)
    wrong = {}
    for cls in classes:
        fresh = _set_in(cls, "_fresh", set())
        transient = {name for c in cls.__mro__ for name in vars(c).get("_TRANSIENT", ())}
        if fresh != transient:
            wrong[cls.__qualname__] = {
                "set, not left out": fresh - transient,
                "left out, not set": transient - fresh,
            }
    assert not wrong, wrong


def _reads(tree: ast.AST, of: tuple[str, ...]) -> dict[str, int]:
    """The attributes read in ``tree`` of the objects named ``of`` (``self.mixer``, ``mixer``, ...): name ->
    the first line it is read on."""
    found: dict[str, int] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and ast.unparse(node.value) in of:
            found.setdefault(node.attr, node.lineno)
    return found


def test_the_path_reads_the_method_through_its_public_view_only():
    """Issue 83: the forward path is one object (engine/path.py's ``Path``) that reads of its own object only
    what it defines (no member of the mixer's class, private or not, reached through ``self``), and of the
    mixer only what ``VIEW`` declares: public settings and extension points (issue 97: the state the user
    API shares is the path's own); so do its collaborators (the leaves, the padding masks, the norms, the
    traced path). A new read of a private member of the mixer, or of one that is not declared, fails here."""
    from mixhook.engine.path import VIEW

    view = {name for names in VIEW.values() for name in names}
    assert not [name for name in view if name.startswith("_")]
    engine = ROOT / "mixhook" / "engine"
    tree = ast.parse((engine / "path.py").read_text())
    (path,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Path"]
    defined = {n.name for n in path.body if isinstance(n, ast.FunctionDef)}
    defined |= {
        n.attr
        for n in ast.walk(path)
        if isinstance(n, ast.Attribute) and ast.unparse(n.value) == "self" and isinstance(n.ctx, ast.Store)
    }
    foreign = {k: v for k, v in _reads(path, ("self",)).items() if k not in defined}
    assert not foreign, f"Path reads members it does not define: {foreign}"
    outside = {}
    for name in ("path.py", "leaves.py", "padding_masks.py", "norms.py", "traced.py"):
        reads = _reads(ast.parse((engine / name).read_text()), ("self.mixer", "self._mixer", "mixer"))
        outside.update({f"{name}:{line}: {attr}": attr for attr, line in reads.items() if attr not in view})
    assert not outside, f"read of the mixer outside the path's VIEW: {sorted(outside)}"
    used = set()
    for name in ("path.py", "leaves.py", "padding_masks.py", "norms.py", "traced.py"):
        used |= _reads(ast.parse((engine / name).read_text()), ("self.mixer", "self._mixer", "mixer")).keys()
    assert view <= used, f"VIEW names what nothing reads: {sorted(view - used)}"


_COLLABORATORS = ("path.py", "leaves.py", "padding_masks.py", "norms.py", "traced.py")
_MIXER = ("self.mixer", "self._mixer", "mixer")


def _writes(tree: ast.AST, of: tuple[str, ...]) -> dict[str, int]:
    """The attributes set in ``tree`` on the objects named ``of`` (an assignment, an augmented one, a
    ``del``, or ``setattr(obj, ...)``): name -> the first line."""
    found: dict[str, int] = {}
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.ctx, (ast.Store, ast.Del))
            and ast.unparse(node.value) in of
        ):
            found.setdefault(node.attr, node.lineno)
        elif (
            isinstance(node, ast.Call)
            and ast.unparse(node.func) in ("setattr", "delattr", "object.__setattr__")
            and node.args
            and ast.unparse(node.args[0]) in of
        ):
            found.setdefault(ast.unparse(node.args[1]) if len(node.args) > 1 else "?", node.lineno)
    return found


def _path_reads(tree: ast.AST) -> dict[str, int]:
    """Where ``tree`` reaches a mixer's path (``self._path``, ``mixer._path``, ``getattr(m, "_path")``)."""
    found: dict[str, int] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "_path":
            found.setdefault(ast.unparse(node), node.lineno)
        elif isinstance(node, ast.Constant) and node.value == "_path":
            found.setdefault(repr(node.value), node.lineno)
    return found


def test_the_path_owns_the_attachments_state():
    """Issue 97: an attachment's state has one home, the path. ``VIEW`` is the method's settings and its
    extension points only (no state shared through the mixer); the path and its collaborators write nothing
    on the mixer (its ``last``, ``pins``, its generator swapped for a draw: none); and no method or policy
    reaches into the path (``self._path``): what they need is public (``in_gradient_pass``,
    ``layout_at``, ``current``, ``last``). Each check is shown able to fail on a line that breaks it."""
    from mixhook.engine.path import VIEW

    assert set(VIEW) == {"settings", "extension points"}, sorted(VIEW)
    engine = ROOT / "mixhook" / "engine"
    written = {}
    for name in _COLLABORATORS:
        tree = ast.parse((engine / name).read_text())
        written.update({f"{name}:{line}: {attr}": attr for attr, line in _writes(tree, _MIXER).items()})
    assert not written, f"writes on the mixer from the path: {sorted(written)}"
    reached = {}
    for folder in ("mixers", "policies", "lm"):
        for path in sorted((ROOT / "mixhook" / folder).rglob("*.py")):
            reads = _path_reads(ast.parse(path.read_text()))
            reached.update({f"{path.relative_to(ROOT)}:{line}": what for what, line in reads.items()})
    assert not reached, f"reads of a mixer's path: {sorted(reached)}"
    # what each check would catch
    broken = ast.parse(
        "def _decide(self):\n"
        "    mixer = self.mixer\n"
        "    mixer.last = None\n"
        "    self.mixer.generator, saved = g, self.mixer.generator\n"
        "    setattr(mixer, 'last_forward', None)\n"
    )
    assert set(_writes(broken, _MIXER)) == {"last", "generator", "'last_forward'"}
    reads = _path_reads(ast.parse("running = self._path.gradients.running\nx = getattr(m, '_path')\n"))
    assert set(reads) == {"self._path", "'_path'"}


def _hand_lists(tree: ast.AST, names: set[str]) -> list[tuple[int, frozenset]]:
    """The literal lists, tuples, sets and dict keys in ``tree`` of three or more method names (line, names),
    by line."""
    found = []
    for node in ast.walk(tree):
        items = node.keys if isinstance(node, ast.Dict) else getattr(node, "elts", None)
        if not isinstance(node, ast.List | ast.Tuple | ast.Set | ast.Dict) or not items:
            continue
        named = [i.value for i in items if isinstance(i, ast.Constant) and i.value in names]
        if len(named) >= 3 and len(named) == len(items):
            found.append((node.lineno, frozenset(named)))
    return sorted(found, key=lambda hit: hit[0])


def _hand_kept_families(tree: ast.AST) -> list[str]:
    """Where ``tree`` spells out a family or a trait of methods by hand: a literal of method names equal to
    the cards' members of a family or a trait, or to them less one."""
    from mixhook.engine.card import FAMILIES, METHODS, TRAITS, methods_with

    groups = {f"family {f}": methods_with(family=f) for f in FAMILIES}
    groups |= {f"trait {t}": methods_with(t) for t in TRAITS}
    groups = {k: frozenset(v) for k, v in groups.items() if len(v) >= 3}
    out = []
    for line, named in _hand_lists(tree, set(METHODS)):
        for group, members in groups.items():
            if named <= members and len(members - named) <= 1:
                out.append(f"{line}: {sorted(named)} ({group}: methods_with)")
                break
    return out


def test_no_family_of_methods_is_kept_by_hand():
    """Issue 97: what a method is (its family, its traits) is stated on its card, and the lists of such
    methods in tests/, benchmarks/, tools/ and the app are derived from the cards (``methods_with``,
    ``traits_of``): a literal that spells a family or a trait out (or all of it but one) fails here, shown
    able to fail on the lists these files kept before."""
    found = []
    for folder in ("tests", "benchmarks", "tools", "mixhook/app"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            found += [
                f"{path.relative_to(ROOT)}:{hit}" for hit in _hand_kept_families(ast.parse(path.read_text()))
            ]
    assert not found, found
    before = ast.parse(
        'A = ("TransMix", "MixPro", "TLA", "SMMix", "MergeMix")\n'
        'B = [n for n in names if n not in ("TransMix", "MixPro", "TLA", "SMMix")]\n'
        "C = (RegMixup, RankMixup, MixupE)\n"  # (classes, not names: test_weigh's, which this cannot see)
        'D = {"AutoMix": 1, "SAMix": 2, "AdAutoMix": 3}\n'
        'E = ("CutMix", "TransMix", "AutoMix")\n'  # (a sample across families: allowed)
    )
    assert [hit.split(":")[0] for hit in _hand_kept_families(before)] == ["1", "2", "4"]


def test_the_tests_share_their_helpers_from_one_place():
    """Issue 97: a helper the tests share (a seeded generator, a per-sample criterion, a float64 check, a
    small model) is defined once, in tests/helpers.py, and imported: no two test modules define the same
    function or class (the same code under any name), which a change to one would leave the other behind."""
    import collections

    bodies = collections.defaultdict(list)
    for path in sorted((ROOT / "tests").rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef | ast.ClassDef) and not node.name.startswith("test_"):
                body = ast.dump(node).replace(f"name='{node.name}'", "name=''", 1)
                bodies[body].append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}")
    twice = [places for places in bodies.values() if len(places) > 1]
    assert not twice, twice


def test_the_tests_mirror_the_package():
    """Issue 97: the library's tests are a folder per part of the package (``tests/README.md``): a folder
    for each of mixhook's subpackages that has tests of its own, ``core/`` for its top-level modules; no
    other folder of test modules, and none left at the old flat ``tests/unit/``."""
    packages = {p.parent.name for p in (ROOT / "mixhook").glob("*/__init__.py")}
    beside = {"core", "bench", "e2e"}  # (the top-level modules, benchmarks/, the app run whole)
    folders = {p.relative_to(ROOT / "tests").parts[0] for p in (ROOT / "tests").rglob("test_*.py")}
    folders.discard("test_style.py")
    assert folders <= packages | beside, sorted(folders - packages - beside)
    assert {"engine", "mixers", "policies", "lm", "integrations", "app", "layers"} <= folders
    readme = (ROOT / "tests" / "README.md").read_text()
    assert all(f"`{folder}/`" in readme for folder in folders), sorted(folders)
    # (a method's own module, tests/mixers/test_<module>.py: tests/mixers/test_mixers.py requires it)


def _imports_of(tree: ast.AST) -> set[str]:
    """The modules ``tree`` imports (``import a.b``, ``from a.b import c``: ``a.b``), wherever in it."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
    return found


def test_the_tools_and_the_harness_import_nothing_of_the_tests():
    """Issue 97: the programs that write docs (``tools/``) and the reference models, workflows and oracles
    they share with the suite (``harness/``) import nothing from ``tests/``: the suite imports them, not
    the other way round, so a test module can move or change without a tool breaking."""
    found = [
        f"{path.relative_to(ROOT)}: {module}"
        for folder in ("tools", "harness", "benchmarks", "mixhook")
        for path in sorted((ROOT / folder).rglob("*.py"))
        for module in sorted(_imports_of(ast.parse(path.read_text())))
        if module == "tests" or module.startswith("tests.")
    ]
    assert not found, found
    assert _imports_of(ast.parse("def f():\n    from tests.helpers import gen\n")) == {"tests.helpers"}

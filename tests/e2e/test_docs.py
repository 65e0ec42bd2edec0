"""The documentation site: it builds with every warning an error, its generated parts (the Performance
tables, the gallery) come from the code and the benchmark's results, and bad input to it (a broken link, a
docstring reference to nothing, a picture that is missing, extra or stale) fails in one line naming it."""

import importlib.util
import re
import shutil
import subprocess
import sys

import pytest
import torch

from tests.helpers import ROOT

pytest.importorskip("sphinx", reason="the docs extra: pip install -e '.[docs]'")
DOCS = ROOT / "docs"


def build(*args, cwd=ROOT):
    return subprocess.run(
        [sys.executable, str(DOCS / "build.py"), *args], capture_output=True, text=True, cwd=cwd, timeout=600
    )


def gallery_module():
    spec = importlib.util.spec_from_file_location("gallery", DOCS / "gallery.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The site built once for the tests that read it: (the build's result, its html folder)."""
    out = tmp_path_factory.mktemp("site") / "html"
    return build("--out", str(out)), out


@pytest.mark.process
@pytest.mark.slow
def test_the_site_builds_clean_with_the_generated_tables_and_every_picture(site):
    result, html = site
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"built {html / 'index.html'}" and not result.stderr
    catalogue = (html / "catalogue.html").read_text()
    import mixhook.mixers

    for name, cls in mixhook.mixers.METHODS.items():  # every method's picture, or its card's reason
        picture = cls.card.picture
        if picture is True:
            assert f'src="_images/{name}.png"' in catalogue, name
        else:  # (its first words: the page's typography changes quotes)
            assert f"No picture: {picture.split(':')[0]}" in catalogue, name
    performance = (html / "performance.html").read_text()
    # the goals table is made from the results: each whole-suite run is a column, each goal a row
    for stem in ("cpu-2026-11-22", "cpu-2026-11-23", "cuda-h100-2026-11-22"):
        assert f"_generated/results/{stem}.html" in performance
    assert (
        '<code class="docutils literal notranslate"><span class="pre">mixup_vs_none</span></code>'
        in performance
    )
    assert "1.196 (missed)" in performance  # the H100's mixup_vs_none, from its results file
    assert (html / "_generated" / "results" / "cpu-2026-11-24-methods.html").exists()
    # every table fits the content column or scrolls inside it (test_the_tables_and_code_fit_or_scroll)
    assert "_static/mixhook.css" in catalogue
    assert "box-sizing: border-box" in (html / "_static" / "mixhook.css").read_text()
    api = (html / "api.html").read_text()
    assert 'id="mixhook.ManifoldMixup"' in api and "Verma" in api  # the docstring, imported
    assert 'id="mixhook.RegionMixer"' in api and 'id="mixhook.engine.forward.Pins"' in api
    # a property's docstring renders whole (Napoleon reads a first line "X: y" as a type and its text)
    typed = re.findall(r'<dl class="py property">(?:(?!</dl>).)*?<dt class="field-\w+">Type<', api, re.S)
    assert not typed, f"{len(typed)} properties render their first words as a Type field"
    for heading in ("timm’s train script", "PyTorch Lightning", "The HuggingFace Trainer and TRL"):
        assert f'{heading}<a class="headerlink"' in api  # (each adapter under its own heading)
    assert "mixhook adds training-time regularizers" in (html / "index.html").read_text()
    started = re.sub(r"<[^>]+>", "", (html / "getting-started.html").read_text())  # (its text)
    assert "pip install mixhook" in started and "A first example" in started and "python train.py" in started
    assert "edit-test loop" not in started  # (a contributor's commands: the Development page's)
    development = (html / "development.html").read_text()  # the README's setup and three test commands
    assert (
        "its quick tier, for an edit-test loop" in development
        and "the tests whose property is a process" in development
    )
    landing = re.sub(r"<[^>]+>", "", (html / "index.html").read_text())  # install, example, run, promises
    assert all(
        text in landing for text in ("pip install mixhook", "A first example", "What you can count on")
    )


def unfit(html, pages: dict[str, tuple[int, ...]]) -> list[str]:
    """What does not fit on the built pages of ``html`` (each page's path under it, and the widths of the
    windows it is measured in), one line each: a table or code block that runs off the content column, one
    cut without a scrollbar, a word of a table split across two lines. One headless Chromium measures them
    all (tests/e2e/fit.js: each page in a frame as wide as the window)."""
    import html as entities
    import json

    probe = html / "_fit.html"
    listing = json.dumps([[page, list(widths)] for page, widths in pages.items()])
    probe.write_text(
        f"<!doctype html><html><body><script>const PAGES = {listing};\n{FIT}</script></body></html>"
    )
    try:
        dom = subprocess.run(
            [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--allow-file-access-from-files",
             "--virtual-time-budget=600000", "--dump-dom", probe.as_uri()],
            capture_output=True, text=True, timeout=600,
        ).stdout  # fmt: skip
    finally:
        probe.unlink()
    found = re.search(r'data-fit="([^"]*)"', dom)
    assert found is not None, f"the pages' layout could not be measured: {dom[-500:]}"
    return json.loads(entities.unescape(found.group(1)))


FIT = (ROOT / "tests" / "e2e" / "fit.js").read_text()
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


@pytest.mark.process
@pytest.mark.slow
@pytest.mark.skipif(CHROMIUM is None, reason="measuring the pages needs a headless Chromium")
def test_every_table_and_code_block_fits_its_column_or_scrolls_inside_it(site):
    """Every page a reader opens, in a desktop window and a phone's (the results files in the phone's):
    no table or code block runs off the content column or is cut, and no word of a table is split across
    lines (a cell wraps at spaces only; a table wider than the column scrolls inside its wrapper). A copy
    of a page with a table whose cells break anywhere in a fixed layout fails it."""
    result, html = site
    assert result.returncode == 0, result.stderr
    records = html / "_generated" / "results"  # (at the narrow width only: generated alike, one by one)
    pages = {
        str(p.relative_to(html)): (420,) if records in p.parents else (1280, 420)
        for p in sorted(html.rglob("*.html"))
        if not {"_static", "_sources"} & set(p.relative_to(html).parts)
        and not p.name.startswith(("genindex", "search", "py-"))
    }
    assert len(pages) >= 70  # (the pages, the studies' reports and every results file)
    # and a copy of a page as the site once had it: a fixed layout whose cells break inside words
    bad = html / "_bad_matrix.html"
    style = "<style>table { table-layout: fixed; width: 100%; } td { overflow-wrap: anywhere; }</style>"
    bad.write_text((html / "matrix.html").read_text().replace("</head>", f"{style}</head>"))
    try:
        found = unfit(html, {**pages, bad.name: (420,)})
    finally:
        bad.unlink()
    assert any(line.startswith(f"{bad.name} at 420px: a word split across lines") for line in found)
    found = [line for line in found if not line.startswith(bad.name)]
    assert not found, "\n".join(found)


@pytest.mark.process
@pytest.mark.slow
def test_bad_docs_input_fails_the_build_in_one_line_each(tmp_path):
    source = tmp_path / "docs"
    source.mkdir()
    for name in ("conf.py", "gallery.py"):
        shutil.copy(DOCS / name, source / name)
    shutil.copytree(DOCS / "_ext", source / "_ext")
    shutil.copytree(DOCS / "gallery", source / "gallery")
    (source / "gallery" / "CutMix.png").unlink()  # a method without its picture
    (source / "catalogue.md").write_text("# Catalogue\n")  # (its sections come from the methods' cards)
    shutil.copy(DOCS / "gallery" / "FMix.png", source / "gallery" / "ChannelSwap.png")  # a picture of nothing
    results = tmp_path / "benchmarks" / "results"  # where the copied conf looks: beside its docs folder
    results.mkdir(parents=True)
    (results / "cpu-2099-01-01.json").write_text('{"meta": {}, "goals": []}')  # without its Markdown
    (source / "index.md").write_text(
        "# Bad input\n\nSee [the layers](layers.md).\n\n![a picture](gallery/Nosuch.png)\n\n"
        "```{eval-rst}\n.. autoclass:: mixhook.Nosuch\n```\n"
    )
    result = build("--source", str(source), "--out", str(tmp_path / "html"))
    assert result.returncode == 1 and not result.stdout
    lines = result.stderr.splitlines()
    assert all(line.startswith("error: ") for line in lines), result.stderr

    def one(pattern):
        found = [line for line in lines if re.search(pattern, line)]
        assert len(found) == 1, (pattern, result.stderr)

    one(r"index\.md:3: .*'layers\.md'")  # the broken link, with its line
    one(r"image file not readable: gallery/Nosuch\.png")
    one(r"autoclass.*Nosuch|Nosuch.*autoclass|import.*Nosuch")
    one(r"gallery/CutMix\.png: no picture of CutMix: run python docs/gallery.py")
    one(r"gallery/ChannelSwap\.png: a picture of no method")
    one(r"cpu-2099-01-01\.json: has no cpu-2099-01-01\.md beside it")


@pytest.mark.slow
def test_the_gallery_is_what_the_library_draws_now(tmp_path):
    gallery = gallery_module()
    drawn = tmp_path / "drawn"
    gallery.render(drawn)
    assert gallery.check(gallery.GALLERY, drawn_into=drawn) == []
    # a copy with a stale, a missing and an extra picture: one line each
    stale = tmp_path / "stale"
    shutil.copytree(gallery.GALLERY, stale)
    from matplotlib.image import imread, imsave

    imsave(stale / "CutMix.png", 1 - imread(stale / "CutMix.png")[..., :3])
    (stale / "FMix.png").unlink()
    shutil.copy(stale / "GridMix.png", stale / "Old.png")
    assert gallery.check(stale, drawn_into=drawn) == [
        "stale/FMix.png: not drawn: run python docs/gallery.py",
        "stale/Old.png: not a picture docs/gallery.py draws",
        "stale/CutMix.png: differs from what the library draws now: run python docs/gallery.py",
    ]


def test_every_public_name_is_in_the_api_reference():
    """The page as written, with the methods' and the other hooks' lists its build includes (read from
    their cards)."""
    import mixhook

    sys.path.insert(0, str(DOCS / "_ext"))
    try:
        import generated
    finally:
        sys.path.remove(str(DOCS / "_ext"))
    api = (DOCS / "api.md").read_text() + generated.api_methods() + generated.api_hooks()
    missing = [n for n in mixhook.__all__ if n != "mixers" and not re.search(rf"\bmixhook\.{n}\b", api)]
    assert not missing, f"not in docs/api.md: {missing}"


def test_the_readme_is_a_quick_start_whose_links_all_lead_somewhere():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", readme)
    assert links and all((ROOT / link).exists() for link in links if "://" not in link), links
    for heading in (
        "## Install", "## A first example", "## Train", "## Three common uses", "## Set up and test",
        "## Documentation",
    ):  # fmt: skip
        assert heading in readme


def test_the_first_example_trains_with_a_mix_and_the_method_count_is_the_cards():
    """The README's first example (the landing page's and Getting started's) runs as written, mixes (the
    mixer recorded a mix at one of its layers) and trains (the weights move); the number of mixing methods
    the README's first lines state is the catalogue's: every card but a composition's."""
    import torch

    from harness.readme import quoted_block

    code = "\n".join(quoted_block("## A first example", language="python"))
    torch.manual_seed(0)
    scope: dict = {}
    exec(compile(code, "README.md: A first example", "exec"), scope)
    mix, model = scope["mix"], scope["model"]
    assert mix.last is not None and mix.last.layer in ("input", "1")
    torch.manual_seed(0)  # (the example's model as it was made, before its steps)
    before = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 3))
    assert not torch.equal(before[0].weight, model[0].weight)
    mixing = [n for n, cls in _library_methods().items() if cls.card.family != "composition"]
    readme = (ROOT / "README.md").read_text()
    assert f"`forward()`: {len(mixing)} mixing methods" in readme


@pytest.mark.process
@pytest.mark.slow
def test_the_language_models_page_runs_as_written(tmp_path):
    """Its examples (a hand loop, the Trainer, TRL's SFTTrainer and its subclass, NoiseFiT, SFTMix, PEFT) run
    in order as one script, and print what the page says they print: no noise on padding, NoiseFiT's chosen
    block, a paired batch and SFTMix's rows, the merged model refused."""
    pytest.importorskip("trl")
    pytest.importorskip("peft")
    page = (DOCS / "language-models.md").read_text()
    blocks = re.findall(r"```python\n(.*?)\n```", page, flags=re.S)
    assert len(blocks) == 8
    script = tmp_path / "page.py"
    script.write_text("\n\n".join(blocks))
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, cwd=tmp_path, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    steps = [line for line in lines if re.match(r"\d \d", line)]
    assert len(steps) == 3 and all(line.endswith(f"[{5 / 320**0.5}, 0.0]") for line in steps), steps
    assert "called on its own, not through the PeftModel" in lines[-1]
    assert "[True, True, False, False]" in lines  # (SFTMix's paired batch: its confident half first)
    assert "clean rows 4 mixed tokens 24" in lines  # (SFTMix's loss: the clean rows' logits, 6 slots a row)
    assert "SFTMix trained 18 steps" in lines  # (its pipeline in TRL: reference run, split, paired batches)
    assert any(re.fullmatch(r"\('model\.layers\.[01]',\) \d+\.\d+", line) for line in lines), lines


@pytest.mark.slow
def test_the_region_method_example_mixes_exactly_eagerly_and_compiled_in_one_graph():
    """docs/adding-a-mixer.md's BandMix, run as written (its mix written once, as the one-graph path): on a
    pinned draw its eager mix equals the hand-edited forward (logits and every gradient), a compiled
    forward (fullgraph=True) mixes as the eager one from the same draws, and a channels-last map is cut
    along its height."""
    from torch import nn

    block = re.search(
        r"```python\n(# mixhook/mixers/bandmix.py\n.*?)\n```", (DOCS / "adding-a-mixer.md").read_text(), re.S
    )
    namespace: dict = {}
    exec(compile(block[1], "adding-a-mixer.md", "exec"), namespace)  # the page's own code
    BandMix = namespace["BandMix"]

    def net():
        torch.manual_seed(0)
        return nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 2, 3), nn.Flatten()).double().train()

    x = torch.randn(4, 3, 10, 10, dtype=torch.float64)
    index = torch.tensor([2, 3, 1, 0])
    model = net()
    mixer = BandMix("1")
    assert mixer.traceable
    with mixer.attach(model):
        mixer.pin(index=index, rows=(2, 5))
        out = model(x)
        out.sum().backward()
    band = torch.zeros(1, 1, 8, 1, dtype=torch.float64)
    band[:, :, 2:5] = 1
    hand_model = net()
    hand_h = hand_model[1](hand_model[0](x))
    hand = hand_model[3](hand_model[2](band * hand_h[index] + (1 - band) * hand_h))
    hand.sum().backward()
    torch.testing.assert_close(out, hand, rtol=1e-12, atol=1e-12)
    for p, q in zip(model.parameters(), hand_model.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-12)
    assert mixer.last.info["rows"] == (2, 5) and float(mixer.last.lam) == 5 / 8

    def steps(compiled: bool) -> list:
        torch._dynamo.reset()
        model, mixer = net(), BandMix("1", generator=torch.Generator().manual_seed(3))
        run = torch.compile(model, backend="aot_eager", fullgraph=True) if compiled else model
        seen = []
        with mixer.attach(model):
            for _ in range(3):
                out = run(x)
                seen.append((out.detach(), mixer.last.info["rows"], mixer.last.index))
        return seen

    for (a, rows_a, index_a), (b, rows_b, index_b) in zip(steps(False), steps(True), strict=True):
        assert rows_a == rows_b and torch.equal(index_a, index_b)
        torch.testing.assert_close(b, a)

    class ChannelsLast(nn.Module):  # the same map, held (B, H, W, C) between two layers
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3).double()
            self.nhwc = nn.Identity()

        def forward(self, x):
            return self.nhwc(self.conv(x).permute(0, 2, 3, 1)).permute(0, 3, 1, 2)

    model = ChannelsLast().train()
    mixer = BandMix("nhwc", layout="NHWC")
    with mixer.attach(model):
        mixer.pin(index=index, rows=(2, 5))
        out = model(x)
    h = model.conv(x)
    torch.testing.assert_close(out, band * h[index] + (1 - band) * h, rtol=0, atol=0)


def test_the_adding_a_mixer_example_mixes_as_a_hand_edited_forward():
    """docs/adding-a-mixer.md's ChannelSwap, run as written: on a pinned draw its mix at a hidden layer
    equals the hand-edited forward (logits and every gradient), and pin_last repeats it."""
    from torch import nn

    block = re.search(
        r"```python\n(# mixhook/mixers/channelswap.py\n.*?)\n```",
        (DOCS / "adding-a-mixer.md").read_text(),
        re.S,
    )
    namespace: dict = {}
    exec(compile(block[1], "adding-a-mixer.md", "exec"), namespace)  # the page's own code
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 2, 3)).double().train()
    x = torch.randn(4, 3, 8, 8, dtype=torch.float64)
    index = torch.tensor([1, 2, 3, 0])
    mixer = namespace["ChannelSwap"]("1")
    with mixer.attach(model):
        mixer.pin(index=index, offset=1)
        out = model(x)
        out.sum().backward()
        grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        mixer.pin_last()
        torch.testing.assert_close(model(x), out, rtol=0, atol=0)
    h = model[1](model[0](x))
    keep = torch.tensor([1.0, 0.0, 1.0, 0.0], dtype=torch.float64).view(1, 4, 1, 1)
    hand = model[2](keep * h + (1 - keep) * h[index])
    hand.sum().backward()
    torch.testing.assert_close(out, hand, rtol=1e-12, atol=1e-12)
    for p, g in zip(model.parameters(), grads, strict=True):
        torch.testing.assert_close(p.grad, g, rtol=1e-12, atol=1e-12)
    assert mixer.last.info["offset"] == 1 and float(mixer.last.lam) == 0.5


def test_the_pages_speak_a_readers_words():
    """The pages a user reads (the README, every page under docs/, the docstrings the API page and the
    catalogue read) name no issue of the team's tracker, which a reader cannot look up, and no internal
    name for a measurement ("the CPU twin"). The results files under benchmarks/results are committed
    records of a run, kept as they were written."""
    pattern = re.compile(r"\bissues? \d+|\b(CPU|the) twin\b", re.I)
    sources = [ROOT / "README.md", *DOCS.glob("*.md"), *(ROOT / "mixhook").rglob("*.py")]
    found = [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()[:100]}"
        for path in sources
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
        and not (path.suffix == ".py" and line.lstrip().startswith("#"))  # (a comment is a contributor's)
    ]
    assert not found, "\n".join(found)


def test_each_methods_workflows_in_the_catalogue_are_the_matrixs():
    """The catalogue's workflows column (each card's ``workflows``) says what the matrix's row of the method
    found (docs/matrix.md, written from runs): "all" where every workflow but TRL trains it (exact, or
    trains in the app), "+ TRL" where TRL's is exact too, "but TRL" where TRL refuses it or is no workflow
    for its model (a method that keeps the clean batch, which TRL's adapter refuses)."""

    lines = (DOCS / "matrix.md").read_text().splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("| method | own loop"))
    columns = [c.strip() for c in lines[head].strip("|").split("|")]
    rows = {}
    for line in lines[head + 2 :]:
        if not line.startswith("| `"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0].strip("`")] = dict(zip(columns, cells, strict=True))
    wrong = []
    for name, cls in _library_methods().items():
        row, said = rows[name], cls.card.workflows
        others = [v for k, v in row.items() if k not in ("method", "TRL")]
        trl = row["TRL"].split(" ")[0]
        everywhere = all(v in ("exact", "trains") for v in others)
        expected = {"exact": "all + TRL", "refused": "all but TRL"}.get(trl, "all") if everywhere else None
        if said != expected and not (trl == "n/a" and said == "all but TRL"):
            wrong.append(f"{name}: the card says {said!r}, the matrix's row {row}")
    assert len(rows) >= len(_library_methods()) and not wrong, "\n".join(wrong)


def _library_methods() -> dict:
    """The package's methods by name (the registry also holds those a test defines, as a user's would be)."""
    import mixhook.mixers

    return {n: c for n, c in mixhook.mixers.METHODS.items() if c.__module__.startswith("mixhook.")}

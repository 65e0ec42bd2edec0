"""The benchmark suite keeps working: `benchmarks/run.py --quick` runs (as a user runs it, once) and writes
complete results; the runner's subsets and argument checks run in this process.

Speed itself is measured by the suite, not asserted here; what is asserted are the properties that do
not depend on timing (the compiled model does not recompile after warm-up) and the results' shape.
"""

import json
import math
import subprocess
import sys

import pytest
import torch

from mixhook.engine.card import methods_with
from tests.helpers import Lazy, run_bench

bench = Lazy("benchmarks.run")  # imports torchvision's models: when a test first uses it, not at collection


def ratios_in(node):
    if isinstance(node, dict):
        if {"median", "min", "max", "n"} <= set(node):
            yield node
        for value in node.values():
            yield from ratios_in(value)
    elif isinstance(node, list):
        for value in node:
            yield from ratios_in(value)


@pytest.mark.process
@pytest.mark.slow
def test_quick_benchmark_writes_json_and_markdown(tmp_path):
    result = run_bench("--quick", "--device", "cpu", "--device-time", "--out", str(tmp_path))
    assert result.returncode == 0, result.stderr[-3000:]
    (json_file,) = tmp_path.glob("cpu-*-quick.json")
    data = json.loads(json_file.read_text())
    assert data["meta"]["device"].startswith("CPU") and data["meta"]["torch"] == torch.__version__
    found = list(ratios_in(data))
    assert len(found) >= 6
    for r in found:
        assert r["n"] >= 5 and 0 < r["min"] <= r["median"] <= r["max"] and math.isfinite(r["max"])
    step = data["training_step"][0]
    assert {"none", "mixup_random", "hand_layer2"} <= set(step["seconds_per_step"])
    # the device time's CPU twin: the aten ops' self time, kernels per step, the kernels mixhook's step
    # runs that the hand-edited forward's does not (its draws: randperm is the hand's too)
    assert set(step["device_seconds_per_step"]) == set(step["seconds_per_step"])
    assert all(0 < step["device_seconds_per_step"][k] for k in step["seconds_per_step"])
    assert step["kernels_per_step"]["mixup_layer2"] > step["kernels_per_step"]["none"] > 100
    assert "aten::convolution_backward" not in step["kernels_mixup_layer2_not_hand"]
    assert (
        step["device_mixup_layer2_vs_hand_layer2"]["low"]
        <= step["device_mixup_layer2_vs_hand_layer2"]["high"]
    )
    verdicts = {g["verdict"] for g in data["goals"]}
    assert verdicts <= {"yes", "NO", "not resolved"} and any(
        "device time" in g["where"] for g in data["goals"]
    )
    # issue 72: each case's seconds; timm's Mixup beside mixhook in host and device time, with kernel lists;
    # the ImageNet-scale step against the loader, channels-last, where the mix must not make the map
    # contiguous (index_select did: the convolutions after it copied input and gradient back)
    assert {"peers", "imagenet", "blend"} <= set(data["meta"]["seconds"])
    peers = data["peers"]
    assert set(peers["kernels_per_step"]) == set(peers["seconds_per_step"])
    if "timm_Mixup" in peers["seconds_per_step"]:
        assert peers["device_mixhook_vs_timm"]["n"] >= 5 and "kernels_timm_not_mixhook" in peers
    imagenet = data["imagenet"]
    assert imagenet["step"]["channels_last"] and set(imagenet["workers_to_feed"]) == set(
        imagenet["step"]["seconds_per_step"]
    )
    extra = imagenet["step"]["kernels_mixup_layer2_not_hand"]
    assert not {"aten::contiguous", "aten::clone"} & set(extra), extra
    assert imagenet["loader"]["images_per_second"]["decode_torchvision_cpu"] > 0
    rc = data["recompiles"]
    assert rc["distinct_layers_mixed"] == 3 and rc["distinct_lams"] == rc["steps"]
    assert rc["graphs_compiled_after_warmup"] == 0 and rc["graphs_compiled_total"] > 0
    assert rc["fullgraph"] and rc["graph_breaks"] == 0
    assert {g["goal"] for g in data["goals"]} >= {"mixup_vs_none", "mixup_vs_hand", "recompiles_after_warmup"}
    augmix = data["augmix"]  # issue 84: the hook's views against timm's loader AugMix in one worker
    assert set(augmix["images_per_second"]) == {"mixhook_hook", "timm_loader_worker"}
    assert augmix["workers_to_match_hook"] > 0 and augmix["hook_vs_timm_worker"]["n"] >= 5
    vit = data["vit"]  # issue 84: the methods that read a ViT's attention, against none and CutMix
    reading = set(methods_with("attention"))  # (the cards')
    assert set(vit["seconds_per_step"]) == {"none", "CutMix", *reading} and len(reading) >= 5
    assert set(vit["vs_cutmix"]) == reading
    assert vit["vs_none"]["TLA"]["n"] >= 5
    host = data["host"]  # counts, not times: the same on every machine
    assert host["extra_ops_vs_hand"] <= 2 and host["census"]["mixhook"]["host_reads"] == 0
    assert host["census"]["hand"]["aten_ops"] > host["census"]["none"]["aten_ops"]
    # the structure alone (no checks) does the hand hook's work in no more aten ops than mixhook
    assert host["census"]["none"]["aten_ops"] < host["census"]["floor"]["aten_ops"]
    assert host["census"]["floor"]["aten_ops"] <= host["census"]["mixhook"]["aten_ops"]
    assert all("floor_vs_hand" in host[what] for what in ("forward", "forward_and_loss", "step"))
    # the host figures divide one added time by another, each a difference of two timed runs: their spread
    # is the paired difference (no denominator), never a ratio that a loaded machine can send below zero
    for what in ("forward", "forward_and_loss", "step"):
        figure = host[what]["mixhook_vs_hand"]
        d = figure["difference_us"]
        assert "min" not in figure and d["low"] <= d["median"] <= d["high"] and figure["n"] >= 5
    assert {"host_vs_hand", "extra_ops_vs_hand", "host_reads_per_step"} <= {g["goal"] for g in data["goals"]}
    data_ = data["data"]
    assert set(data_["images_per_second"]) == {"device", "workers"} and data_["images"] == 500
    folder = data_["imagefolder"]  # the uint8 batch is a quarter of the float one
    assert "uint8_one_worker" in folder["images_per_second"]
    assert folder["bytes_per_image"]["float32"] == 4 * folder["bytes_per_image"]["uint8"]
    recipe = data["recipe"]
    assert set(recipe["images_per_second"]) == {"none", "mixup", "none_fused", "mixup_fused", "eval"}
    hours = recipe["projected_hours_1200_epochs"]
    assert all(h > 0 and math.isfinite(h) for h in hours.values()) and "eval" not in hours
    assert "recipe_mixup_vs_none" in {g["goal"] for g in data["goals"]}
    # issue 81: what each method keeps between steps, by what it belongs to: nothing beside .last, pin_last's
    # record and its learned state, no graph; AutoMix's Mix Block and copy are its learned state
    kept = data["memory"]["kept"]
    assert {"ManifoldMixup", "CutMix", "PuzzleMix_input", "AutoMix_input"} == set(kept)
    assert all(k["other"] == 0 and k["graph"] == 0 for k in kept.values())
    assert kept["PuzzleMix_input"]["last"] > 0 and kept["AutoMix_input"]["learned"] > 0
    assert "kept_graph_tensors" in {g["goal"] for g in data["goals"]}
    sftmix = data["sftmix"]  # issue 85: its step against a hand-written SFTMix's, and the scoring
    assert set(sftmix["seconds_per_step"]) == {"none", "hand", "sftmix"} == set(sftmix["aten_ops"])
    assert sftmix["aten_ops"]["hand"] > sftmix["aten_ops"]["none"]  # (the mixed rows' ops: counted)
    assert sftmix["scoring"]["vs_train_step"]["n"] >= 5 and "sftmix_vs_hand" in {
        g["goal"] for g in data["goals"]
    }
    peak = data["sftmix_memory"]  # issue 96: the peak of its step, beside plain fine-tuning's and the hand's
    assert set(peak["peak_MiB"]["float32"]) == {"none", "hand", "sftmix"}
    assert peak["sftmix_vs_hand"]["float32"] < 1  # (the hand-written SFTMix's B mixed rows: half as many)
    markdown = json_file.with_suffix(".md").read_text()
    assert "## SFTMix: peak memory" in markdown
    assert "## SFTMix: training step" in markdown
    assert "## Memory: what a mixer keeps between steps" in markdown
    assert "## Goals" in markdown and "| mixup_vs_hand |" in markdown and "## Host cost" in markdown
    assert "## Verma et al. 2019 CIFAR-10 recipe" in markdown and "## CIFAR data pipelines" in markdown


def test_results_are_named_after_the_gpu():
    from benchmarks.report import gpu_model

    assert gpu_model("NVIDIA H100 80GB HBM3") == "h100" and gpu_model("NVIDIA H200") == "h200"
    assert gpu_model("NVIDIA GeForce RTX 4090") == "4090" and gpu_model("Tesla T4") == "t4"


def test_a_subset_of_cases_writes_only_those_under_its_own_name(tmp_path):
    bench.main(["--quick", "--device", "cpu", "--cases", "blend,dispatch", "--out", str(tmp_path)])
    (json_file,) = tmp_path.glob("*.json")  # the partial file of a finished run is gone
    assert json_file.name.endswith("-quick-blend_dispatch.json")
    data = json.loads(json_file.read_text())
    assert {"blend", "dispatch"} <= set(data) and not {"training_step", "peers", "recompiles"} & set(data)
    assert [g["goal"] for g in data["goals"]] == ["inactive_vs_unhooked"]
    assert "## Dispatch" in json_file.with_suffix(".md").read_text()


def test_a_spent_budget_starts_no_more_cases_and_names_them(tmp_path):
    """A leased GPU's run (benchmarks/gpu.sh): after --budget seconds no case starts; those left are named
    in the results, which carry --suffix's name."""
    cases = "blend,dispatch,host"
    bench.main(
        [
            "--quick",
            "--device",
            "cpu",
            "--cases",
            cases,
            "--budget",
            "1e-9",
            "--suffix",
            "lease",
            "--out",
            str(tmp_path),
        ]
    )
    (json_file,) = tmp_path.glob("*.json")
    assert json_file.name.endswith("-quick-lease.json")
    data = json.loads(json_file.read_text())
    assert data["meta"]["skipped_over_budget"] == ["dispatch", "host", "blend"] and "blend" not in data
    assert "Not run (the run's --budget was spent before they started): dispatch, host, blend." in (
        json_file.with_suffix(".md").read_text()
    )


@pytest.mark.process
@pytest.mark.slow
def test_the_baseline_case_times_this_checkout_against_a_git_revision(tmp_path):
    """Against HEAD (the same core when nothing is changed): both columns are timed, side by side."""
    bench.main(["--quick", "--cases", "baseline", "--baseline", "HEAD", "--out", str(tmp_path)])
    (json_file,) = tmp_path.glob("*-quick-baseline.json")
    data = json.loads(json_file.read_text())
    rows = data["baseline"]["rows"]
    assert data["baseline"]["baseline"] == "HEAD" and len(rows) == 4
    for row in rows.values():
        assert row["this_us"] > 0 and row["baseline_us"] > 0 and row["this_vs_baseline"]["n"] == 5
    assert "## This checkout against HEAD" in json_file.with_suffix(".md").read_text()
    assert "mixhook_baseline" in sys.modules  # imported beside this checkout's mixhook


def test_bad_arguments_are_refused(capsys):  # the runner's own parser, in this process
    bad = [
        (["--quick", "--reps", "3"], "--reps must be at least 5, got 3"),
        (["--quick", "--cases", "blend,eagre"], "unknown ['eagre']; valid: eager,compiled,"),
        (["--quick", "--cases", "baseline"], "--cases baseline and --baseline REV go together"),
        (["--quick", "--suffix", "a/b"], "--suffix 'a/b': letters, digits, '.', '_' and '-' only"),
        (["--quick", "--budget", "0"], "--budget must be a number of seconds > 0, got 0"),
        (
            ["--quick", "--cases", "baseline", "--baseline", "nosuch"],
            "--baseline 'nosuch': git archive failed",
        ),
    ]
    if not torch.cuda.is_available():
        bad.append((["--device", "cuda"], "no CUDA device is available"))
    for argv, message in bad:
        with pytest.raises(SystemExit) as info:
            bench.main(argv)
        assert info.value.code == 2 and message in capsys.readouterr().err


def test_every_method_the_full_run_measures_can_be_built():
    """The quick run measures four methods; the full one builds every discovered method at layer2 of
    a CNN (SnapMix with the CNN's last map and classifier), and leaves out (and lists) the ones that need
    more than a layer: those that read a ViT's attention (their cards' trait), measured by the vit case."""
    from benchmarks.cases.methods import METHODS, method_variants, needs_more_than_a_layer

    for name, make in method_variants().items():
        assert make().layers, name
    variants = method_variants()
    left = [n for n, cls in sorted(METHODS.items()) if needs_more_than_a_layer(cls) and n not in variants]
    assert left == sorted(methods_with("attention"))


@pytest.mark.process
@pytest.mark.slow
def test_a_papers_table_runs_its_recipes_at_once_and_sets_them_beside_the_papers_figures(tmp_path):
    """benchmarks/paper_table.py on the CPU (a device's job shortened to one epoch on 40 written images):
    each recipe and seed a train.py run, two at a time, the schedule scaled to the epochs, the table beside
    the paper's figures and Random Erasing's paired difference; the runs' own sweep report beside it."""
    from tests.conftest import ROOT, write_idx

    data = tmp_path / "fashion-mnist"
    write_idx(data, n_train=40, n_test=20)
    recipes = "zhong2020_fashion_mnist_resnet20,zhong2020_fashion_mnist_resnet20_erasing"
    command = [
        sys.executable, "benchmarks/paper_table.py", "--recipes", recipes, "--seeds", "0,1", "--epochs", "2",
        "--jobs", "2", "--device", "cpu", "--data-root", str(data), "--out", str(tmp_path / "out"),
    ]  # fmt: skip
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (md,) = (tmp_path / "out").glob("cpu-*-paper-table.md")
    data = json.loads(md.with_suffix(".json").read_text())
    base, erased = (data["recipes"][r] for r in recipes.split(","))
    assert base["seeds"] == erased["seeds"] == [0, 1] and base["epochs"] == [2] and base["paper"] == 4.39
    assert (
        erased["paper"] == 4.02
        and data["pairs"]["zhong2020_fashion_mnist_resnet20_erasing"]["paper"] == "-0.37"
    )
    text = md.read_text()
    assert (
        "shortened to 2 epochs (milestones scaled)" in text
        and "| `zhong2020_fashion_mnist_resnet20` | 2 | 2 |" in text
    )
    run = tmp_path / "out" / "paper-table" / "zhong2020_fashion_mnist_resnet20_erasing" / "1"
    overrides = (run / ".hydra" / "overrides.yaml").read_text()
    assert "scheduler.milestones=[1]" in overrides and "trainer.epochs=2" in overrides  # 150 of 300 -> 1 of 2
    assert "RandomErasing" in json.loads((run / "summary.json").read_text())["hooks"]["erasing"]
    assert (tmp_path / "out" / "paper-table" / "summary.md").exists()

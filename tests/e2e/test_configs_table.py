"""``python -m tools.configs``: every shipped ``mixup=`` config on the default run, and docs/configs.md. The
runs are the command's (hours on 2 cores); here its table from given summaries, the overrides it takes
from the matrix, and its refusal of a config that does not exist."""

import pytest

from tools import configs


def test_every_shipped_config_is_listed_none_first_with_the_overrides_its_refusal_names():
    names = configs.configs()
    assert names[0] == "none" and {"automix", "samix", "transmix", "cmixup", "input"} <= set(names)
    assert configs.overrides("transmix") == ("experiment=vit_digits",)
    assert configs.overrides("cmixup") == ("data=diabetes", "model=mlp") and configs.overrides("none") == ()


def test_the_table_compares_each_config_with_none_and_says_what_failed():
    vit = configs.overrides("transmix")
    results = [
        {"name": "none", "test_acc": 0.98, "best_test_acc": 0.99, "test_ece": 0.02, "seconds": 40.0},
        {"name": "automix", "test_acc": 0.9833, "best_test_acc": 0.9861, "test_ece": 0.023, "seconds": 842.0},
        {"name": "samix", "test_acc": 0.10, "best_test_acc": 0.886, "test_ece": 0.90, "seconds": 600.0},
        {"name": "cmixup", "task": "regression", "test_rmse": 55.1234, "best_test_rmse": 54, "seconds": 9.0},
        {"name": "fmix", "failed": "error: mixup.layer: ...", "seconds": 3.0},
        {"name": "transmix", "where": vit, "test_acc": 0.5, "best_test_acc": 1, "test_ece": 0, "seconds": 9},
        {"name": "none", "where": vit, "test_acc": 0.52, "best_test_acc": 0.6, "test_ece": 0.1, "seconds": 8},
    ]
    for found in results:
        found.setdefault("where", configs.overrides(found["name"]))
    rows = configs.table(results, None).splitlines()
    assert rows[0] == "# Every shipped config on the default run" and "15 epoch(s)" in rows[3]
    body = {row.split(" | ")[0]: row for row in rows if row.startswith("| `mixup=")}
    assert body["| `mixup=none`"].endswith("| 98.00 | 99.00 | 2.00 | 40 | the baseline |")
    assert body["| `mixup=automix`"].endswith("| 98.33 | 98.61 | 2.30 | 842 | trains |")
    assert body["| `mixup=samix`"].endswith("| **88.0 points below none** |")
    assert body["| `mixup=cmixup data=diabetes model=mlp`"].startswith(
        "| `mixup=cmixup data=diabetes model=mlp` | 55.123 |"
    )
    # one section per model and data, each with its baseline first and columns that say what they hold
    sections = [line for line in rows if line.startswith("## ")]
    assert sections[0] == "## PreActResNet-18 on digits, the default run" and len(sections) == 3
    vit_rows = rows[rows.index("## A ViT on digits (`experiment=vit_digits`)") :]
    assert "AdamW" in vit_rows[2] and "CutMix" in vit_rows[2]
    assert [r for r in vit_rows if r.startswith("| `")][0].startswith("| `mixup=none experiment=vit_digits`")
    assert "| config | test RMSE | best | seconds | |" in rows
    assert rows.count("| config | test accuracy | best | test ECE | seconds | against `mixup=none` |") == 2
    assert body["| `mixup=fmix`"].endswith("| 3 | **failed**: error: mixup.layer: ... |")
    assert body["| `mixup=cmixup data=diabetes model=mlp`"].endswith("| 9 | regression: beside none |")
    # a config on a ViT is compared with mixup=none on the same ViT, not with the default model
    assert body[f"| `mixup=transmix {' '.join(vit)}`"].endswith("| 9 | trains |")
    assert body[f"| `mixup=none {' '.join(vit)}`"].endswith("| the baseline |")
    assert configs.row(results[1], None).endswith("| (mixup=none not run) |")
    # a method's own override (MixPro's cell) is left out of the baseline's: mixup=none has no cell
    assert configs.setting((*vit, "mixup.cell=2")) == vit
    cell = {"name": "mixpro", "where": (*vit, "mixup.cell=2"), "test_acc": 0.1, "best_test_acc": 0.2,
            "test_ece": 0, "seconds": 9}  # fmt: skip
    rows = configs.table([*results, cell], None).splitlines()
    assert next(r for r in rows if r.startswith("| `mixup=mixpro")).endswith("| **42.0 points below none** |")


def test_an_unknown_config_is_refused_in_one_line(capsys):
    with pytest.raises(SystemExit) as exit_:
        configs.main(["--only", "nosuch"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("python -m tools.configs: error: --only: no config nosuch; the configs: none, ")


def test_the_vit_setting_runs_cutmix_and_tokenmix_beside_its_methods_and_its_baseline():
    runs = configs.plan(["transmix"])
    assert runs == [
        ("transmix", ("experiment=vit_digits",)),
        ("cutmix", ("experiment=vit_digits",)),
        ("tokenmix", ("experiment=vit_digits", "mixup.grid=4")),
        ("none", ("experiment=vit_digits",)),
    ]
    assert configs.plan(["input"]) == [("input", ())]  # (the default setting: nothing beside)


def test_update_reads_the_committed_table_back_as_it_was_written():
    """``--update`` keeps the rows it does not run: read back from docs/configs.md, they render to the
    same table (the committed one, rounded as written)."""
    text = configs.TABLE.read_text()
    results, earlier = configs.measured(text)
    assert earlier.startswith("20") and "cores" in earlier
    assert {r["name"] for r in results} >= {"none", "cutmix", "cmixup"}
    assert any(r.get("task") == "regression" for r in results)
    rendered = configs.table(results, None).splitlines()
    body = [line for line in configs.main_table(text).splitlines() if line.startswith("| `mixup=")]
    assert configs.BEGIN in text and len(body) < len(
        [x for x in text.splitlines() if x.startswith("| `mixup=")]
    )
    assert [line for line in rendered if line.startswith("| `mixup=")] == body
    header = configs.table(results, None, earlier, ("mixup=transmix experiment=vit_digits",)).splitlines()[2]
    assert header.startswith(
        f"`python -m tools.configs` on {earlier.split('; the rows of ')[0]}; the rows of "
    )
    assert header.count("`mixup=transmix experiment=vit_digits`") == 1  # (moved to the newest run's rows)
    assert "`mixup=transmix experiment=vit_digits`" in header.rsplit("; the rows of ", 1)[1]  # (the newest)


def test_a_second_update_moves_the_rows_it_reran_to_its_own_day():
    first = configs.rerun_header("2026-01-01 (cpu)", ("mixup=a", "mixup=b x=1"), "2026-02-02 (cpu)")
    assert first == "2026-01-01 (cpu); the rows of `mixup=a`, `mixup=b x=1` on 2026-02-02 (cpu)"
    second = configs.rerun_header(first, ("mixup=a", "mixup=c"), "2026-03-03 (gpu)")
    assert second == (
        "2026-01-01 (cpu); the rows of `mixup=b x=1` on 2026-02-02 (cpu); the rows of `mixup=a`, `mixup=c` "
        "on 2026-03-03 (gpu)"
    )
    assert configs.rerun_header(second, ("mixup=a", "mixup=b x=1", "mixup=c"), "d") == (
        "2026-01-01 (cpu); the rows of `mixup=a`, `mixup=b x=1`, `mixup=c` on d"
    )
    # a later update on the newest run's day and machine joins its group, rather than repeating the day
    assert configs.rerun_header(second, ("mixup=d",), "2026-03-03 (gpu)") == (
        "2026-01-01 (cpu); the rows of `mixup=b x=1` on 2026-02-02 (cpu); the rows of `mixup=a`, `mixup=c`, "
        "`mixup=d` on 2026-03-03 (gpu)"
    )


def test_an_update_keeps_the_day_of_a_row_it_reused_from_an_earlier_run():
    """``--only tla --update`` plans CutMix beside TLA: a CutMix run reused from its run directory, whose
    row the table holds, keeps that row and its day; only what was run (or is new to the table) moves."""
    row = {"test_acc": 0.8, "best_test_acc": 0.8, "test_ece": 0.1, "seconds": 9.0}
    vit = ("experiment=vit_digits",)
    kept = [{"name": "cutmix", "where": vit, **row, "seconds": 1.0}, {"name": "input", "where": (), **row}]
    results = [
        {"name": "tla", "where": vit, **row},  # (run now)
        {"name": "cutmix", "where": vit, "reused": True, **row},  # (the table's row: kept as it is)
        {"name": "none", "where": vit, "reused": True, **row},  # (reused, but new to the table)
    ]
    whole = {("tla", vit), ("cutmix", vit), ("none", vit), ("input", ())}
    rows, rerun = configs.merged(kept, results, whole)
    assert rerun == ("mixup=tla experiment=vit_digits", "mixup=none experiment=vit_digits")
    assert [(r["name"], r["seconds"]) for r in rows] == [
        ("cutmix", 1.0),
        ("input", 9.0),
        ("tla", 9.0),
        ("none", 9.0),
    ]
    assert configs.merged(kept, [results[1]], whole) == (kept, ())  # (nothing new: the table as it is)


def test_the_fashion_mnist_section_sets_each_config_beside_erms_seeds_and_keeps_the_rest(tmp_path):
    """``--fashion-mnist``: each config's seed-0 run (the study's where it has one) beside ERM's five seeds,
    a config outside two of their standard deviations said to be, the ones the setting cannot take said
    why; the section replaces its earlier self between its markers, and a rewrite of the digits table
    keeps it."""
    import json

    import yaml

    def study_run(folder, overrides, seed, acc):
        run = tmp_path / "study" / folder / str(seed)
        (run / ".hydra").mkdir(parents=True)
        (run / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump([f"seed={seed}", *overrides]))
        summary = {"test_acc": acc, "test_nll": 0.3, "test_ece": 0.05, "seconds": 200.0}
        (run / "summary.json").write_text(json.dumps(summary))

    for seed, acc in enumerate([0.887, 0.889, 0.885, 0.886, 0.888]):
        study_run("mixup", ["mixup=none", "experiment=fashion_mnist_study"], seed, acc)
    study_run("puzzlemix", ["mixup=puzzlemix", "mixup.neigh_size=7", "mixup.t_size=7"], 0, 0.905)
    study_run("erasing", ["erasing=random"], 0, 0.8865)
    studied = configs.study_runs(tmp_path / "study")
    baseline = [r for r in studied if r["overrides"] == ("mixup=none",)]
    assert len(baseline) == 5 and {r["seed"] for r in baseline} == set(range(5))
    plan = configs.fashion_plan(["none", "puzzlemix", "transmix", "cmixup", "comixup", "erasing=random"])
    assert plan[2][1] is None and "ViT's attention" in plan[2][2] and "regression" in plan[3][2]
    assert plan[4][1] is None and plan[4][2].startswith("not run:")
    found = {
        (name, extra): configs.fashion_result(name, extra, studied, tmp_path / "runs", 1)
        for name, extra, _ in plan
        if extra is not None
    }
    assert all(r.get("from_study") for r in found.values())  # (nothing run: the study has them all)
    section = configs.fashion_section(plan, found, baseline)
    rows = {line.split(" | ")[0]: line for line in section.splitlines() if line.startswith("| `")}
    assert "test error 11.30 ± 0.16 % (mean ± std; 11.10 to 11.50; seed 0: 11.30)" in section
    assert rows["| `mixup=none`"].endswith("| 11.30 | +0.00 | 0.3000 | 5.00 | 200 | ERM, seed 0 |")
    assert rows["| `mixup=puzzlemix mixup.neigh_size=7 mixup.t_size=7`"].endswith("| **below** (-1.80) |")
    assert rows["| `erasing=random`"].endswith("| within |")
    assert rows["| `mixup=transmix`"].endswith("| n/a (below) |")
    assert rows["| `mixup=comixup`"].endswith("| not run (below) |")
    assert (
        "\n- `mixup=transmix`: each reads a ViT's attention, and the setting's model is a CNN.\n" in section
    )
    text = "# Every shipped config\n\n| a | table |\n"
    once = configs.with_section(text, section)
    assert once.startswith(text) and once.count(configs.BEGIN) == 1
    again = configs.with_section(once, section.replace("11.30", "11.31"))
    assert (
        again.count(configs.BEGIN) == 1 and "11.31" in again and once.split(configs.BEGIN)[0] == text + "\n"
    )

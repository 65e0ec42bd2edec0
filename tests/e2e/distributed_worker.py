"""One torchrun launch (two processes, gloo, CPU) for every data-parallel scenario of the suite that runs in
one job: the library's (per-rank default streams, global_partners_worker.py, fsdp_worker.py), the matrix's
DDP and FSDP2 cells (harness/matrix/distributed.py) and the app's runs under DDP and FSDP
(``mixhook.app.run.main`` on the config Hydra composes for ``train.py``, as train.py runs it). A launch
costs two Python processes importing torch and a rendezvous; each scenario costs only its own work.

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/e2e/distributed_worker.py PLAN.json

``PLAN.json``: ``{"out": path, "folder": path, "scenarios": [{"name": ..., "kind": ..., ...}]}``, each
scenario's kind one of ``default_generator``, ``global_partners``, ``fsdp``, ``matrix`` (``names``,
``modes``) and ``app`` (``overrides``, ``out_dir``). Rank 0 writes ``{name: what the scenario found}`` to
``out``. Every scenario runs in the launch's one process group.
"""

import json
import sys
from pathlib import Path

import torch.distributed as dist
from fsdp_worker import end_without_finalizing, scenarios  # (this script's folder is on sys.path)
from global_partners_worker import scenario as global_partners

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: harness/


def run(scenario: dict, folder: str):
    kind = scenario["kind"]
    if kind == "global_partners":
        return global_partners()
    if kind == "fsdp":
        return scenarios(folder)
    if kind == "matrix":
        from harness.matrix.distributed import cells

        return cells(scenario["names"], tuple(scenario["modes"]))
    if kind == "default_generator":
        return default_generator()
    if kind == "app":
        from harness.app_runs import config
        from mixhook.app import run as app

        return app.main(config(*scenario["overrides"]), out_dir=scenario["out_dir"])
    raise ValueError(f"unknown scenario kind {kind!r}")


def default_generator() -> list:
    """Every rank seeded alike (as a training script does) draws once with a mixer on its default generator
    and once with one given a generator: each rank's two draws and the default mixer's state's ``per_rank``
    entry, gathered from every rank (tests/e2e/test_distributed.py compares them)."""
    import torch

    from mixhook import ManifoldMixup
    from tests.helpers import SmallCNN

    torch.manual_seed(0)
    model = SmallCNN().train()
    x = torch.randn(8, 3, 6, 6)
    default, given = (
        ManifoldMixup("conv1"),
        ManifoldMixup("conv1", generator=torch.Generator().manual_seed(5)),
    )
    draws = []
    for mix in (default, given):
        with mix.attach(model):
            model(x)
            draws.append((float(mix.last.lam), mix.last.index.tolist()))
    found = [None] * dist.get_world_size()
    dist.all_gather_object(found, (draws, default.state_dict()["per_rank"]))
    return found


def main(plan_path: str) -> None:
    with open(plan_path) as f:
        plan = json.load(f)
    dist.init_process_group("gloo")
    # One process group for the whole launch: an app run joins the group it finds (as under train.py, whose
    # Dist.from_env joins torchrun's job) and would leave it at its end; it is kept for the scenarios after
    # it (a rank leaving a group that gloo's threads still work in was seen to hang: fsdp_worker.py's
    # end_without_finalizing says why). train.py's own joining and leaving is tested on its own launches.
    leave, dist.destroy_process_group = dist.destroy_process_group, lambda *args, **kwargs: None
    found = {}
    for scenario in plan["scenarios"]:
        found[scenario["name"]] = run(scenario, plan["folder"])
        dist.barrier()
    dist.destroy_process_group = leave
    if dist.get_rank() == 0:
        with open(plan["out"], "w") as f:
            json.dump(found, f)
    dist.barrier()  # (neither rank ends while the other may still be in its last collective)
    end_without_finalizing()  # (fsdp_worker.py says why: gloo's threads can outlive Python's shutdown)


if __name__ == "__main__":
    main(sys.argv[1])

"""Record GCO's alpha-beta swap on grid problems, for tests/mixers/test_comixup.py to check mixhook's swap
(:mod:`mixhook.solvers.swap`) against where GCO is not installed.

GCO is research-only, so gco-wrapper is no dependency of mixhook or of its tests; this program needs it:

    pip install gco-wrapper && python -m tools.record_gco

It writes tests/recorded/gco_swap.npz: integer problems (unary ``(H, W, L)``, symmetric smooth costs
``(L, L)``, edge weights) and the labels ``gco.cut_grid_graph(..., algorithm="swap")`` ends with. Two kinds:
the graph cuts Co-Mixup's authors' code makes (harness/comixup_reference.py driven by GCO, on random
saliency, grids 2, 4 and 8, parts of 2 to 20, both thresholds), and random problems with many ties (small
integers, random smooth costs) on grids of 2 to 5 sides.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import gco
import numpy as np
import torch

from harness import comixup_reference as ref

KEEP = 150  # Co-Mixup problems kept
OUT = Path(__file__).resolve().parent.parent / "tests" / "recorded" / "gco_swap.npz"


def comixup_problems(seeds: int) -> list[tuple]:
    """The integer problems (and GCO's labels) of the authors' labelling on ``seeds`` random parts."""
    problems = []

    def recording(unary, pairwise, cost_v, cost_h, algorithm="swap"):
        ints = [
            (a * s).astype(np.intc)
            for a, s in ((unary, 100000), (pairwise, 100), (cost_v, 1000), (cost_h, 1000))
        ]
        labels = gco.cut_grid_graph(*ints, algorithm="swap")
        assert (labels == gco.cut_grid_graph(unary, pairwise, cost_v, cost_h, algorithm="swap")).all()
        problems.append((*ints, labels.reshape(unary.shape[:2])))
        return labels

    ref.SOLVER[0] = recording
    for seed in range(seeds):
        g = torch.Generator().manual_seed(seed)
        n, side = (
            (20, 4) if seed % 3 == 0 else (int(torch.randint(2, 13, (), generator=g)), (2, 4, 8)[seed % 3])
        )
        sc = torch.rand(n, side, side, generator=g) ** 3
        cost = -(sc / sc.reshape(n, -1).sum(1).reshape(n, 1, 1))
        dist = torch.randint(0, 20, (n, n), generator=g).float()
        dist = dist + dist.T
        a = 0.999 * torch.eye(n) + 0.001 * (dist / dist.sum() * n)
        prior = torch._sample_dirichlet(torch.full((n,), 2.0), generator=g)
        init = torch.randint(n, (n, side, side), generator=g)
        ref.get_onehot_matrix(
            cost, a, n, prior, init, thres=0.83, thres_type=("hard", "soft")[seed % 2], niter=4
        )
    return problems[:: max(1, len(problems) // KEEP)]  # (every k-th: the file stays small)


def random_problems(count: int, rng: np.random.Generator) -> list[tuple]:
    """Small-integer problems (many equal energies: the ties GCO's max-flow breaks its own way)."""
    problems = []
    for _ in range(count):
        h, w, n_labels = int(rng.integers(2, 6)), int(rng.integers(2, 6)), int(rng.integers(2, 9))
        unary = rng.integers(-3, 4, (h, w, n_labels)).astype(np.intc)
        smooth = rng.integers(0, 3, (n_labels, n_labels)).astype(np.intc)
        smooth = smooth + smooth.T
        np.fill_diagonal(smooth, 0)
        w_v = rng.integers(0, 3, (h - 1, w)).astype(np.intc)
        w_h = rng.integers(0, 3, (h, w - 1)).astype(np.intc)
        labels = gco.cut_grid_graph(unary, smooth, w_v, w_h, algorithm="swap").reshape(h, w)
        problems.append((unary, smooth, w_v, w_h, labels))
    return problems


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=12, help="random Co-Mixup parts")
    parser.add_argument("--random", type=int, default=400, help="random small-integer problems")
    args = parser.parse_args()
    problems = comixup_problems(args.seeds) + random_problems(args.random, np.random.default_rng(0))
    shapes = np.array([p[0].shape for p in problems], dtype=np.int64)
    arrays = {
        name: np.concatenate([np.asarray(p[i], np.int64).reshape(-1) for p in problems])
        for i, name in enumerate(("unary", "smooth", "w_v", "w_h", "labels"))
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(OUT, shapes=shapes, gco_version=np.array(gco.__version__), **arrays)
    print(f"{len(problems)} problems ({args.seeds} Co-Mixup parts, {args.random} random) -> {OUT}")


if __name__ == "__main__":
    main()

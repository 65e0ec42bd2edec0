"""The labelling solvers two methods stand on, apart from the path's ground (:mod:`mixhook.engine`): a grid
labelling's minimum cut for PuzzleMix (:mod:`.graphcut`) and GCO's alpha-beta swap for Co-Mixup
(:mod:`.swap`, compiled by numba in :mod:`.swap_kernels`). Each imports its numerical library (SciPy,
numba) when it first solves: the core imports torch only.

One policy decides how each follows its authors: **where the problem has an exact minimum that a
polynomial solver finds, that minimum; where it has none, the authors' algorithm move for move.**
PuzzleMix's energy (ordered labels, a convex pairwise term) is minimised exactly by one minimum cut
(Ishikawa 2003): :mod:`.graphcut` returns that minimum, which is the authors' labelling wherever their GCO
swap reaches the optimum (on every problem the tests compare with their code) and of lower energy where
their swap stops at a local minimum. Co-Mixup's energy (a general pairwise table over several inputs)
has no such exact minimum, so its labels are whatever the swap's moves reach: :mod:`.swap` runs GCO's
``swap()`` move for move, its ties broken as GCO's max-flow breaks them, and gives the authors' labels
exactly (tested against ``gco`` on recorded and, where installed, live problems).
"""

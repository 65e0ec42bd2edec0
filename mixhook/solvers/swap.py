"""GCO's alpha-beta swap on a grid, move for move: Co-Mixup's labelling (:mod:`mixhook.mixers.comixup`)
without the research-only GCO library its authors call through ``gco-wrapper``.

The energy of labels ``l`` (``0..L-1``) on an ``H x W`` grid, integer terms::

    E(l) = sum_p U[p, l_p] + sum_(p,q) w_pq * V[l_p, l_q]

over the 4-neighbour pairs (``w_v`` between a position and the one below, ``w_h`` the one to its right),
``V`` symmetric with ``V[a, a] + V[b, b] <= V[a, b] + V[b, a]`` (each swap move is then submodular).

GCO's ``swap()`` (GCoptimization.cpp, as ``gco.cut_grid_graph(..., algorithm="swap")`` runs it) starts
from every site labelled 0 and repeats cycles until a cycle lowers the energy no more; a cycle visits the
pairs ``(a, b)``, ``a < b``, for ``a`` ascending and ``b`` descending from ``L - 1``; a move relabels
the sites labelled ``a`` or ``b``, each to ``a`` or ``b``, by a minimum cut. Where several labellings
are minimal, GCO's Boykov-Kolmogorov max-flow gives ``b`` to exactly the sites from which the sink can be
reached in the residual graph: the minimal labelling with the fewest sites at ``b`` (the minimisers of a
submodular energy form a lattice; its least element). That labelling is a property of the energy alone,
so this module finds it with a max-flow of its own (shortest augmenting paths) and gets GCO's labels
exactly (tested against ``gco`` on recorded and, where it is installed, live problems).

Compiled by numba (``pip install 'mixhook[comixup]'``; :mod:`.swap_kernels`), cached on disk after the first
call.
"""

from __future__ import annotations


def _kernels():
    """The compiled kernels (:mod:`.swap_kernels`), imported when first solving: without numba, one
    ImportError naming the extra that installs it."""
    from . import swap_kernels

    return swap_kernels


def grid_neighbours(height: int, width: int, w_v, w_h):
    """Each site's neighbours above, below, left and right (``-1``: none) and the weights of those edges, as
    ``(H*W, 4)`` int64 arrays, from ``w_v`` ``(H-1, W)`` and ``w_h`` ``(H, W-1)``."""
    import numpy as np

    ids = np.arange(height * width).reshape(height, width)
    nbr = np.full((height, width, 4), -1, np.int64)
    weight = np.zeros((height, width, 4), np.int64)
    w_v, w_h = np.asarray(w_v, np.int64), np.asarray(w_h, np.int64)
    nbr[1:, :, 0], weight[1:, :, 0] = ids[:-1], w_v
    nbr[:-1, :, 1], weight[:-1, :, 1] = ids[1:], w_v
    nbr[:, 1:, 2], weight[:, 1:, 2] = ids[:, :-1], w_h
    nbr[:, :-1, 3], weight[:, :-1, 3] = ids[:, 1:], w_h
    return nbr.reshape(-1, 4), weight.reshape(-1, 4)


def swap_labelling(unary, smooth, w_v, w_h):
    """The labels ``(H, W)`` (int64) GCO's ``swap()`` ends with on this grid problem: ``unary`` ``(H, W, L)``,
    ``smooth`` ``(L, L)`` (symmetric), ``w_v`` ``(H-1, W)``, ``w_h`` ``(H, W-1)``, integers (numpy arrays or
    CPU tensors). A problem whose moves would not be submodular, or whose terms could overflow, is refused
    in one line."""
    import numpy as np

    unary, smooth = np.asarray(unary, np.int64), np.asarray(smooth, np.int64)
    height, width, n_labels = unary.shape
    if n_labels < 2 or height * width < 2:
        raise ValueError(
            f"swap_labelling: {height}x{width} sites and {n_labels} labels (GCO needs 2 of each)"
        )
    if smooth.shape != (n_labels, n_labels) or (smooth != smooth.T).any():
        raise ValueError(f"swap_labelling: the smooth costs must be a symmetric {n_labels}x{n_labels} matrix")
    diagonal = np.diag(smooth)
    if (diagonal[:, None] + diagonal[None, :] > smooth + smooth.T).any():
        raise ValueError(
            "swap_labelling: V[a, a] + V[b, b] > V[a, b] + V[b, a] for some labels: not submodular"
        )
    nbr, weight = grid_neighbours(height, width, w_v, w_h)
    if (weight < 0).any():
        raise ValueError("swap_labelling: a negative edge weight")

    def largest(a):  # (as Python integers: np.abs of int64's least value is negative)
        return max(abs(int(a.max())), abs(int(a.min())))

    bound = largest(unary) * height * width + largest(weight) * largest(smooth) * 4 * height * width
    if bound >= 2**62:  # (Python integers: the bound itself cannot wrap around)
        raise ValueError(f"swap_labelling: terms up to {bound} could overflow 64-bit energies")
    labels = _kernels().swap(np.ascontiguousarray(unary.reshape(-1, n_labels)), smooth, nbr, weight)
    return labels.reshape(height, width)

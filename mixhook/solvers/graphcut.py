"""The exact minimum of a grid labelling with ordered labels and a convex pairwise term, by one minimum cut
(Ishikawa, "Exact Optimization for Markov Random Fields with Convex Priors", TPAMI 2003): PuzzleMix's
labelling (:mod:`mixhook.mixers.puzzlemix`), solved without a research-only or GPL graph-cut library.

The energy of labels ``l`` (``0..L-1``) on an ``H x W`` grid, for each of a batch of problems::

    E(l) = sum_p U[p, l_p] + sum_(p,q) w_pq * (l_p - l_q)**2

over the 4-neighbour pairs (``w_v`` between a position and the one below, ``w_h`` the one to its right),
integer terms, ``w >= 0``. Each position is a chain of ``L - 1`` binary variables ``x_k = [l >= k]``
(``x_1 >= x_2 >= ...``, kept by infinite reverse arcs); on such chains ``U`` is linear in the ``x``
(``U[0] + sum_k x_k (U[k] - U[k-1])``) and ``(l_p - l_q)**2`` is a linear term plus ``-2 x_pk x_qm``
for every ``k, m``, which is submodular: so the minimum cut of one graph is the exact minimum (PuzzleMix's
authors run GCO's alpha-beta swap, a local minimum; the two agree where the swap finds the optimum).

The whole batch is one graph of disconnected components, cut by SciPy's maximum flow (Dinic's, BSD
licensed; ``pip install 'mixhook[puzzlemix]'``) on the host, the source side read by one breadth-first
search of the residual graph. Capacities are 32-bit there: every term must fit (checked).
"""

from __future__ import annotations

LIMIT = 2**30  # capacities and a component's total cut stay below this (SciPy's flows are int32)


def _scipy():
    """SciPy's sparse matrices, maximum flow and breadth-first search (and numpy): imported when first
    solving, so that the library's core imports torch only."""
    try:
        import scipy.sparse as sparse
        from scipy.sparse.csgraph import breadth_first_order, maximum_flow
    except ImportError:  # pragma: no cover - scipy is a dependency of the dev and app installs
        raise ImportError(
            "PuzzleMix solves its labelling with SciPy's maximum flow: pip install 'mixhook[puzzlemix]'"
        ) from None
    return sparse, maximum_flow, breadth_first_order


def energy(unary, w_v, w_h, labels):
    """``E(labels)`` of each problem (int64): ``unary`` ``(B, H, W, L)``, ``w_v`` ``(B, H-1, W)``, ``w_h``
    ``(B, H, W-1)``, ``labels`` ``(B, H, W)`` (numpy arrays)."""
    import numpy as np

    u = np.take_along_axis(unary, labels[..., None], -1)[..., 0].sum((1, 2))
    dv = (labels[:, 1:, :] - labels[:, :-1, :]) ** 2
    dh = (labels[:, :, 1:] - labels[:, :, :-1]) ** 2
    return u + (w_v * dv).sum((1, 2)) + (w_h * dh).sum((1, 2))


def min_labelling(unary, w_v, w_h):
    """The labels ``(B, H, W)`` (int64) of least :func:`energy` for each problem, exactly. ``unary``:
    ``(B, H, W, L)`` integers, ``L >= 2``; ``w_v``, ``w_h``: non-negative integers. A problem whose terms
    do not fit 32-bit capacities is refused in one line. Arrays or CPU tensors in; a numpy array out."""
    import numpy as np

    sparse, maximum_flow, breadth_first_order = _scipy()
    unary, w_v, w_h = (np.asarray(a, dtype=np.int64) for a in (unary, w_v, w_h))
    b, h, w, n_labels = unary.shape
    if (w_v < 0).any() or (w_h < 0).any():
        raise ValueError("min_labelling: a negative pairwise weight makes the labelling non-submodular")
    k = n_labels - 1  # chain nodes per position
    positions = h * w
    nodes = b * positions * k
    source, sink = nodes, nodes + 1
    ids = np.arange(nodes).reshape(b, h, w, k)

    linear = np.diff(unary, axis=-1)  # (B, H, W, K): U[k] - U[k - 1], the cost of x_k = 1
    rows, cols, caps = [], [], []
    j = np.arange(1, k + 1)
    for weights, first, second in (
        (w_v, ids[:, :-1, :], ids[:, 1:, :]),
        (w_h, ids[:, :, :-1], ids[:, :, 1:]),
    ):
        wt = weights[..., None]
        # (l_p - l_q)**2 on the chains: x_pj (2j - 1 - 2K) + x_qj (2j - 1) + 2 x_pk (1 - x_qm) for all k, m
        lin_p, lin_q = wt * (2 * j - 1 - 2 * k), wt * (2 * j - 1)
        _add(linear, first, lin_p)
        _add(linear, second, lin_q)
        a = np.broadcast_to(first[..., :, None], (*first.shape, k))
        c = np.broadcast_to(second[..., None, :], (*second.shape[:-1], k, k))
        rows.append(a.reshape(-1))
        cols.append(c.reshape(-1))
        caps.append(np.broadcast_to(2 * wt[..., None], a.shape).reshape(-1))

    flat = linear.reshape(b, -1)
    finite = [np.abs(flat).sum(1)]
    for weights in (w_v, w_h):
        finite.append(2 * k * k * weights.reshape(b, -1).sum(1))
    totals = np.sum(finite, axis=0)  # each problem's total finite capacity: above any of its cuts
    if totals.max(initial=0) >= LIMIT:
        raise ValueError(
            f"min_labelling: a problem's terms sum to {int(totals.max())}, beyond the 32-bit capacities of "
            f"SciPy's maximum flow (< {LIMIT}); scale the energy down"
        )
    node_ids = ids.reshape(-1)
    lin = linear.reshape(-1)
    positive = lin > 0
    rows += [node_ids[positive], np.full((~positive).sum(), source)]
    cols += [np.full(positive.sum(), sink), node_ids[~positive]]
    caps += [lin[positive], -lin[~positive]]
    if k > 1:  # x_(k+1) <= x_k: an infinite arc from each chain's next node back to it
        infinite = np.repeat(totals + 1, positions * (k - 1))
        rows.append(ids[..., 1:].reshape(-1))
        cols.append(ids[..., :-1].reshape(-1))
        caps.append(infinite)
    rows, cols, caps = (np.concatenate(a) for a in (rows, cols, caps))
    keep = caps != 0
    graph = sparse.csr_array(
        (caps[keep].astype(np.int32), (rows[keep], cols[keep])), shape=(nodes + 2, nodes + 2)
    )
    graph.sum_duplicates()
    flow = maximum_flow(graph, source, sink).flow
    residual = (graph - flow).tocsr()
    residual.data[residual.data <= 0] = 0
    residual.eliminate_zeros()
    reached = breadth_first_order(residual, source, directed=True, return_predecessors=False)
    side = np.zeros(nodes + 2, dtype=bool)
    side[reached] = True
    return side[:nodes].reshape(b, h, w, k).sum(-1).astype(np.int64)


def _add(linear, nodes, values) -> None:
    """``linear`` at the chain nodes ``nodes`` (node ids, which index ``linear`` flattened) += ``values``
    (broadcast)."""
    import numpy as np

    flat = linear.reshape(-1)
    np.add.at(flat, nodes.reshape(-1), np.broadcast_to(values, nodes.shape).reshape(-1))

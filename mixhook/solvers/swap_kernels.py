"""The compiled kernels of :mod:`mixhook.solvers.swap` (numba; imported by it when it first solves, so that
the library's core imports torch only). Integer energies, int64 throughout; the work arrays are made once
per problem and handed down."""

from __future__ import annotations

try:
    import numpy as np
    from numba import njit
except ImportError as error:  # pragma: no cover - the comixup extra (in the app's and dev installs) has them
    raise ImportError(
        "Co-Mixup's labelling (GCO's alpha-beta swap) is compiled by numba: pip install 'mixhook[comixup]'"
    ) from error


@njit(cache=True)
def energy(unary, smooth, nbr, weight, labels):
    """``sum_p U[p, l_p] + sum_(p,q) w_pq V[l_p, l_q]``, each neighbour pair once."""
    total = 0
    for p in range(unary.shape[0]):
        total += unary[p, labels[p]]
        for k in range(nbr.shape[1]):
            q = nbr[p, k]
            if q > p:
                total += weight[p, k] * smooth[labels[p], labels[q]]
    return total


@njit(cache=True)
def active_sites(labels, a, b, var, active):
    """The sites labelled ``a`` or ``b``, in order, into ``active``; ``var[p]`` each one's variable (``-1``:
    fixed). Their count."""
    n = 0
    for p in range(labels.shape[0]):
        if labels[p] == a or labels[p] == b:
            var[p] = n
            active[n] = p
            n += 1
        else:
            var[p] = -1
    return n


@njit(cache=True)
def move_graph(unary, smooth, nbr, weight, labels, a, b, var, active, n, cap, tr):
    """The move's binary energy as a graph on ``n`` variables (``x = 1``: ``b``) and the source ``n`` and
    sink ``n + 1``: dense capacities ``cap``. A pair ``E(x_i, x_j) = A, B, C, D`` (at 00, 01, 10, 11) is
    ``A + (C - A) x_i + (D - C) x_j + (B + C - A - D) (1 - x_i) x_j``: an arc ``i -> j`` and two unaries."""
    for i in range(n + 2):
        for j in range(n + 2):
            cap[i, j] = 0
    for i in range(n):
        tr[i] = 0
    for i in range(n):
        p = active[i]
        tr[i] += unary[p, b] - unary[p, a]
        for k in range(nbr.shape[1]):
            q = nbr[p, k]
            if q < 0:
                continue
            w, j = weight[p, k], var[q]
            if j < 0:  # a fixed neighbour: a unary term
                tr[i] += w * (smooth[b, labels[q]] - smooth[a, labels[q]])
            elif q < p:
                ta, tb, tc, td = w * smooth[a, a], w * smooth[a, b], w * smooth[b, a], w * smooth[b, b]
                tr[i] += tc - ta
                tr[j] += td - tc
                cap[i, j] += tb + tc - ta - td
    for i in range(n):
        if tr[i] > 0:
            cap[n, i] = tr[i]  # (paid when x_i = 1: on the sink's side)
        elif tr[i] < 0:
            cap[i, n + 1] = -tr[i]


@njit(cache=True)
def max_flow(cap, size, s, t, queue, parent):
    """Shortest augmenting paths (Edmonds-Karp) on the first ``size`` nodes of ``cap``, in place: ``cap``
    ends as the residual capacities of a maximum flow."""
    while True:
        for i in range(size):
            parent[i] = -1
        parent[s] = s
        queue[0] = s
        head, tail = 0, 1
        while head < tail and parent[t] < 0:
            u = queue[head]
            head += 1
            for v in range(size):
                if parent[v] < 0 and cap[u, v] > 0:
                    parent[v] = u
                    queue[tail] = v
                    tail += 1
        if parent[t] < 0:
            return
        bottleneck = cap[parent[t], t]
        v = t
        while v != s:
            bottleneck = min(bottleneck, cap[parent[v], v])
            v = parent[v]
        v = t
        while v != s:
            cap[parent[v], v] -= bottleneck
            cap[v, parent[v]] += bottleneck
            v = parent[v]


@njit(cache=True)
def reach_sink(cap, size, t, queue, reach):
    """``reach[i] = 1`` for the nodes from which ``t`` can be reached along positive residual capacities."""
    for i in range(size):
        reach[i] = 0
    reach[t] = 1
    queue[0] = t
    head, tail = 0, 1
    while head < tail:
        v = queue[head]
        head += 1
        for u in range(size):
            if reach[u] == 0 and cap[u, v] > 0:
                reach[u] = 1
                queue[tail] = u
                tail += 1


@njit(cache=True)
def swap(unary, smooth, nbr, weight):
    """GCO's ``swap()`` from all sites at label 0 (see :mod:`mixhook.solvers.swap`): the labels."""
    sites, n_labels = unary.shape
    labels = np.zeros(sites, np.int64)
    var, active = np.empty(sites, np.int64), np.empty(sites, np.int64)
    cap, tr = np.empty((sites + 2, sites + 2), np.int64), np.zeros(sites, np.int64)
    queue, parent, reach = (
        np.empty(sites + 2, np.int64),
        np.empty(sites + 2, np.int64),
        np.empty(sites + 2, np.int64),
    )
    new = energy(unary, smooth, nbr, weight, labels)
    old = new + 1
    while old > new:
        old = new
        for a in range(n_labels):
            for b in range(n_labels - 1, a, -1):
                n = active_sites(labels, a, b, var, active)
                if n == 0:
                    continue
                move_graph(unary, smooth, nbr, weight, labels, a, b, var, active, n, cap, tr)
                max_flow(cap, n + 2, n, n + 1, queue, parent)
                reach_sink(cap, n + 2, n + 1, queue, reach)
                for i in range(n):  # b for exactly the sites that reach the sink (GCO's Boykov-Kolmogorov)
                    labels[active[i]] = b if reach[i] else a
        new = energy(unary, smooth, nbr, weight, labels)
    return labels

"""GuidedMixup's authors' pairing, for the tests that compare mixhook's with it (test_policies: the
SaliencyPairing policy; test_guidedmixup: the mixer)."""

import numpy as np


# From 3neutronstar/GuidedMixup (2a09e97): FGVC/Implementor/pairing.pyx's onecycle_cover as Python (the
# .pyx types dropped), and mixup.py's distance_function for 'l2'.
def onecycle_cover(distance_matrix):
    row = col = idx = 0
    np.fill_diagonal(distance_matrix, -np.inf)
    max_idx = np.argmax(distance_matrix)
    sorted_indices = np.zeros(distance_matrix.shape[0], dtype=np.int32)
    row, col = max_idx // distance_matrix.shape[0], max_idx % distance_matrix.shape[0]
    first_row = row
    sorted_indices[row] = col
    distance_matrix[:, row] = -np.inf
    while idx < distance_matrix.shape[0] - 2:
        idx += 1
        row = col
        col = np.argmax(distance_matrix[row])
        sorted_indices[row] = col
        distance_matrix[:, row] = -np.inf
    sorted_indices[col] = first_row
    return sorted_indices


def distance_function(a, b):
    ra = a.view(a.shape[0], -1).unsqueeze(1)
    rb = b.view(b.shape[0], -1).unsqueeze(0)
    return ((ra - rb).norm(dim=-1)).view(a.shape[0], b.shape[0])

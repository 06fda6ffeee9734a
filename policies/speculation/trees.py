"""Token-tree shapes shared by the engine and the simulator: Medusa's tree as paths of head ranks,
and how deep a step verifying a given number of tokens can reach."""
from __future__ import annotations

from itertools import product

MAX_TREE_TOKENS = 63   # kernels' TREE_WINDOW - 1: the tree mask covers 64 positions
# Ranks per head of the default Medusa tree (top-k per head), cut to the heads and depth there are.
DEFAULT_TOP_K = (3, 2, 2, 1, 1, 1, 1, 1)


def tree_paths(tree, num_heads: int, max_depth: int) -> list[tuple[int, ...]]:
    """The Medusa tree as paths of ranks, each after its prefix. `tree`: a list of paths, a list
    of top-k per head (lowest rank sum first), or None (DEFAULT_TOP_K)."""
    depth = min(num_heads, max_depth)
    if tree is None:
        tree = list(DEFAULT_TOP_K[:depth])
    tree = [list(entry) if isinstance(entry, (list, tuple)) else entry for entry in tree]
    if tree and all(isinstance(entry, int) and not isinstance(entry, bool) for entry in tree):
        if any(k < 1 for k in tree):
            raise ValueError(f"speculation tree as top-k per head needs k >= 1, got {tree}")
        paths = [path for length in range(1, min(len(tree), depth) + 1)
                 for path in product(*[range(k) for k in tree[:length]])]
        paths.sort(key=lambda path: (sum(path), len(path)))
    elif tree and all(isinstance(entry, list) and entry for entry in tree):
        paths = [tuple(int(rank) for rank in entry) for entry in tree if len(entry) <= depth]
        known: set[tuple[int, ...]] = set()
        for path in paths:
            if path in known or min(path) < 0 or (len(path) > 1 and path[:-1] not in known):
                raise ValueError(f"speculation tree path {list(path)} repeats, has a negative "
                                 f"rank, or comes before its prefix {list(path[:-1])}")
            known.add(path)
    else:
        raise ValueError(f"speculation tree must be a list of paths of ranks ([[0], [0, 0], "
                         f"[1]]) or of top-k per head ([3, 2, 1]), got {tree!r}")
    if not paths:
        raise ValueError(f"speculation tree {tree!r} has no node within depth {depth}")
    return paths[:MAX_TREE_TOKENS]


def path_parents(paths: list[tuple[int, ...]]) -> list[int]:
    """Per path (a tree node), the index of its prefix's path: its parent (-1: the root)."""
    index = {tuple(path): node for node, path in enumerate(paths)}
    parents = []
    for node, path in enumerate(paths):
        parent = index.get(tuple(path[:-1]), -1) if len(path) > 1 else -1
        if len(path) > 1 and not 0 <= parent < node:
            raise ValueError(f"tree path {list(path)} comes before its prefix or has none")
        parents.append(parent)
    return parents


def node_children(parents: list[int]) -> list[list[int]]:
    """Per node + 1 (entry 0: the root), its children in tree order."""
    children: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for node, parent in enumerate(parents):
        children[parent + 1].append(node)
    return children


def medusa_depth_per_size(paths: list[tuple[int, ...]]) -> list[int]:
    """For each size 0..len(paths): the depth of the tree of its first that many paths."""
    depths = [0]
    for path in paths:
        depths.append(max(depths[-1], len(path)))
    return depths


def lookahead_tokens(window: int, ngram: int, guesses: int) -> int:
    """The most tokens a lookahead step verifies per sequence: (W + G) x (N - 1)."""
    return (window + guesses) * (ngram - 1)


def lookahead_depth_per_size(window: int, ngram: int, guesses: int) -> list[int]:
    """For each size 0..(W + G)(N - 1): N - 1 once one guess fits, else 0."""
    return [ngram - 1 if size >= ngram - 1 else 0
            for size in range(lookahead_tokens(window, ngram, guesses) + 1)]

"""The tree mask's arithmetic (kernels/__init__.py describes the mask), apart so that the kernel
modules import it without their package's dispatcher."""
from __future__ import annotations

TREE_WINDOW = 64   # positions an int64 tree-mask entry covers, its own included


def tree_mask_entry(hidden_distances) -> int:
    """The tree_mask entry (a signed int64 value) of a token that sees every position up to its
    own except those `hidden_distances` (each 1 .. TREE_WINDOW - 1) positions before it."""
    entry = (1 << TREE_WINDOW) - 1
    for distance in hidden_distances:
        if not 1 <= distance < TREE_WINDOW:
            raise ValueError(f"a tree mask hides positions 1..{TREE_WINDOW - 1} before a token, "
                             f"got {distance}")
        entry &= ~(1 << distance)
    return entry - (1 << TREE_WINDOW) if entry >= 1 << (TREE_WINDOW - 1) else entry

"""How the torch attention path groups a step's sequences into padded tiles. Pure Python (no
torch): the kernels (kernels/torch_paged.py) run these tiles, and the profiled cost model's
attention-tile features (sim/cost/profiled/tile_features.py) count the same tiles, so the
simulator sees the padding and the per-tile overhead the engine pays on a CPU.
"""
from __future__ import annotations

# K and V bytes gathered per tile: small enough to stay in cache between the gather and the
# attention that reads it, large enough that the per-tile overhead does not dominate.
TILE_BYTES = 2 << 20


def tile_tokens(block_size: int, kv_bytes_per_token: int, tile_bytes: int = TILE_BYTES) -> int:
    """Padded context tokens one tile may hold (K and V of one layer, at least one block)."""
    return max(block_size, tile_bytes // kv_bytes_per_token)


# Query lengths up to this share tiles with each other but not with longer ones: a speculating
# decode verifies k + 1 <= 16 tokens, and in a tile with a prompt's chunk it would be padded to the
# chunk's length.
MAX_SHORT_QUERY_LEN = 16


def query_class(query_len: int) -> int:
    """0: a decode, 1: a short query (speculative verification, a prompt's last few tokens),
    2: a prefill chunk."""
    return 0 if query_len == 1 else 1 if query_len <= MAX_SHORT_QUERY_LEN else 2


def group_into_tiles(seq_lens: list[int], query_lens: list[int],
                     max_tile_tokens: int) -> list[list[int]]:
    """Sequences (indices) in tiles of similar context length: decodes, short queries and
    prefill chunks apart (a tile pads every query to its longest), each sorted by context
    length, a tile holding as many as fit max_tile_tokens padded context tokens (at least
    one)."""
    classes = [query_class(query_len) for query_len in query_lens]
    order = sorted(range(len(seq_lens)), key=lambda b: (classes[b], -seq_lens[b]))
    tiles: list[list[int]] = []
    tile: list[int] = []
    for seq in order:
        # Longest first, so a tile's first sequence sets its padded length.
        if tile and (classes[seq] != classes[tile[0]]
                     or (len(tile) + 1) * seq_lens[tile[0]] > max_tile_tokens):
            tiles.append(tile)
            tile = []
        tile.append(seq)
    if tile:
        tiles.append(tile)
    return tiles


def tiling_work(seq_lens: list[int], query_lens: list[int], block_size: int,
                max_tile_tokens: int) -> tuple[int, int, int]:
    """For one layer of a step: (number of tiles, padded K/V tokens gathered over all tiles,
    padded query x K/V scores the tiles compute)."""
    tiles = group_into_tiles(seq_lens, query_lens, max_tile_tokens)
    padded_tokens = padded_scores = 0
    for tile in tiles:
        context = -(-seq_lens[tile[0]] // block_size) * block_size
        padded_tokens += len(tile) * context
        padded_scores += len(tile) * context * max(query_lens[b] for b in tile)
    return len(tiles), padded_tokens, padded_scores

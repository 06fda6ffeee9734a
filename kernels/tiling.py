"""How the torch attention path groups a step's sequences into padded tiles. Pure Python (no
torch): the kernels (kernels/reference.py) run these tiles, and the profiled cost model's step
features (sim/step_features.py) count the same tiles, so the simulator sees the padding and the
per-tile overhead the engine pays on a CPU.
"""
from __future__ import annotations

# K and V bytes gathered per tile: small enough to stay in cache between the gather and the
# attention that reads it (on a 2-core EPYC, 2 MiB tiles attend a 64-sequence decode step about
# twice as fast as one batch of every sequence; 0.5 MiB tiles lose to per-tile overhead).
TILE_BYTES = 2 << 20


def tile_tokens(block_size: int, kv_bytes_per_token: int, tile_bytes: int = TILE_BYTES) -> int:
    """Padded context tokens one tile may hold (K and V of one layer, at least one block)."""
    return max(block_size, tile_bytes // kv_bytes_per_token)


def group_into_tiles(seq_lens: list[int], query_lens: list[int],
                     max_tile_tokens: int) -> list[list[int]]:
    """Sequences (indices) in tiles of similar context length: decodes and prefills apart (a
    prefill's query length would pad every decode to it), each sorted by context length, a tile
    holding as many as fit max_tile_tokens padded context tokens (at least one)."""
    is_prefill = [query_len > 1 for query_len in query_lens]
    order = sorted(range(len(seq_lens)), key=lambda b: (is_prefill[b], -seq_lens[b]))
    tiles: list[list[int]] = []
    tile: list[int] = []
    for seq in order:
        # Longest first, so a tile's first sequence sets its padded length.
        if tile and (is_prefill[seq] != is_prefill[tile[0]]
                     or (len(tile) + 1) * seq_lens[tile[0]] > max_tile_tokens):
            tiles.append(tile)
            tile = []
        tile.append(seq)
    if tile:
        tiles.append(tile)
    return tiles


def tiling_work(seq_lens: list[int], query_lens: list[int], block_size: int,
                max_tile_tokens: int) -> tuple[int, int]:
    """(number of tiles, padded K/V tokens gathered over all tiles) for one layer of a step."""
    tiles = group_into_tiles(seq_lens, query_lens, max_tile_tokens)
    padded_tokens = 0
    for tile in tiles:
        context = -(-seq_lens[tile[0]] // block_size) * block_size
        padded_tokens += len(tile) * context
    return len(tiles), padded_tokens

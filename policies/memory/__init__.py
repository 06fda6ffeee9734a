"""KV-cache managers: paged blocks (the default) and the contiguous-reservation baseline."""
from policies.memory.contiguous import ContiguousAllocator
from policies.memory.paged import PagedBlockManager

__all__ = ["ContiguousAllocator", "PagedBlockManager"]

"""The default LoRA manager: `max_loras` device slots, a host pool, LRU eviction of adapters no
running request uses; `finish_step` sums the plan's LoRA features once so no executor loops over
the sequences."""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence as Seq

from policies.types import Request, StepLoRA, StepPlan
from policies.validators import positive_int


class LRULoRAManager:
    """Adapter slots on one replica's device, least recently used evicted first."""

    def __init__(self, ranks: Seq[int], max_loras: int, max_cpu_loras: int | None = None):
        self.ranks = tuple(positive_int(f"lora.ranks[{index}]", rank)
                           for index, rank in enumerate(ranks))
        self.max_loras = positive_int("lora.max_loras", max_loras)
        self.max_cpu_loras = (None if max_cpu_loras is None
                              else positive_int("lora.max_cpu_loras", max_cpu_loras))
        self.slots: OrderedDict[int, int] = OrderedDict()   # adapter -> slot, LRU first
        self._free_slots = list(range(self.max_loras - 1, -1, -1))
        self._host: OrderedDict[int, None] = OrderedDict()   # adapters in host memory, LRU first
        self.batch_loras: set[int] = set()   # includes those admitted in the step being planned
        self.num_loads = 0            # host -> device adapter loads
        self.num_host_misses = 0      # loads of an adapter not in the host pool (read first)
        self.num_load_ranks = 0       # sum of the loaded adapters' ranks
        self.max_loras_in_a_step = 0  # the most distinct adapters one step ran

    def track(self, requests: Iterable[Request]) -> None:
        self.batch_loras = {request.lora_id for request in requests
                            if request.lora_id is not None}

    def fits(self, lora_id: int | None) -> bool:
        return (lora_id is None or lora_id in self.batch_loras
                or len(self.batch_loras) < self.max_loras)

    def admitted(self, lora_id: int | None) -> None:
        if lora_id is not None:
            self.batch_loras.add(lora_id)

    def is_loaded(self, lora_id: int) -> bool:
        return lora_id in self.slots

    def finish_step(self, plan: StepPlan, running: Iterable[Request]) -> None:
        ranks = self.ranks
        spec_lens = plan.spec_lens
        adapters: dict[int, None] = {}
        token_ranks = 0
        for seq, num_new in zip(plan.seqs, plan.num_new_tokens):
            lora_id = seq.request.lora_id
            if lora_id is not None:
                adapters[lora_id] = None
                token_ranks += (num_new + spec_lens.get(seq.seq_id, 0)) * ranks[lora_id]
        if len(adapters) > self.max_loras:
            raise RuntimeError(f"a step holds {len(adapters)} LoRA adapters, more than "
                               f"lora.max_loras={self.max_loras}: its scheduler admitted past "
                               f"LoRAManager.fits")
        slots = self.slots
        loads = []
        in_use = None
        for lora_id in adapters:
            if lora_id in slots:
                slots.move_to_end(lora_id)
                continue
            if not self._free_slots:
                if in_use is None:
                    in_use = {request.lora_id for request in running}
                    in_use.update(adapters)
                victim = next((loaded for loaded in slots if loaded not in in_use), None)
                if victim is None:
                    raise RuntimeError(f"no LoRA slot free of lora.max_loras={self.max_loras}: "
                                       f"every loaded adapter is in use")
                self._free_slots.append(slots.pop(victim))
            slot = self._free_slots.pop()
            slots[lora_id] = slot
            loads.append((lora_id, slot))
            self._to_host(lora_id)
        load_rank_sum = sum([ranks[lora_id] for lora_id, _ in loads])
        plan.lora = StepLoRA(tuple(loads), slots, len(adapters),
                             sum([ranks[lora_id] for lora_id in adapters]), token_ranks,
                             load_rank_sum)
        if loads:
            self.num_loads += len(loads)
            self.num_load_ranks += load_rank_sum
        if len(adapters) > self.max_loras_in_a_step:
            self.max_loras_in_a_step = len(adapters)

    def _to_host(self, lora_id: int) -> None:
        """The adapter passes through the host pool on its way to the device."""
        host = self._host
        if lora_id in host:
            host.move_to_end(lora_id)
            return
        self.num_host_misses += 1
        host[lora_id] = None
        if self.max_cpu_loras is not None and len(host) > self.max_cpu_loras:
            host.popitem(last=False)

    def summary(self) -> dict:
        return {"lora_loads": self.num_loads, "lora_host_misses": self.num_host_misses,
                "lora_max_adapters_in_a_step": self.max_loras_in_a_step}

"""The reference for the engine's multi-LoRA outputs: HF + PEFT holding one adapter alone, which
the LoRA tests compare the engine's mixed-adapter batches against (peft imported when called)."""
from __future__ import annotations

import copy

import torch

from engine.lora import LoRAAdapters, adapter_weights, target_shapes


def peft_model(base: torch.nn.Module, adapters: LoRAAdapters, index: int) -> torch.nn.Module:
    """A PeftModel on a copy of `base` (a model without the engine's LoRA wrappers) holding
    adapter `index` alone, its A and B those engine/lora.py's adapter_weights draws."""
    from peft import LoraConfig, get_peft_model

    rank = adapters.ranks[index]
    config = LoraConfig(r=rank, lora_alpha=adapters.spec.alpha or rank, lora_dropout=0.0,
                        target_modules=list(adapters.target_modules))
    model = get_peft_model(copy.deepcopy(base), config)
    weights = adapter_weights(adapters, index, target_shapes(base, adapters.target_modules))
    with torch.no_grad():
        for name, (lora_a, lora_b) in weights.items():
            module = model.base_model.model.get_submodule(name)
            module.lora_A["default"].weight.copy_(lora_a)
            module.lora_B["default"].weight.copy_(lora_b)
    return model.eval()

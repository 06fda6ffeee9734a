"""Multi-LoRA serving: the adapters' description (spec.py) and the adapter-slot manager
(manager.py)."""

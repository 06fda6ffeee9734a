"""Load the model the engine runs: a conf/model shape with seeded random weights, or a local HF
checkpoint folder through the real from_pretrained path. Nothing is fetched from a hub."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import OmegaConf

import conf
from runtime.specs import ModelSpec

MODEL_CONFIG_DIR = Path(conf.__file__).parent / "model"
REPO_ROOT = MODEL_CONFIG_DIR.parent.parent
# Wide enough that greedy outputs depend on the context: with HF's default 0.02 a random Llama
# answers every prompt with one repeated token, and an equivalence test proves nothing.
RANDOM_INITIALIZER_RANGE = 0.1
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")


@dataclass
class LoadedModel:
    model: torch.nn.Module          # an HF *ForCausalLM, eval mode, on its device
    spec: ModelSpec                 # its shape, for the KV arithmetic
    tokenizer: object | None        # when the checkpoint folder has one
    eos_token_id: int | None


def resolve_dtype(dtype, spec: ModelSpec, device: torch.device) -> torch.dtype:
    """A dtype name or torch.dtype; None (a checkpoint folder's default): fp32 on CPU, on CUDA
    the spec's width (2 bytes -> bf16, 4 -> fp32)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None or dtype == "auto":
        if device.type != "cuda" or spec.dtype_bytes == 4:
            return torch.float32
        return torch.bfloat16 if spec.dtype_bytes == 2 else torch.float16
    names = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16,
             "fp16": torch.float16, "half": torch.float16, "bfloat16": torch.bfloat16,
             "bf16": torch.bfloat16}
    if dtype not in names:
        raise ValueError(f"dtype must be one of {sorted(names)} or a torch.dtype, got {dtype!r}")
    return names[dtype]


def conf_dtype(spec: ModelSpec) -> torch.dtype:
    """The dtype a conf/model entry declares (dtype_bytes: 4 fp32, 2 bf16), on every device."""
    if spec.dtype_bytes not in (2, 4):
        raise ValueError(f"model {spec.name}: dtype_bytes {spec.dtype_bytes} has no dtype the "
                         f"engine loads (4: fp32, 2: bf16); pass dtype= to choose one")
    return torch.float32 if spec.dtype_bytes == 4 else torch.bfloat16


def load_model(model: str, device: torch.device, dtype=None, seed: int = 0) -> LoadedModel:
    """`model` as a checkpoint folder (dtype None: resolve_dtype's default) or a conf/model
    name (dtype None: the entry's own, conf_dtype, whatever the device)."""
    path = Path(model).expanduser()
    if path.is_dir():
        return _load_checkpoint(path, device, dtype)
    config_file = MODEL_CONFIG_DIR / f"{model}.yaml"
    if config_file.is_file():
        spec = ModelSpec.from_config(OmegaConf.load(config_file))
        if dtype is None or dtype == "auto":
            dtype = conf_dtype(spec)
        if spec.checkpoint is not None:
            return _load_named_checkpoint(spec, device, dtype)
        return _build_random(spec, device, dtype, seed)
    known = sorted(p.stem for p in MODEL_CONFIG_DIR.glob("*.yaml"))
    raise ValueError(f"model={model!r} is neither a local checkpoint folder nor one of {known}")


def random_config(spec: ModelSpec):
    """The HF config of `spec` with random weights: a LlamaConfig, or a MixtralConfig for a
    mixture of experts (Mixtral's `intermediate_size` is one expert's width)."""
    from transformers import LlamaConfig, MixtralConfig

    if spec.mlp != "gated" or spec.bias or spec.num_position_embeddings:
        raise ValueError(f"{spec.name} is not Llama-shaped; random weights are only built for "
                         f"Llama-shaped configs; give a local checkpoint folder instead")
    shape = dict(
        vocab_size=spec.vocab_size, hidden_size=spec.hidden_size,
        num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads, head_dim=spec.head_dim,
        max_position_embeddings=spec.max_model_len,
        tie_word_embeddings=spec.tie_word_embeddings,
        initializer_range=RANDOM_INITIALIZER_RANGE, bos_token_id=1, eos_token_id=2,
        pad_token_id=0)
    if not spec.is_moe:
        return LlamaConfig(intermediate_size=spec.intermediate_size, **shape)
    if spec.shared_expert_intermediate_size:
        raise ValueError(f"model {spec.name}: shared_expert_intermediate_size="
                         f"{spec.shared_expert_intermediate_size}: random weights are built for "
                         f"Mixtral-shaped mixtures only (no shared experts); give a local "
                         f"checkpoint folder instead")
    return MixtralConfig(intermediate_size=spec.moe_intermediate_size,
                         num_local_experts=spec.num_experts,
                         num_experts_per_tok=spec.num_experts_per_tok, **shape)


def _build_random(spec: ModelSpec, device: torch.device, dtype, seed: int) -> LoadedModel:
    from transformers import AutoModelForCausalLM

    config = random_config(spec)
    torch_dtype = resolve_dtype(dtype, spec, device)
    # Seeded without disturbing the caller's global RNG; built on the target device in the
    # target dtype (a 7B model in fp32 first would need twice the memory).
    devices = []
    if device.type == "cuda":
        devices = [device.index if device.index is not None else torch.cuda.current_device()]
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    model.eval().requires_grad_(False)
    spec = _with_dtype(spec, torch_dtype)
    return LoadedModel(model, spec, None, config.eos_token_id)


def _load_named_checkpoint(spec: ModelSpec, device: torch.device, dtype) -> LoadedModel:
    """A conf/model entry's `checkpoint` folder, checked against the shape the simulator costs."""
    path = Path(spec.checkpoint).expanduser()
    path = path if path.is_absolute() else REPO_ROOT / path
    if not path.is_dir():
        raise ValueError(f"model {spec.name}: checkpoint folder {path} does not exist")
    loaded = _load_checkpoint(path, device, dtype)
    shape = ("num_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
             "head_dim", "intermediate_size", "vocab_size", "num_experts", "num_experts_per_tok",
             "moe_intermediate_size", "shared_expert_intermediate_size")
    differing = [f"{name} {getattr(spec, name)} vs {getattr(loaded.spec, name)}" for name in shape
                 if getattr(spec, name) != getattr(loaded.spec, name)]
    if differing:
        raise ValueError(f"model {spec.name}: conf/model/{spec.name}.yaml and its checkpoint "
                         f"{path} differ: {', '.join(differing)}")
    loaded.spec = dataclasses.replace(loaded.spec, name=spec.name)
    return loaded


def _load_checkpoint(path: Path, device: torch.device, dtype) -> LoadedModel:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from transformers.utils import logging as hf_logging

    config = AutoConfig.from_pretrained(path, local_files_only=True)
    spec = spec_from_hf_config(config, name=path.name)
    torch_dtype = resolve_dtype(dtype, spec, device)
    # A local load takes milliseconds: its per-tensor progress bar would only bury the run's own.
    bar_was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True,
                                                     dtype=torch_dtype)
    finally:
        if bar_was_on:
            hf_logging.enable_progress_bar()
    model.to(device).eval().requires_grad_(False)
    tokenizer = None
    if any((path / name).is_file() for name in TOKENIZER_FILES):
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    eos = config.eos_token_id
    if isinstance(eos, (list, tuple)):
        eos = eos[0] if eos else None
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    return LoadedModel(model, _with_dtype(spec, torch_dtype), tokenizer, eos)


def spec_from_hf_config(config, name: str) -> ModelSpec:
    """The ModelSpec of an HF decoder config (Llama family field names; a mixture of experts in
    Mixtral's, Qwen2-MoE's or Qwen3-MoE's, expert_fields)."""
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = text_config.num_attention_heads
    return ModelSpec(
        name=name,
        num_layers=text_config.num_hidden_layers,
        hidden_size=text_config.hidden_size,
        num_attention_heads=heads,
        num_key_value_heads=getattr(text_config, "num_key_value_heads", None) or heads,
        head_dim=getattr(text_config, "head_dim", None) or text_config.hidden_size // heads,
        intermediate_size=text_config.intermediate_size,
        vocab_size=text_config.vocab_size,
        max_model_len=text_config.max_position_embeddings,
        tie_word_embeddings=bool(getattr(text_config, "tie_word_embeddings", False)),
        **expert_fields(text_config, name),
    )


def expert_fields(text_config, name: str) -> dict:
    """ModelSpec's mixture-of-experts fields from an HF text config ({} for a dense model); a
    mixture with dense layers among its expert layers is refused, as every layer is costed alike."""
    if getattr(text_config, "n_routed_experts", None):
        raise ValueError(f"{name}: DeepSeek-style mixtures (n_routed_experts) are not supported; "
                         f"Mixtral and Qwen MoE configs are")
    num_experts = (getattr(text_config, "num_local_experts", None)
                   or getattr(text_config, "num_experts", None) or 0)
    if not num_experts:
        return {}
    sparse_step = getattr(text_config, "decoder_sparse_step", None) or 1
    dense_layers = list(getattr(text_config, "mlp_only_layers", None) or [])
    if sparse_step != 1 or dense_layers:
        raise ValueError(f"{name}: decoder_sparse_step={sparse_step}, mlp_only_layers="
                         f"{dense_layers}: a mixture with dense MLP layers is not supported "
                         f"(every layer must be an expert layer)")
    return dict(num_experts=num_experts,
                num_experts_per_tok=text_config.num_experts_per_tok,
                moe_intermediate_size=(getattr(text_config, "moe_intermediate_size", None)
                                       or text_config.intermediate_size),
                shared_expert_intermediate_size=(
                    getattr(text_config, "shared_expert_intermediate_size", None) or 0))


def _with_dtype(spec: ModelSpec, dtype: torch.dtype) -> ModelSpec:
    from dataclasses import replace
    return replace(spec, dtype_bytes=torch.empty((), dtype=dtype).element_size())

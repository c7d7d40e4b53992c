"""zeropp.models: small models for experiments and tests (no downloads needed).

``hf`` (Hugging Face GPT-2 / Llama behind the same contract) needs the optional extra
``pip install -e ".[hf]"`` only when a model is built; its config imports without it.
"""

from .gpt import BYTE_VOCAB, GPT, Block, GPTConfig, byte_batch
from .hf import HFCausalLM, HFConfig, build_hf_model
from .lora import LoRALinear, apply_lora, lora_parameters

__all__ = [
    "BYTE_VOCAB",
    "GPT",
    "Block",
    "GPTConfig",
    "HFCausalLM",
    "HFConfig",
    "LoRALinear",
    "apply_lora",
    "build_hf_model",
    "byte_batch",
    "lora_parameters",
]

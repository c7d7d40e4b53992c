"""zeropp.models: small models for experiments and tests (no downloads needed)."""

from .gpt import BYTE_VOCAB, GPT, Block, GPTConfig, byte_batch

__all__ = ["BYTE_VOCAB", "GPT", "Block", "GPTConfig", "byte_batch"]

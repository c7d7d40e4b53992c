"""Test-wide setup. TRITON_INTERPRET must be set before triton is first imported so the Triton
kernels run on CPU tensors; nothing in the suite needs a GPU."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")

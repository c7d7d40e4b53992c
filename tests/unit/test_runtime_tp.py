"""ZeRO with tensor parallelism (``Topology(tp=2)``): exact against one unsplit process in fp32.

Here: the one-process checks. The topic's full description and its gloo-world checks are in
``tests/distributed/test_runtime_tp.py``.
"""

from __future__ import annotations

import pytest
import torch

from tests.runtime_helpers import TINY
from zeropp.models import GPT

CFG = TINY  # d_model 32, 2 heads, MLP 128: tp=2 splits one head per rank
LLAMA = dict(
    hf_config="llama", vocab_size=256, seq_len=16, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=64
)


# ---------------------------------------------------------------------------- bad input
def test_topology_tp_must_divide_the_node() -> None:
    from zeropp.comm import Topology

    with pytest.raises(ValueError, match=r"Topology.tp=3 must be a positive divisor of ranks_per_node=4"):
        Topology(nodes=2, ranks_per_node=4, tp=3)
    with pytest.raises(ValueError, match=r"multiple of tp=2"):
        Topology(nodes=1, ranks_per_node=4, tp=2, hpz_size=1)
    t = Topology(nodes=2, ranks_per_node=4, tp=2)
    assert t.dp_size == 4 and t.dp_ranks(5) == [1, 3, 5, 7] and t.tp_ranks(5) == [4, 5]
    assert t.intra_ranks(5) == [5, 7] and t.cross_ranks(5) == [1, 5] and t.hpz_ranks(5) == [5, 7]


def test_tp_must_divide_heads_and_widths() -> None:
    from zeropp.runtime.tensor_parallel import check_tp

    with pytest.raises(ValueError, match=r"tp=4 must divide the GPT's attention heads model.n_heads=2"):
        check_tp(GPT(CFG), 4)
    with pytest.raises(ValueError, match=r"has plans for the built-in GPT and the Hugging Face Llama only"):
        check_tp(torch.nn.Linear(4, 4), 2)
    from zeropp.models.hf import HFConfig, check_hf_tp

    with pytest.raises(ValueError, match=r"key/value heads model.n_kv_heads=1"):
        check_hf_tp(HFConfig(**{**LLAMA, "n_kv_heads": 1}), 2)
    with pytest.raises(ValueError, match=r"hf_config=llama only"):
        check_hf_tp(HFConfig(hf_config="gpt2"), 2)


def _runner_cfg(*overrides: str) -> dict:
    from hydra import compose, initialize_config_module
    from omegaconf import OmegaConf

    import zeropp.experiments.runner.run  # noqa: F401 - registers the generated schema and groups

    with initialize_config_module(config_module="zeropp.conf", version_base="1.3"):
        return OmegaConf.to_container(compose("config", overrides=list(overrides)), resolve=True)  # type: ignore[return-value]


def test_runner_config_validates_tp() -> None:
    from zeropp.experiments.runner.config import ConfigError, from_dict

    rc = from_dict(_runner_cfg("topology=2x2", "topology.tp=2", "stage=3"))
    assert rc.topology.tp == 2 and rc.topology.dp_size == 2
    with pytest.raises(ConfigError, match=r"topology.tp=2 with trainer=fsdp2"):
        from_dict(_runner_cfg("topology=2x2", "topology.tp=2", "trainer=fsdp2"))
    with pytest.raises(ConfigError, match=r"tp=4 must divide the GPT's attention heads"):
        from_dict(_runner_cfg("topology=1x4", "topology.tp=4", "stage=3"))
    with pytest.raises(ConfigError, match=r"topology.tp=3 must be a positive divisor of ranks_per_node=2"):
        from_dict(_runner_cfg("topology=2x2", "topology.tp=3"))
    assert (
        from_dict(_runner_cfg("topology=2x2", "topology.tp=2", "train.checkpoint_every=5")).train.checkpoint_every == 5
    )

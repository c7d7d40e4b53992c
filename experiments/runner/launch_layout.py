"""The run's config validated against how it was launched: under torchrun the node layout
(``topology.nodes`` / ``topology.ranks_per_node``) not given on the command line is torchrun's
(:func:`validated`), and one that is given must agree with it (:func:`check_launch`), checked on
every rank before it joins anything. Without torchrun the local launcher poses the layout the
command line names (``topology=NxR``) on this one host, and only :func:`validated` applies.
"""

from __future__ import annotations

import copy
import os
from typing import Any, Mapping

from omegaconf import DictConfig, OmegaConf

from zeropp.comm.layout import LaunchLayout

from .config import ConfigError, RunConfig, from_omegaconf
from .launcher import in_torchrun

__all__ = ["LAYOUT_KEYS", "check_launch", "declared_layout", "validated"]


LAYOUT_KEYS = {
    "topology": ("nodes", "ranks_per_node"),
    "topology.nodes": ("nodes",),
    "topology.ranks_per_node": ("ranks_per_node",),
}
"""Overrides that declare the node layout (``topology=2x2`` both fields); under torchrun the fields
not declared come from the launcher."""


def declared_layout(overrides: list[str]) -> set[str]:
    """Which of ``topology.nodes`` / ``topology.ranks_per_node`` the command line sets (Hydra's
    ``key=value``, ``+key=value``, ``++key=value``); ``topology.tp`` alone declares neither."""
    out: set[str] = set()
    for arg in overrides:
        key = arg.split("=", 1)[0].lstrip("+~")
        out.update(LAYOUT_KEYS.get(key, ()))
    return out


def _launch_layout(env: Mapping[str, str] | None) -> LaunchLayout | None:
    """The layout torchrun started (``env``; None: this process's environment when it is a
    torchrun rank, else no layout)."""
    if env is None:
        if not in_torchrun():
            return None
        env = os.environ
    try:
        return LaunchLayout.from_env(env)
    except ValueError as e:
        raise ConfigError(f"invalid launch: {e}") from None


def validated(cfg: DictConfig, overrides: list[str], env: Mapping[str, str] | None = None) -> RunConfig:
    """The composed config validated into a RunConfig (``config.from_omegaconf``). Under torchrun
    (``env``: its environment, None: this process's) the ``topology.nodes`` /
    ``topology.ranks_per_node`` not on the command line are the launcher's nodes and local ranks,
    so every setting is checked against the topology that will run."""
    layout = _launch_layout(env)
    fill = (
        {}
        if layout is None
        else {k: getattr(layout, k) for k in ("nodes", "ranks_per_node") if k not in declared_layout(overrides)}
    )
    if fill:
        cfg = copy.deepcopy(cfg)
        for k, v in fill.items():
            OmegaConf.update(cfg, f"topology.{k}", v)
    try:
        return from_omegaconf(cfg)
    except ConfigError as e:
        if not fill:
            raise
        assert layout is not None
        raise ConfigError(
            f"{e} (with {' '.join(f'topology.{k}={v}' for k, v in fill.items())} from the layout "
            f"torchrun started: {layout.describe()})"
        ) from None


def check_launch(rc: RunConfig, overrides: list[str], env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Under torchrun, before this rank joins anything: the run's topology must be the layout
    torchrun started (ranks numbered node by node, checked by ``LaunchLayout.from_env``); a
    declared one that contradicts it is a ConfigError naming both and the fix, raised on every rank
    alike. Returns what the summary records about the launch."""
    t = rc.topology
    layout = _launch_layout(env)
    if layout is None:  # a launcher that names no node layout: only the world size can be checked
        launched = int((os.environ if env is None else env)["WORLD_SIZE"])
        if launched != rc.world_size:
            raise ConfigError(
                f"invalid config: torchrun started {launched} ranks but topology.nodes x "
                f"topology.ranks_per_node = {t.nodes} x {t.ranks_per_node} = {rc.world_size}; pass "
                "topology.nodes=<nodes> topology.ranks_per_node=<ranks per node> multiplying to "
                f"{launched}"
            )
        return {"cluster": "torchrun"}
    declared = declared_layout(overrides)
    try:
        layout.check(t)
    except ValueError as e:
        drop = " ".join(f"topology.{k}" for k in sorted(declared)) or "topology.*"
        raise ConfigError(
            f"invalid config: {e}; drop {drop} (the launcher's layout is the default) or pass "
            f"topology.nodes={layout.nodes} topology.ranks_per_node={layout.ranks_per_node}. To pose as several nodes "
            "on one host, launch without torchrun: python -m experiments.run topology=<nodes>x<ranks per node>"
        ) from None
    return {
        "cluster": "torchrun",
        "nodes": layout.nodes,
        "ranks_per_node": layout.ranks_per_node,
        "declared": sorted(f"topology.{k}" for k in declared),
    }

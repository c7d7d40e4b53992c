"""``zero.transport=shm`` refused where it cannot work, before anything starts: an unknown
transport, a ZeRO group over several nodes, GPU ranks, a ``/dev/shm`` without room for the
region; the default ``auto`` refused nowhere (it falls back to the backend instead), and its record
read as the runner prints it; and the launcher's scratch cleanup removes a region file a killed
rank 0 left (only ours)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.experiment_helpers import composed_config
from zeropp.comm.shm import DEFAULT_REGION_BYTES
from zeropp.comm.shm_choice import TransportChoice
from zeropp.experiments.runner import preflight
from zeropp.experiments.runner.config import ConfigError, from_dict
from zeropp.experiments.runner.console import transport_rows
from zeropp.runtime import ZeroConfig
from zeropp.runtime.config import validate_against_topology
from zeropp.watch import remove_scratch

pytestmark = pytest.mark.unit


def test_unknown_transport_is_refused():
    with pytest.raises(ValueError, match=r"transport must be one of \('auto', 'backend', 'shm'\), got 'tcp'"):
        ZeroConfig(transport="tcp")  # type: ignore[arg-type]
    assert ZeroConfig(transport="shm").transport == "shm"  # type: ignore[arg-type]


def test_shared_memory_over_several_nodes_is_refused():
    cfg = ZeroConfig(transport="shm")  # type: ignore[arg-type]
    validate_against_topology(cfg, 4, 1, 4)  # one node: fine
    with pytest.raises(ValueError, match=r"spans 2 nodes; use transport='backend'"):
        validate_against_topology(cfg, 4, 2, 2)


def test_gpu_ranks_are_refused_before_launch():
    rc = from_dict(composed_config("zero.transport=shm", "topology=1x2", "launcher.device=cuda"))
    with pytest.raises(ConfigError, match=r"moves CPU tensors .* zero.transport=backend"):
        preflight.check_shm(rc)


def test_too_little_shared_memory_is_refused_before_launch(monkeypatch):
    rc = from_dict(composed_config("zero.transport=shm", "topology=1x4", "launcher.device=cpu"))
    monkeypatch.setattr(preflight, "disk_free", lambda path: DEFAULT_REGION_BYTES - 1)
    with pytest.raises(ConfigError, match=r"needs 32.00 MiB under /dev/shm but it has .* --shm-size"):
        preflight.check_shm(rc)
    monkeypatch.setattr(preflight, "disk_free", lambda path: DEFAULT_REGION_BYTES)
    preflight.check_shm(rc)  # room for it: no error
    backend = from_dict(composed_config("topology=1x4", "launcher.device=cpu"))
    monkeypatch.setattr(preflight, "disk_free", lambda path: 0)
    preflight.check_shm(backend)  # the backend's transport needs no shared memory


def test_scratch_cleanup_removes_a_recorded_region_file_only(tmp_path: Path):
    world, shm = tmp_path / "world", tmp_path / "shm"
    world.mkdir()
    shm.mkdir()
    rid = "abc123def456"
    mine = shm / f"zeropp-shm-{rid}-r0-k2j4"
    mine.write_bytes(b"\0" * 64)
    theirs = shm / "zeropp-shm-0123456789ab-r0-zz"  # another run's region
    theirs.write_bytes(b"\0")
    (world / "scratch.0").write_text(json.dumps({"root": str(shm), "prefix": f"zeropp-shm-{rid}-r0-"}) + "\n")
    removed, problems = remove_scratch(world, rid)
    assert removed == [str(mine)] and problems == []
    assert os.listdir(shm) == [theirs.name]


def test_auto_is_the_default_and_is_refused_nowhere(monkeypatch):
    """``auto`` resolves in the ranks (the backend where shm cannot work): no refusal for several
    nodes, GPU ranks or a full ``/dev/shm``, where an explicit ``shm`` is refused."""
    cfg = ZeroConfig()
    assert cfg.transport == "auto"
    validate_against_topology(cfg, 4, 2, 2)  # several nodes: the ranks resolve it to the backend
    monkeypatch.setattr(preflight, "disk_free", lambda path: 0)
    for overrides in (("topology=1x2", "launcher.device=cuda"), ("topology=1x4", "launcher.device=cpu")):
        rc = from_dict(composed_config(*overrides))
        assert rc.zero.transport == "auto"
        preflight.check_shm(rc)


def test_the_resolved_transport_reads_as_requested_resolved_and_why():
    auto = TransportChoice(requested="auto", resolved="backend", reason="the group spans 2 nodes")
    assert str(auto) == "transport=auto -> backend (the group spans 2 nodes)"
    assert str(TransportChoice(requested="shm", resolved="shm", reason="")) == "transport=shm"
    assert transport_rows(auto.as_dict()) == [("zero.transport", "auto -> backend (the group spans 2 nodes)")]
    assert transport_rows({}) == []  # a trainer without a transport of its own: no row
    with pytest.raises(ValueError, match=r"resolved backend or shm; got 'auto' -> 'auto'"):
        TransportChoice(requested="auto", resolved="auto", reason="")

"""The launcher: the one way a world of ranks is started on one host (torch's elastic
multiprocessing, watched).

Holds ``world.py`` (:func:`launch_world`, the rank bootstrap and the watch loop) and
``failure.py`` (which rank caused a failed world, and its error text). The runner
(``runner/launcher.py`` adds the emulated cluster's placement and the runner's one call), the
projection's calibration (``projection/scaling_check.py``), the studies and the tests
(``tests/worlds.py::run_world``) all start their ranks here.

Why a room of its own, below the others: four rooms and the tests start worlds, and the
projection may not import the runner, so the launcher cannot live inside ``runner/``. It imports
no other room, only the library (``zeropp.watch``: the heartbeats and scratch directories the
library's swap files also use stay in the library). Not in the library itself: the library never
starts processes; starting them is the harness's job.

Public API::

    from zeropp.experiments.launch import LOCAL, ModuleEntry, RankFailure, launch_world
    launch_world(fn, 4, args=(x,), process_group="gloo", timeout_s=60)  # -> [fn(0, 4, x), ..]
"""

from zeropp.watch import heartbeat

from .failure import RankFailure, RunInterrupted
from .placement import (
    LAUNCHED_MARK,
    LOCAL,
    ModuleEntry,
    Placement,
    PlacementError,
    free_port,
    in_torchrun,
    select_device,
)
from .world import launch_world

__all__ = [
    "LAUNCHED_MARK",
    "LOCAL",
    "ModuleEntry",
    "Placement",
    "PlacementError",
    "RankFailure",
    "RunInterrupted",
    "free_port",
    "heartbeat",
    "in_torchrun",
    "launch_world",
    "select_device",
]

"""Hydra finds the runner's own plugin classes wherever zeropp is installed.

The runner ships two Hydra plugins: ``hydra/sweeper=zeropp`` (its default sweeper,
``hydra_plugins/zeropp_sweeper``) and ``hydra/launcher=slurm`` (``hydra_plugins/zeropp_slurm_launcher``).
Hydra instantiates only plugin classes it found by scanning its ``hydra_plugins`` namespace
package with ``pkgutil``, and that scan lists only modules in real folders on the namespace's
search path. An editable install (``pip install -e .``, the documented one) maps our two packages
through its import hook instead: importable, but invisible to the scan from any directory other
than the checkout's root, so there ``hydra/sweeper: zeropp`` was an unknown option and
``hydra/launcher=slurm`` an unknown class. :func:`expose` adds the folder that holds them to the
namespace's search path before Hydra scans; with a regular install (files in site-packages) or
from the checkout it is already there and nothing changes.
"""

from __future__ import annotations

import importlib
from pathlib import Path

PLUGIN_PACKAGES = ("hydra_plugins.zeropp_sweeper", "hydra_plugins.zeropp_slurm_launcher")
"""The runner's plugin packages (``pyproject.toml`` installs both)."""


def expose() -> list[str]:
    """Add the folder(s) holding :data:`PLUGIN_PACKAGES` to ``hydra_plugins.__path__`` where
    Hydra's scan would not see them (idempotent); returns the folders added."""
    import hydra_plugins

    added: list[str] = []
    for name in PLUGIN_PACKAGES:
        try:
            module = importlib.import_module(name)
        except ImportError:  # not installed with this copy of the runner: Hydra names the option
            continue
        root = str(Path(str(module.__file__)).resolve().parent.parent)
        if root not in [str(Path(p).resolve()) for p in hydra_plugins.__path__ if Path(p).is_dir()]:
            hydra_plugins.__path__.append(root)
            added.append(root)
    return added

"""Hydra knows the runner's own plugin classes wherever zeropp is installed.

The runner ships two Hydra plugins: ``hydra/sweeper=zeropp`` (its default sweeper,
``hydra_plugins/zeropp_sweeper``) and ``hydra/launcher=slurm`` (``hydra_plugins/zeropp_slurm_launcher``).
Hydra instantiates only plugin classes in its registry, which it fills by scanning its
``hydra_plugins`` namespace package with ``pkgutil``; that scan lists only modules in real
folders on the namespace's search path. An editable install (``pip install -e .``, the
documented one) maps our two packages through its import hook instead: importable, but invisible
to the scan from any directory other than the checkout's root, where ``hydra/sweeper: zeropp``
was then an unknown option and ``hydra/launcher=slurm`` an unknown class. :func:`register`
imports them (their configs enter Hydra's config store) and registers their classes with Hydra's
own API for this (``Plugins.register``), whatever the scan saw.
"""

from __future__ import annotations

import importlib

PLUGIN_PACKAGES = ("hydra_plugins.zeropp_sweeper", "hydra_plugins.zeropp_slurm_launcher")
"""The runner's plugin packages (``pyproject.toml`` installs both)."""


def register() -> list[str]:
    """Import :data:`PLUGIN_PACKAGES` and register the plugin classes each defines with Hydra
    (idempotent); a package that cannot be imported is skipped (the Slurm launcher without the
    ``slurm`` extra defines none). Returns the registered classes' names."""
    from hydra.core.plugins import Plugins
    from hydra.plugins.plugin import Plugin

    registry = Plugins.instance()  # scan first: the scan re-executes Hydra's own plugin modules (BasicSweeper),
    names: list[str] = []  # so ours must subclass what they define after it
    for package in PLUGIN_PACKAGES:
        try:
            module = importlib.import_module(package)
        except ImportError:
            continue
        for obj in vars(module).values():
            if isinstance(obj, type) and issubclass(obj, Plugin) and obj.__module__ == module.__name__:
                registry.register(obj)
                names.append(f"{obj.__module__}.{obj.__name__}")
    return names

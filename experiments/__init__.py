"""zeropp.experiments: what the researcher runs: the runner, benchmarks, studies and the
cluster emulator.

``run`` (Hydra app) -> ``config`` (validated dataclasses) -> ``launcher`` (one process per rank,
failure handling, torchrun) -> ``worker`` (one rank: ``data``, ``trainers``, ``commwatch``,
``metrics``, ``console``, ``wandb_log``) ; ``report`` (sweep -> markdown + plots);
``scaling`` / ``scaling_check`` (cost model, projection, comparison with measured runs).
Installed as ``zeropp.experiments``; from the repository root also ``experiments``.
"""

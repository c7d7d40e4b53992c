"""zeropp.experiments: what the researcher runs (issue 5; the cluster emulator is issue 6).

``run`` (Hydra app) -> ``config`` (validated dataclasses) -> ``launcher`` (one process per rank,
failure handling, torchrun) -> ``worker`` (one rank: ``data``, ``trainers``, ``commwatch``,
``metrics``, ``console``, ``wandb_log``) ; ``report`` (sweep -> markdown + plots);
``scaling`` / ``scaling_check`` (cost model, projection, comparison with measured runs).
Installed as ``zeropp.experiments``; from the repository root also ``experiments``.
"""

"""The runner: one run, from Hydra overrides to ``summary.json``.

``run`` (the Hydra app, ``python -m experiments.run``; :func:`run.run_job` for Python callers)
-> ``overrides`` (the pre-check of the command line) -> ``config`` / ``sections`` / ``schema``
(validated dataclasses, the Hydra schema generated from them) -> ``preflight`` (corpus, disk,
memory, before any rank starts) -> ``launcher`` (placements: local or the emulated cluster; ranks
start through the ``launch`` room) -> ``worker`` (one rank: ``data``, ``trainers``,
``commwatch``, ``profiling``, ``metrics``, ``console``, ``wandb_log``).

Also here, the two previews of one run that take the runner's own overrides and validate them
as the runner does: ``memory`` (``python -m experiments.memory``: bytes per rank, predicted and
measured by a short run) and ``plan`` / ``plan_draw`` / ``plan_measured``
(``python -m experiments.plan``: the run's projected timeline, beside a profiled run's). They use
the cost model of ``projection`` and build the run's model with ``trainers``, so they belong to
the runner, which may import the projection (the projection may not import the runner).

New runner pieces (a trainer registry, the worker's collaborators) go here too.
"""

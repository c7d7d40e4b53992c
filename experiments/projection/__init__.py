"""The projection: the analytical cost model of ZeRO / ZeRO++ communication, and its check.

``scaling`` (bytes per message and step time of a workload on a cluster;
``python -m experiments.scaling``), ``step_schedule`` (the same step replayed as the engine
issues it, with overlap; ``python -m experiments.step_schedule``), ``scaling_check`` (the model
against measured runs' ``summary.json``, with a calibration of this machine;
``python -m experiments.scaling_check DIR``), ``cluster_file`` (a calibrated cluster file's
figures, written by ``python -m experiments.bench_comm --calibrate``, read with
``--cluster-file``), ``text_table`` (the tables both print) and ``labels`` (short labels that
tell runs apart, used here and by the sweep report).

It reads run summaries as plain dicts and imports no other room except ``launch`` (the
calibration times a gloo world), so the runner, the benchmarks and the studies can all build on
it. The per-run timeline drawn from a run config (``python -m experiments.plan``) lives in
``runner/``, because it needs the runner's config and model.
"""

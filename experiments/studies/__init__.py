"""The studies: several runs compared, and the reports drawn from them.

``converge`` (a convergence suite of quantization schemes x seeds through the runner;
``python -m experiments.converge``), ``mixz`` (frozen-weight quantization on a small GPT;
``experiments.mixz``), ``memory_study`` (a user's own module under every ZeRO stage, per phase;
``experiments.memory_study``), ``report`` / ``report_plots`` (a sweep's runs as markdown and
plots, each run labelled by what differs, ``projection.labels``; ``experiments.report``).

Studies may import the runner, the projection and the launcher; no room imports a study.
"""

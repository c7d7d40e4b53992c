"""``hydra/launcher=slurm``'s launcher class, registered where Hydra looks for plugins.

Hydra instantiates only launcher classes defined under its ``hydra_plugins`` namespace package,
so the class the runner's ``conf/hydra/launcher/slurm.yaml`` names lives here; its behaviour is
``zeropp.experiments.runner.slurm_launcher`` (imported when a sweep launches, so Hydra's plugin scan of
any app in this environment stays cheap). Without the ``slurm`` extra the module defines nothing:
the scan finds no launcher and prints no warning, and the runner names the missing extra itself.
"""

from __future__ import annotations

from typing import Any, Sequence

try:
    from hydra_plugins.hydra_submitit_launcher.submitit_launcher import SlurmLauncher
except ImportError:  # the slurm extra is not installed
    pass
else:

    class ZeroppSlurmLauncher(SlurmLauncher):
        """Hydra's submitit Slurm launcher; a failed point is recorded and counted by the command
        that submitted the sweep, as with the local launcher (``launch_recording_failures``)."""

        def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Any:
            from zeropp.experiments.runner.slurm_launcher import launch_recording_failures

            return launch_recording_failures(self, super().launch, job_overrides, initial_job_idx)

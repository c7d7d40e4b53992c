"""zeropp.experiments: what the researcher runs, in rooms by role.

- ``runner/``: one run, ``python -m experiments.run`` (and its previews ``experiments.plan``,
  ``experiments.memory``; torch's torchrun ending quietly on a signal, ``experiments.torchrun``);
- ``projection/``: the cost model and its check (``experiments.scaling``,
  ``experiments.step_schedule``, ``experiments.scaling_check``);
- ``cluster/``: the network-namespace cluster emulator and its probes (``experiments.cluster``,
  ``experiments.ring_probe``);
- ``bench/``: benchmarks (``experiments.bench_kernels``, ``_offload``, ``_fsdp``, ``_gpu``,
  ``_cluster``);
- ``studies/``: several runs compared and reported (``experiments.converge``, ``experiments.mixz``,
  ``experiments.memory_study``, ``experiments.report``);
- ``launch/``: the one launcher every room (and the tests) starts ranks with.

The modules at this level are thin aliases that keep the documented ``python -m experiments.X``
commands (each runs its room's module). Which room may import which is written down, and
checked, in ``tests/unit/test_imports.py``. Installed as ``zeropp.experiments``; from the
repository root also ``experiments``.
"""

from zeropp.interrupts import quiet_interrupts_while_importing

quiet_interrupts_while_importing(__name__)  # Ctrl-C / SIGTERM while `python -m experiments.X` imports: one line

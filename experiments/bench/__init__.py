"""The benchmarks: measurements printed as tables (and JSON), each a ``python -m`` entry point.

``kernels`` (the quantization kernels' throughput; ``python -m experiments.bench_kernels``),
``offload`` (the optimizer on host and nvme tiers; ``experiments.bench_offload``), ``peers``
(DDP, FSDP2, DeepSpeed and the ZeRO engine's stages as runner jobs, interleaved;
``experiments.bench_peers``), ``fsdp`` (its two-row view, FSDP2 against our stage 3;
``experiments.bench_fsdp``), ``gpu`` (the GPU
matrix; ``experiments.bench_gpu``), ``cluster`` (runner jobs on the emulated cluster beside the
cost model's projection; ``experiments.bench_cluster``), ``comm`` with ``comm_rank`` (collective
bus bandwidth per group and wire format, and the calibrated cluster file;
``experiments.bench_comm``) and ``args`` (their shared argument
checks). The module names drop the ``bench_`` prefix the room already says; the documented
commands keep it through the aliases at the top of ``experiments/``.

Benchmarks may import the runner, the projection, the cluster and the launcher; no room imports
a benchmark.
"""

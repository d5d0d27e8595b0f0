"""What tests, benchmarks and examples share to run things; nothing in the library imports it.

* ``harness.ranks``: ``run_on_ranks``, a function on N ranks in fresh processes over loopback
  (gloo; nccl on GPUs), the stand-in for a cluster on one machine.
* ``harness.parity``: the small TorchRec model the parity tests train, its batches, recorded
  runs and their bit-for-bit comparison.
* ``harness.dlrm``: TorchRec's train pipelines by name, upstream's or ours, around the DLRM
  example's model (``make_runner``): what the example, the benchmarks and the tests train with.
* ``harness.dlrm_data``: the DLRM sizes (``SIZES``) and each rank's synthetic batches the
  benchmarks, tools and tests train on.
* Fixtures and demos of the library's tools: ``workloads`` (plans with made-up durations for the
  auto-scheduler), ``sleep`` (sleeping tasks on an engine, profiled), ``close_loop`` (profile ->
  search -> run on them), ``searches`` (beam search against CP-SAT's optimum),
  ``profiler_overhead`` and ``streamcheck_overhead`` (what the profiler and the stream checker
  cost). Each runs with ``python -m harness.NAME``.
"""

"""Processes and clusters: starting a multi-process job, its input, preemption and lost hosts.

``initialize`` joins a job of one process per host or GPU (from the
environment of SLURM, Open MPI, a Cloud TPU slice or ``python -m
zerojax_launch``); ``global_batch`` assembles each process's rows into one
global array and ``gather_to_host`` brings the full parameters back to a
process as numpy arrays;
``preemption_requested`` and ``PREEMPTED_EXIT_CODE`` stop a job to be
restarted; ``elastic_microbatches`` and ``elastic_device_counts`` keep the
global batch on fewer devices; ``use_cpu_devices`` fakes devices on one CPU.
See docs/multiprocess.md and docs/fault_tolerance.md.
"""

from zerojax._src.cluster.devices import use_cpu_devices
from zerojax._src.cluster.distributed import gather_to_host, global_batch, initialize
from zerojax._src.cluster.elastic import elastic_device_counts, elastic_microbatches
from zerojax._src.cluster.preemption import preemption_requested
from zerojax_launch.job import PREEMPTED_EXIT_CODE

__all__ = (
  "PREEMPTED_EXIT_CODE",
  "elastic_device_counts",
  "elastic_microbatches",
  "gather_to_host",
  "global_batch",
  "initialize",
  "preemption_requested",
  "use_cpu_devices",
)

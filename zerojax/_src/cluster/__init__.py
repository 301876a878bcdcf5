"""Running on many processes: joining them and their batches (``distributed``), fake CPU devices
(``devices``), ``preemption`` and ``elastic`` batches. The launcher, which imports no JAX, is the
top-level ``zerojax_launch``."""

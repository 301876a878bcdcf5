"""The training step's program: ``value_and_grad`` per device under ``shard_map`` (and whether a
loss sums its batch, ``batch_mean``), and ``scan``, the layer loop that gathers one layer ahead."""

"""ZeRO++ across nodes, compiled for 2 nodes of 8 H100 without them: what crosses the nodes.

tests/nodes_worker.py compiles a small zero3 step on a ``node=2 x data=8``
mesh in a process of its own (started with
``zerojax.diagnostics.deviceless_environment("h100x16")``), and these tests
read, from the compiled program, the bytes of each collective by the mesh
axes it spans. benchmarks/nodes.py measures the same at 1 to 16 nodes on
bigger models, with XLA's step estimate (docs/scaling.md).
"""

import functools
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from tests import nodes_worker as worker
from zerojax._src.comm import primitives
from zerojax.diagnostics import deviceless_environment

PER_NODE = 8


@functools.cache
def compiled() -> dict:
  """What the worker reports for each of its setups, compiled in one process."""
  out = Path(os.environ.get("ZEROJAX_TESTS_JAX_CACHE", "/tmp")) / "nodes-h100x16.json"
  env = {**os.environ, **deviceless_environment("h100x16")}
  command = [sys.executable, str(Path(worker.__file__)), str(out), *worker.SETUPS]
  done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stderr[-5000:]
  return json.loads(out.read_text())


def across_nodes(by_axes: dict) -> float:
  """Bytes into or out of one node per step, as the ZeRO++ paper counts them.

  A collective over ``node`` alone runs on each of the node's devices, each
  device's bytes crossing once; one over ``node`` and ``data`` crosses once
  for the node, but for an all-to-all, whose chunks differ for every device.
  """
  total = 0.0
  for axes, kinds in by_axes.items():
    if "node" not in axes.split():
      continue
    joint = "data" in axes.split()
    for kind, moved in kinds.items():
      total += moved * (1 if joint and kind != "all-to-all" else PER_NODE)
  return total


def test_hpz_qwz_qgz_moves_at_most_zero_plus_plus_bytes_across_nodes():
  results = compiled()
  model = results["model_bytes"]
  # ZeRO-3 crosses nodes about 3 times the model a step (two gathers, one reduction; 2.75
  # here, as zerojax.scan keeps the last layer's weights for the backward pass); the ZeRO++
  # paper's design 0.75 times: hpZ gathers across nodes once, int8 weights, and the node's
  # gradient share alone crosses, int8 (here 0.51: int8 of fp32 is a quarter of it).
  assert across_nodes(results["zero3"]["by_axes"]) >= 2.5 * model
  assert across_nodes(results["hpZ+qwZ+qgZ"]["by_axes"]) <= 0.75 * model


def test_quantized_gradients_reduce_inside_the_node_first():
  by_axes = compiled()["qgZ"]["by_axes"]
  # No all-to-all spans both axes; the one over node moves a node's share, 1/8 of what the
  # one inside the node moves.
  assert "all-to-all" not in by_axes.get("node data", {})
  inside, across = by_axes["data"]["all-to-all"], by_axes["node"]["all-to-all"]
  assert across * PER_NODE <= inside * 1.01


def test_on_gpus_reductions_across_nodes_and_quantized_ones_are_deferred_by_default():
  # zerojax.scan's default on a GPU: each layer's reduction runs in the next iteration, where
  # XLA:GPU would leave a quantized or cross-node one waiting for its own layer's matmuls
  # (tests/test_overlap.py: on CPU, not deferred).
  for name in worker.SETUPS:
    assert compiled()[name]["backward_waiting_reductions"] == 0, name


def test_on_gpus_a_layer_gathers_across_nodes_in_one_all_gather_by_default():
  # zero3's packed_gathers default on a GPU across nodes: a layer's two matrices in one
  # all-gather, forward and backward (the last layer once: zerojax.scan hands it over).
  assert compiled()["zero3"]["gathers_across"] == 2 * worker.LAYERS - 1


def test_only_axes_of_more_than_one_device_each_span_nodes():
  # What the GPU defaults above ask (packed gathers, deferred reductions): one data axis, or
  # data axes of which only one has more than one device, never crosses nodes.
  def spans(shape, names):
    mesh = jax.make_mesh(shape, names, devices=jax.devices()[: math.prod(shape)])
    seen = []
    ask = lambda x: (seen.append(primitives.spans_nodes(names)), x)[1]
    jax.eval_shape(jax.shard_map(ask, mesh=mesh, in_specs=P(), out_specs=P()), jnp.zeros(()))
    return seen[0]

  assert not spans((8,), ("data",))
  assert not spans((1, 8), worker.AXES)
  assert spans((2, 4), worker.AXES)

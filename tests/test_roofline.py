"""The roofline estimate: its flops and bytes against analytic counts and XLA's cost analysis.

``compiled.cost_analysis()`` counts a while loop's body once, so a layer scan is the case
``program_cost`` exists for; on a program without loops the two should agree.
"""

import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from tests import environment
from zerojax.diagnostics import Chip, chip, deviceless_environment, program_cost, roofline

D, F, TOKENS = 128, 256, 64


def layer(x, w):
  return jnp.tanh(x @ w["up"]) @ w["down"], None


def train_step(params, x):
  """One SGD step of a mean-square loss of the layers applied in turn."""

  def loss(params):
    if isinstance(params, list):  # unrolled: no loop in the program
      y = x
      for w in params:
        y, _ = layer(y, w)
    else:
      y, _ = jax.lax.scan(layer, x, params)
    return jnp.mean(y**2)

  return jax.tree.map(lambda p, g: p - 0.1 * g, params, jax.grad(loss)(params))


def matmul_flops(layers: int, tokens: int = TOKENS) -> int:
  """Forward (2 matmuls of 2 x tokens x D x F) and backward (twice that) of every layer."""
  return 3 * 2 * tokens * 2 * D * F * layers


def compiled_scan(layers: int):
  params = {"up": jnp.ones((layers, D, F)), "down": jnp.ones((layers, F, D))}
  return jax.jit(train_step).lower(params, jnp.ones((TOKENS, D))).compile()


def test_a_scan_counts_its_body_once_per_layer():
  two, four = program_cost(compiled_scan(2)), program_cost(compiled_scan(4))
  assert two.flops == matmul_flops(2)
  assert four.flops == matmul_flops(4)
  # Per layer the same HBM traffic: slices of the stacked weights and residuals are read and
  # written a layer at a time, not the whole stack each iteration.
  assert four.bytes / two.bytes == pytest.approx(2, rel=0.1)
  # What program_cost is for: XLA's cost analysis counts the loop's body once.
  assert compiled_scan(4).cost_analysis()["flops"] < 0.3 * matmul_flops(4)


def test_a_program_without_loops_costs_what_xla_says():
  params = [{"up": jnp.ones((D, F)), "down": jnp.ones((F, D))} for _ in range(3)]
  compiled = jax.jit(train_step).lower(params, jnp.ones((TOKENS, D))).compile()
  cost, xla = program_cost(compiled), compiled.cost_analysis()
  # No gradient of the input: the first layer's backward skips one of its matmuls.
  assert cost.flops == matmul_flops(3) - 2 * TOKENS * D * F
  # XLA also counts elementwise operations, which program_cost leaves out.
  assert cost.flops == pytest.approx(xla["flops"], rel=0.01)
  assert cost.bytes == pytest.approx(xla["bytes accessed"], rel=0.01)


def test_the_estimate_is_the_busiest_unit_at_its_peak():
  peaks = Chip("test", 1e12, 0.5e12, 1e9, 1e8, 1e7)
  compiled = jax.jit(jnp.matmul).lower(jnp.ones((256, 512)), jnp.ones((512, 128))).compile()
  estimate = roofline(compiled, peaks, collective_bytes_within=1e6, collective_bytes_across=1e3)
  assert estimate.compute_seconds == pytest.approx(2 * 256 * 512 * 128 / 0.5e12)  # float32
  assert estimate.memory_seconds == pytest.approx(4 * (256 * 512 + 512 * 128 + 256 * 128) / 1e9)
  assert (estimate.within_seconds, estimate.across_seconds) == (1e-2, 1e-4)
  assert (estimate.step_seconds, estimate.bound) == (1e-2, "within")
  assert chip("h100x8").bfloat16_flops == 989.4e12
  with pytest.raises(ValueError, match="unknown target"):
    chip("a100x8")


#: Compiles train_step for a TPU v5e-8, 2 scanned layers, the tokens split over the 8 chips.
TPU_STEP = """
import json, sys
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
from tests.test_roofline import D, F, train_step
from zerojax.diagnostics import deviceless_mesh, program_cost, roofline
mesh = deviceless_mesh("v5e-8", (8,), ("data",))
whole = NamedSharding(mesh, P())
params = {
  "up": jax.ShapeDtypeStruct((2, D, F), jnp.float32, sharding=whole),
  "down": jax.ShapeDtypeStruct((2, F, D), jnp.float32, sharding=whole),
}
split = NamedSharding(mesh, P("data"))
x = jax.ShapeDtypeStruct((8 * int(sys.argv[1]), D), jnp.float32, sharding=split)
compiled = jax.jit(train_step).lower(params, x).compile()
text = compiled.as_text()
# Attention's scores: a matmul with a batch dimension (the heads), which XLA:TPU writes as a
# convolution whose window runs over the heads.
q = jax.ShapeDtypeStruct((256, 16, 128), jnp.bfloat16, sharding=whole)
scores = jax.jit(lambda q, k: jnp.einsum("thd,shd->hts", q, k)).lower(q, q).compile()
print(json.dumps({
  "scores_flops": program_cost(scores).flops,
  "flops": program_cost(compiled).flops,
  "compute_seconds": roofline(compiled, "v5e-8").compute_seconds,
  "known_trip_count": "known_trip_count" in text,
}))
"""


def test_tpu_flops_of_a_scanned_training_step_and_of_a_batched_matmul_are_the_analytic_count():
  tokens = 128  # a chip's share
  done = subprocess.run(
    [sys.executable, "-c", TPU_STEP, str(tokens)],
    env=environment.subprocess_env(**deviceless_environment("v5e-8")),
    cwd=environment.ROOT,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert done.returncode == 0, done.stderr[-5000:]
  found = json.loads(done.stdout.strip().splitlines()[-1])
  # XLA:TPU leaves no known_trip_count on the loops: their conditions' bounds count them.
  assert not found["known_trip_count"]
  assert found["flops"] == pytest.approx(matmul_flops(2, tokens), rel=0.1)
  assert found["compute_seconds"] == pytest.approx(found["flops"] / 197e12)
  assert found["scores_flops"] == pytest.approx(2 * 16 * 256 * 256 * 128, rel=0.01)


def test_xla_gpu_cublas_calls_count_as_matmuls():
  # As XLA:GPU compiles a matmul with --xla_gpu_enable_triton_gemm=false (the deviceless
  # environment's flag): a custom-call whose result comes with a scratch workspace.
  hlo = """
ENTRY %main (a: bf16[128,256], b: bf16[256,64]) -> bf16[128,64] {
  %a = bf16[128,256]{1,0} parameter(0)
  %b = bf16[256,64]{1,0} parameter(1)
  %gemm = (bf16[128,64]{1,0}, s8[4194304]{0}) custom-call(%a, %b), custom_call_target="__cublas$lt$matmul", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]}}}
  ROOT %out = bf16[128,64]{1,0} get-tuple-element(%gemm), index=0
}
  """  # noqa: E501 (one instruction a line, as XLA prints it)
  cost = program_cost(hlo)
  assert cost.flops_by_dtype == {"bf16": 2 * 128 * 256 * 64}
  assert cost.bytes == 2 * (128 * 256 + 256 * 64 + 128 * 64)  # not the workspace

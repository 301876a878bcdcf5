"""Temporaries of one bf16 MLP stack's gradient step, zerojax stage 3 beside GSPMD FSDP, deviceless.

16 layers of 2048 -> 8192 -> 2048 with biases, float32 master parameters split over 8
devices, bfloat16 compute. SETUP: ``zero3`` (``precision="bf16"``: float32 reductions),
``zero3-p0`` (the same with ``prefetch=0``), ``zero3-bf16red`` (bfloat16 reductions),
``gspmd`` (``jax.lax.scan`` of the same layer on parameters annotated as zerojax stores
them, each cast to bfloat16 at use, the residual stream constrained to the batch: GSPMD
reduces the bfloat16 matmuls' gradients in bfloat16). VARIANT: ``plain`` (the layer as is:
zerojax's default policy, GSPMD saves everything), ``full`` (``jax.checkpoint(layer)``),
``dots``. ``--dump=DIR`` writes XLA's buffer assignment (read it with
``benchmarks/buffers.py``'s ``read_dump``). On an ``h100x8`` target it prints XLA:GPU's
estimate too.

  python benchmarks/residuals.py v5e-8 gspmd full --dump=/tmp/gspmd
  python benchmarks/residuals.py v5e-8 zero3 full --dump=/tmp/zero3
"""
import os, sys, json
args = [a for a in sys.argv[1:] if not a.startswith("--")]
dump = next((a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--dump=")), None)
target, setup, variant = args[:3]
T = int(args[3]) if len(args) > 3 else 2048
from zerojax.diagnostics import deviceless_environment
if os.environ.get("_DEVICELESS") != "1":
  flags = f"--xla_dump_to={dump} --xla_dump_hlo_as_text" if dump else ""
  env = dict(os.environ, **deviceless_environment(target, scheduler_log=target.startswith("h100"), xla_flags=flags), _DEVICELESS="1")
  os.execve(sys.executable, [sys.executable, *sys.argv], env)
import jax, jax.numpy as jnp, optax, zerojax
from jax.sharding import NamedSharding, PartitionSpec as P, AxisType
gpu = target.startswith("h100")
auto = setup == "gspmd"
mesh = zerojax.diagnostics.deviceless_mesh(target, (8,), ("data",), (AxisType.Auto,) if auto else None)
precision = zerojax.Precision(params="float32", compute="bfloat16", reduce="bfloat16") if setup == "zero3-bf16red" else "bf16"
tx = zerojax.zero3(optax.adamw(1e-3), mesh=mesh, precision=precision)
L, D, F = 16, 2048, 8192
abstract = {"w1": jax.ShapeDtypeStruct((L, D, F), jnp.float32), "b1": jax.ShapeDtypeStruct((L, F), jnp.float32),
            "w2": jax.ShapeDtypeStruct((L, F, D), jnp.float32), "b2": jax.ShapeDtypeStruct((L, D), jnp.float32)}
layer0 = lambda h, w: (h + jax.nn.gelu(h @ w["w1"] + w["b1"]) @ w["w2"] + w["b2"], None)
layer = {"plain": layer0, "full": jax.checkpoint(layer0), "dots": jax.checkpoint(layer0, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)}[variant]
x = jax.ShapeDtypeStruct((8 * T, D), jnp.float32, sharding=NamedSharding(mesh, P("data")))
prefetch = 0 if setup == "zero3-p0" else 1
if auto:
  shardings = tx.param_shardings(abstract)
  params = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=NamedSharding(mesh, P(*sh.layout.spec))), abstract, shardings)
  act = NamedSharding(mesh, P("data"))
  def glayer0(h, w):
    h = jax.lax.with_sharding_constraint(h, act)
    return layer0(h, jax.tree.map(lambda a: a.astype(jnp.bfloat16), w))
  glayer = {"plain": glayer0, "full": jax.checkpoint(glayer0), "dots": jax.checkpoint(glayer0, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)}[variant]
  def loss_fn(p, x):
    h, _ = jax.lax.scan(glayer, x.astype(jnp.bfloat16), p)
    return jnp.mean(h.astype(jnp.float32) ** 2)
  fn = jax.value_and_grad(loss_fn)
else:
  params = jax.eval_shape(tx.shard, abstract)
  def loss_fn(p, x):
    h, _ = zerojax.scan(layer, x.astype(jnp.bfloat16), p, prefetch=prefetch)
    return jnp.mean(h.astype(jnp.float32) ** 2)
  fn = zerojax.value_and_grad(loss_fn, tx)
with zerojax.diagnostics.capture_stderr() as log:
  with jax.set_mesh(mesh):
    out_shardings = (NamedSharding(mesh, P()), jax.tree.map(lambda s: s.sharding, params)) if auto else None
    c = (jax.jit(fn, out_shardings=out_shardings) if auto else jax.jit(fn)).lower(params, x).compile()
m = c.memory_analysis()
out = {"target": target, "setup": setup, "variant": variant, "T": T, "temp_MiB": round(m.temp_size_in_bytes / 2**20, 1), "arg_MiB": round(m.argument_size_in_bytes / 2**20, 1), "out_MiB": round(m.output_size_in_bytes / 2**20, 1)}
if gpu:
  e = zerojax.diagnostics.scheduler_estimate(log[0], c)
  out |= {"cycles": e.cycles, "wasted": e.wasted, "silent": list(e.silent)}
print(json.dumps(out))

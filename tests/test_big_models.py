"""A model's whole life on stored parameters, on 2, 4 and 8 devices: what each device holds falls
as 1/N.

The big-model benchmark (benchmarks/big_models.py, docs/big_models.md) compiles
a 7.5B and a 70B transformer's four programs for 64 to 256 accelerators: init
into shards (``tx.sharded_init``), a training step (``zerojax.value_and_grad``),
an evaluation and a sampling step with a KV cache (``zerojax.forward``). Here
the same programs of the same model code, scaled down, compile on the CPU
devices: per device, the arguments and outputs are 1/N of the model state and
of the batch (fixed globally), and the temporaries are 1/N of what they are at
N = 2 plus at most a few layers opened in the compute dtype (the layer in use,
the one gathered ahead, and the loop's copies of them), never the model.
"""

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import zerojax

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import transformer

CONFIG = transformer.Config(
  layers=16, d=128, heads=4, kv_heads=2, mlp=384, vocab=256, head_dim=32, seq_len=32
)
BATCH = 8  # sequences, whatever N is
#: One layer's weights in the compute dtype (bfloat16), as a gather opens them.
LAYER_BYTES = 2 * CONFIG.layer_parameters
#: How many opened layers' worth the temporaries may hold beyond their 1/N part.
OPEN_LAYERS = 4


def compiled_programs(n: int, axis_type: AxisType) -> dict[str, jax.stages.Compiled]:
  mesh = jax.make_mesh((n,), ("data",), axis_types=(axis_type,), devices=jax.devices()[:n])
  tx = zerojax.zero3(optax.adamw(1e-4), mesh=mesh, precision="bf16")
  init = tx.sharded_init(lambda key: transformer.init_fn(CONFIG, key))
  key = jax.random.key(0)
  split = lambda shape, dtype: jax.ShapeDtypeStruct(
    shape, dtype, sharding=NamedSharding(mesh, P("data"))
  )
  tokens = split((BATCH, CONFIG.seq_len + 1), jnp.int32)
  last = split((BATCH,), jnp.int32)
  cache = [split(s.shape, s.dtype) for s in transformer.abstract_cache(CONFIG, BATCH).values()]
  grad_fn = zerojax.value_and_grad(transformer.mean_loss(CONFIG, True), tx)

  def train(params, opt_state, tokens):
    loss, grads = grad_fn(params, tokens)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  losses = lambda p, t: transformer.per_example_loss(CONFIG, p, t, True)
  decode = lambda p, t, k, v, at: transformer.decode(CONFIG, p, t, {"k": k, "v": v}, at, True)
  with jax.set_mesh(mesh):
    params, opt_state = jax.eval_shape(init, key)
    lowered = {
      "init": init.lower(key),
      "train": jax.jit(train, donate_argnums=(0, 1)).lower(params, opt_state, tokens),
      "evaluate": jax.jit(zerojax.forward(losses, tx)).lower(params, tokens),
      "sample": jax.jit(zerojax.forward(decode, tx), donate_argnums=(2, 3)).lower(
        params, last, *cache, last
      ),
    }
  return {name: program.compile() for name, program in lowered.items()}


@pytest.fixture(scope="module", params=[AxisType.Explicit, AxisType.Auto], ids=str)
def memory(request) -> dict[int, dict[str, object]]:
  """Each program's ``memory_analysis()`` at N = 2, 4 and 8 devices."""
  return {
    n: {name: c.memory_analysis() for name, c in compiled_programs(n, request.param).items()}
    for n in (2, 4, 8)
  }


@pytest.mark.parametrize("program", ["init", "train", "evaluate", "sample"])
def test_each_program_holds_a_1_over_n_share(memory, program):
  at = {n: programs[program] for n, programs in memory.items()}
  held = lambda m: m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
  for n in (4, 8):
    # Arguments and outputs: shards of the model state, of the batch and of the cache.
    assert held(at[n]) == pytest.approx(held(at[2]) * 2 / n, rel=0.01), (n, held(at[n]))
    # Temporaries: their 1/N part, plus the layers a gather opens.
    beyond = at[n].temp_size_in_bytes - at[2].temp_size_in_bytes * 2 / n
    assert beyond <= OPEN_LAYERS * LAYER_BYTES, (n, beyond / LAYER_BYTES)


def test_evaluating_and_sampling_hold_no_model(memory):
  # At N = 8 the forward programs' temporaries are well under the whole model in the compute
  # dtype (tx.gather would give every device all of it, in float32). Init's and the training
  # step's temporaries are mostly 1/N of the state they make or update (gradient shards,
  # AdamW's new moments): the test above bounds what they hold beyond that.
  model_bytes = 2 * CONFIG.parameters
  for name in ("evaluate", "sample"):
    temporaries = memory[8][name].temp_size_in_bytes
    assert temporaries < model_bytes / 2, (name, temporaries / model_bytes)

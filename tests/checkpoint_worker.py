"""A training run that checkpoints every step, for tests that kill it or damage its files.

``python checkpoint_worker.py train DIRECTORY STEPS`` resumes from the latest
checkpoint in DIRECTORY (or starts afresh), trains to STEPS saving after every
step, and writes the final parameters to DIRECTORY/final.npz. Data and noise
depend only on the step number and the checkpointed RNG key, so any number of
interruptions gives the same parameters.

``python checkpoint_worker.py restore DIRECTORY`` restores the latest
checkpoint and prints the error, if any.

Faults for the restart tests, in ``CHECKPOINT_WORKER_FAULT`` (comma-separated):
``kill-in-first-save`` kills the process (SIGKILL) while its first save is
being written, on the first attempt only (``ZEROJAX_ATTEMPT``, set by
``python -m zerojax_launch``); ``kill-after-save-N`` kills it once the save of
step N is complete, on the first attempt only; ``raise-at-N`` raises at step
N, every time.

``CHECKPOINT_WORKER_OFFLOAD`` (``optimizer``) trains with the optimizer state
in host memory; the run prints where the state lives when it starts.
"""

import os
import signal
import sys
import time

os.environ["JAX_PLATFORMS"] = "cpu"

import jax
import jax.numpy as jnp
import numpy as np
import optax

import zerojax
from zerojax import CheckpointManager, train_state_spec

zerojax.distributed.use_cpu_devices(8)

# About 6 MiB of state with Adam, so that a save takes long enough to be caught.
MODEL = {
  "w": jax.ShapeDtypeStruct((5, 1001), jnp.float32),  # padded on 8 devices
  "big": jax.ShapeDtypeStruct((512, 1024), jnp.float32),
}


def setup(directory):
  mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  offload = os.environ.get("CHECKPOINT_WORKER_OFFLOAD") or None
  tx = zerojax.zero3(optax.adam(1e-3), mesh=mesh, offload=offload)
  spec = train_state_spec(tx, MODEL, step=jnp.int32(0), rng=jax.random.PRNGKey(0))
  return tx, CheckpointManager(directory, spec, max_to_keep=2)


def initial_state(tx):
  keys = dict(zip(MODEL, jax.random.split(jax.random.PRNGKey(42), len(MODEL)), strict=True))
  full = {name: 0.1 * jax.random.normal(keys[name], x.shape) for name, x in MODEL.items()}
  params = tx.shard(full)
  return {
    "params": params,
    "opt_state": tx.init(params),
    "step": jnp.int32(0),
    "rng": jax.random.PRNGKey(7),
  }


def make_train_step(tx):
  def loss_fn(params, x, noise):
    params = zerojax.gather(params)
    h = jnp.tanh(x @ params["big"]) + noise
    return jnp.mean(h**2) + jnp.mean((h[:, :5] @ params["w"]) ** 2)

  @jax.jit
  def train_step(state):
    rng, noise_key = jax.random.split(state["rng"])
    x = jax.random.normal(jax.random.fold_in(jax.random.PRNGKey(1), state["step"]), (16, 512))
    noise = 0.01 * jax.random.normal(noise_key, (16, 1024))
    _, grads = zerojax.value_and_grad(loss_fn, tx)(state["params"], x, noise)
    updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    return {"params": params, "opt_state": opt_state, "step": state["step"] + 1, "rng": rng}

  return train_step


def train(directory, steps):
  faults = os.environ.get("CHECKPOINT_WORKER_FAULT", "").split(",")
  tx, checkpoints = setup(directory)
  with checkpoints:
    fresh = checkpoints.latest_step() is None
    state = initial_state(tx) if fresh else checkpoints.restore()
    print(f"start {None if fresh else int(state['step'])}", flush=True)
    kinds = {x.sharding.memory_kind for x in jax.tree.leaves(state["opt_state"].inner_state)}
    print(f"optimizer state in {sorted(kinds)}", flush=True)
    train_step = make_train_step(tx)
    while int(state["step"]) < steps:
      state = train_step(state)
      if f"raise-at-{int(state['step'])}" in faults:
        raise RuntimeError(f"injected fault at step {int(state['step'])}")
      checkpoints.save(int(state["step"]), state)
      first_attempt = os.environ.get("ZEROJAX_ATTEMPT") == "1"
      if "kill-in-first-save" in faults and first_attempt:
        # The save writes in the background: kill once its directory exists (under load the
        # background thread may not have made it yet when save returns).
        deadline = time.monotonic() + 60
        while not os.listdir(directory) and time.monotonic() < deadline:
          time.sleep(0.001)
        print(f"killed while writing {sorted(os.listdir(directory))}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
      if f"kill-after-save-{int(state['step'])}" in faults and first_attempt:
        checkpoints.wait()
        print(f"killed after saving {int(state['step'])}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
      print(f"saving {int(state['step'])}", flush=True)
  final = tx.gather(state["params"])
  np.savez(os.path.join(directory, "final.npz"), **{k: np.asarray(v) for k, v in final.items()})


def restore(directory):
  _, checkpoints = setup(directory)
  with checkpoints:
    try:
      checkpoints.restore()
    except ValueError as error:
      print(f"error: {error}", flush=True)


if __name__ == "__main__":
  if sys.argv[1] == "train":
    train(sys.argv[2], int(sys.argv[3]))
  else:
    restore(sys.argv[2])

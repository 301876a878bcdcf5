"""Trains a Flax NNX MLP on scikit-learn's handwritten digits with ZeRO stage 1, 2 or 3.

The data is ``sklearn.datasets.load_digits`` (1797 8x8 images, bundled with
scikit-learn, no download): 80% to train, 20% to test. The model is an
``nnx.Module``; the optimizer is ``nnx.Optimizer`` around a zerojax
transformation, and the gradients come from ``zerojax.flax.nnx.value_and_grad``,
which runs the loss once per device on its slice of each batch. In stage 3 the
model holds 1/N of each parameter and gathers the whole model inside the loss.

On CPU the script asks JAX for 8 devices (``zerojax.distributed.use_cpu_devices``), so the
sharding is real. Usage::

  python examples/digits_nnx.py              # ZeRO-3
  python examples/digits_nnx.py --stage 2

From Python, ``main(["--steps", "100"])`` returns the metrics.
"""

import argparse
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import zerojax
import zerojax.flax.nnx

STAGES = {1: zerojax.zero1, 2: zerojax.zero2, 3: zerojax.zero3}


class MLP(nnx.Module):
  """64 pixels -> two hidden ReLU layers -> 10 digit logits."""

  def __init__(self, hidden: int, rngs: nnx.Rngs):
    self.hidden1 = nnx.Linear(64, hidden, rngs=rngs)
    self.hidden2 = nnx.Linear(hidden, hidden, rngs=rngs)
    self.out = nnx.Linear(hidden, 10, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.out(nnx.relu(self.hidden2(nnx.relu(self.hidden1(x)))))


def loss_fn(model: MLP, x: jax.Array, y: jax.Array) -> jax.Array:
  return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()


@nnx.jit
def train_step(model: MLP, optimizer: nnx.Optimizer, x: jax.Array, y: jax.Array) -> jax.Array:
  loss, grads = zerojax.flax.nnx.value_and_grad(loss_fn, optimizer.tx)(model, x, y)
  optimizer.update(model, grads)
  return loss


def accuracy(model: MLP, tx: zerojax.ZeroTransformation, x: np.ndarray, y: np.ndarray) -> float:
  """Accuracy of a copy of ``model`` with full parameters (stage 3 stores them split, padded)."""
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  full = nnx.merge(graphdef, tx.gather(params), rest)
  return float(jnp.mean(jnp.argmax(full(jnp.asarray(x)), axis=-1) == jnp.asarray(y)))


def bytes_per_device(tree: Any) -> int:
  """What one device stores of ``tree``."""
  return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--stage", type=int, choices=sorted(STAGES), default=3)
  parser.add_argument("--steps", type=int, default=300)
  parser.add_argument("--batch-size", type=int, default=128, help="a multiple of the devices")
  parser.add_argument("--hidden", type=int, default=256)
  parser.add_argument("--lr", type=float, default=3e-3)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--log-every", type=int, default=50)
  return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  """Runs the script with the flags in ``argv`` (default: the command line); returns the metrics."""
  args = parse_args(argv)
  zerojax.distributed.use_cpu_devices(8)  # first, before anything touches a device
  images, labels = load_digits(return_X_y=True)
  x_train, x_test, y_train, y_test = train_test_split(
    (images / 16.0).astype(np.float32), labels, test_size=0.2, random_state=0, stratify=labels
  )
  mesh = jax.make_mesh((jax.device_count(),), ("data",))
  if args.batch_size % mesh.size:
    raise ValueError(f"--batch-size {args.batch_size} must be a multiple of {mesh.size} devices")

  tx = STAGES[args.stage](optax.adamw(args.lr), mesh=mesh)
  with jax.set_mesh(mesh):  # the optimizer's step counter is created on the mesh
    model = MLP(args.hidden, nnx.Rngs(args.seed))
    nnx.update(model, tx.shard(nnx.state(model, nnx.Param)))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    stored = bytes_per_device((nnx.state(model, nnx.Param), nnx.state(optimizer, nnx.OptState)))
    print(
      f"ZeRO-{args.stage} on {mesh.size} {jax.devices()[0].platform} devices: "
      f"{stored / 1024:.0f} KiB of parameters and optimizer state per device"
    )

    rng = np.random.default_rng(args.seed)
    start, losses = time.perf_counter(), []
    for step in range(1, args.steps + 1):
      batch = rng.choice(len(x_train), args.batch_size, replace=False)
      losses.append(float(train_step(model, optimizer, x_train[batch], y_train[batch])))
      if step % args.log_every == 0 or step == args.steps:
        print(f"step {step:4d}  train loss {np.mean(losses[-args.log_every :]):.4f}")
    seconds = time.perf_counter() - start
    metrics = {
      "stage": args.stage,
      "devices": mesh.size,
      "steps": args.steps,
      "train_loss": float(np.mean(losses[-args.log_every :])),
      "train_accuracy": accuracy(model, tx, x_train, y_train),
      "test_accuracy": accuracy(model, tx, x_test, y_test),
      "bytes_per_device": stored,
      "seconds": seconds,
    }
  print(
    f"train accuracy {metrics['train_accuracy']:.3f}  test accuracy "
    f"{metrics['test_accuracy']:.3f}  ({seconds:.1f} s)"
  )
  return metrics


if __name__ == "__main__":
  main()

"""NNX modules trained with ``zerojax.value_and_grad``.

An NNX model holds its parameters; ``zerojax.value_and_grad`` differentiates a
function of a parameter pytree. ``value_and_grad`` bridges the two the way
``nnx.value_and_grad`` does: it splits the model into its ``nnx.Param`` state
and the rest, and rebuilds the model inside the per-device loss.
``gathered`` gathers one submodule's parameters where the model uses it,
``scan`` runs a stack of layers with ``zerojax.scan``, and
``pipeline`` splits such a stack into pipeline stages.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from flax import nnx

from zerojax._src.comm import shards as shards_lib
from zerojax._src.core.transformation import ZeroTransformation
from zerojax._src.pipeline import loop as pipeline_lib
from zerojax._src.step import forward as forward_lib
from zerojax._src.step import scan as scan_lib
from zerojax._src.step import value_and_grad as grad_lib


def gathered(module: nnx.Module) -> nnx.Module:
  """``module`` with its ``nnx.Param`` s gathered into full arrays.

  Call it where the model uses a submodule, ``gathered(self.block)(h)``,
  with ``value_and_grad(..., gather=False)``: each submodule is then whole
  only while it runs, and inside an ``nnx.scan`` over stacked layers one layer
  at a time (checkpoint the scan body with ``nnx.remat(policy=
  zerojax.remat_policy)`` so that the backward pass gathers it again). The
  result shares every other variable (batch statistics, RNG counters) with
  ``module``. On full parameters it computes what ``module`` computes.

  Args:
    module: an NNX module whose parameters may be ``zerojax.Shard`` s.

  Returns:
    A module of the same graph with full parameters.

  Example:
    >>> import jax.numpy as jnp, zerojax.flax.nnx
    >>> from flax import nnx
    >>> linear = nnx.Linear(16, 64, rngs=nnx.Rngs(0))
    >>> zerojax.flax.nnx.gathered(linear)(jnp.ones((8, 16))).shape
    (8, 64)
  """
  graphdef, params, rest = nnx.split(module, nnx.Param, ...)
  return nnx.merge(graphdef, shards_lib.gather(params), rest)


def value_and_grad(
  loss_fn: Callable[..., Any],
  tx: ZeroTransformation,
  *,
  has_aux: bool = False,
  gather: bool = True,
  microbatches: int = 1,
) -> Callable[..., Any]:
  """``zerojax.value_and_grad`` for a loss of an NNX model, like ``nnx.value_and_grad``.

  The returned ``f(model, *batch)`` splits ``model`` into its ``nnx.Param``
  state and the rest, and calls ``loss_fn(model, *batch)`` once per device on
  that device's slice of the batch, with the model rebuilt from the
  parameters. The gradients (an ``nnx.State`` like ``nnx.state(model,
  nnx.Param)``, in the stage's layout) go to ``nnx.Optimizer(model, tx,
  wrt=nnx.Param).update(model, grads)``. In stage 3 the model must hold its
  parameters as stored: ``nnx.update(model, tx.shard(nnx.state(model,
  nnx.Param)))``.

  Other variables are read, not written: NNX raises a ``TraceContextError``
  if ``loss_fn`` changes one (batch statistics in training mode, or the RNG
  counter of a module that draws from an ``nnx.Rngs`` it holds). Pass random
  keys as a batch argument instead, one per example (``jax.random.split(key,
  batch_size)``, split over the devices like the batch), and give each
  example's call its key (``nnx.Dropout`` takes ``rngs=`` a key): see
  docs/flax.md, "Randomness".

  Args:
    loss_fn: ``loss_fn(model, *batch)`` returning a scalar loss (the mean over
      its batch slice), or ``(loss, aux)`` with ``has_aux=True``.
    tx: the ``ZeroTransformation`` that will apply the gradients.
    has_aux: whether ``loss_fn`` returns ``(loss, aux)``; ``aux`` comes back
      stacked over devices, as from ``zerojax.value_and_grad``.
    gather: if True, the whole model is gathered before ``loss_fn`` sees it,
      which works with any model. If False, its parameters are
      ``zerojax.Shard`` s, and the model gathers each submodule where it uses
      it with ``gathered`` (stage 3's memory saving, layer by layer).
    microbatches: as for ``zerojax.value_and_grad``. (A policy with a loss
      scale needs the explicit ``zerojax.value_and_grad``, which is given the
      optimizer state; other precision policies work here.)

  Returns:
    ``f(model, *batch)`` returning ``(loss, grads)``, or ``((loss, aux),
    grads)``.

  Example:
    >>> import jax, jax.numpy as jnp, optax, zerojax, zerojax.flax.nnx
    >>> from flax import nnx
    >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
    >>> tx = zerojax.zero3(optax.sgd(0.1), mesh=mesh)
    >>> model = nnx.Linear(16, 64, rngs=nnx.Rngs(0))
    >>> nnx.update(model, tx.shard(nnx.state(model, nnx.Param)))
    >>> optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    >>> def loss_fn(model, x):
    ...   return jnp.mean(model(x) ** 2)
    >>> @nnx.jit
    ... def train_step(model, optimizer, x):
    ...   loss, grads = zerojax.flax.nnx.value_and_grad(loss_fn, tx)(model, x)
    ...   optimizer.update(model, grads)
    ...   return loss
    >>> loss = train_step(model, optimizer, jnp.ones((8, 16)))
    >>> model.kernel.get_value().sharding.spec  # a zerojax.Stored, 1/N on each device
    P(None, 'data')
  """

  def value_and_grad_fn(model, *batch):
    of_params, params = _of_params(loss_fn, model, gather)
    grad_fn = grad_lib.value_and_grad(of_params, tx, has_aux=has_aux, microbatches=microbatches)
    return grad_fn(params, *batch)

  return value_and_grad_fn


def forward(fn: Callable[..., Any], tx: ZeroTransformation, *, gather: bool = True) -> Any:
  """``zerojax.forward`` for an NNX model: ``fn(model, *batch)`` per device, on stored parameters.

  As ``value_and_grad`` splits the model into its parameters and the rest, so
  does this, and rebuilds it on each device for ``fn``, on that device's
  slice of the batch. Every leaf ``fn`` returns has a leading batch axis.

  Args:
    fn: ``fn(model, *batch)`` returning per-example arrays (logits, losses).
    tx: the ``ZeroTransformation`` that stores the model's parameters.
    gather: as for ``value_and_grad``: False keeps the parameters
      ``zerojax.Shard`` s, for a model that gathers each submodule where it
      uses it (``gathered``, ``scan``), so that the model is never whole.

  Returns:
    ``f(model, *batch)`` returning ``fn``'s outputs for the whole batch.

  Example:
    >>> import jax, jax.numpy as jnp, optax, zerojax, zerojax.flax.nnx
    >>> from flax import nnx
    >>> tx = zerojax.zero3(optax.sgd(0.1), mesh=jax.make_mesh((jax.device_count(),), ("data",)))
    >>> model = nnx.Linear(16, 64, rngs=nnx.Rngs(0))
    >>> nnx.update(model, tx.shard(nnx.state(model, nnx.Param)))
    >>> logits = zerojax.flax.nnx.forward(lambda model, x: model(x), tx)(model, jnp.ones((8, 16)))
    >>> logits.shape
    (8, 64)
  """

  def forward_fn(model, *batch):
    of_params, params = _of_params(fn, model, gather)
    return forward_lib.forward(of_params, tx)(params, *batch)

  return forward_fn


def _of_params(fn: Callable[..., Any], model: nnx.Module, gather: bool) -> tuple[Any, Any]:
  """``fn(model, *batch)`` as a function of the model's parameters, and those parameters."""
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def of_params(params, *batch):
    params = shards_lib.gather(params) if gather else params
    return fn(nnx.merge(graphdef, params, rest), *batch)

  return of_params, params


def scan(
  f: Callable[..., tuple[Any, Any]],
  layers: nnx.Module,
  carry: Any,
  xs: Any = None,
  *,
  prefetch: int = 1,
  policy: Callable[..., bool] | str | None = None,
  defer_reductions: bool | None = None,
) -> tuple[Any, Any]:
  """``zerojax.scan`` over a stack of NNX layers (one module with stacked state, from ``nnx.vmap``).

  ``f(layer, carry, x) -> (carry, y)`` runs once per layer, on the layer
  rebuilt from its slice of ``layers``' state. Under
  ``value_and_grad(..., gather=False)`` each layer's parameters arrive
  gathered, one layer ahead of the compute with ``prefetch=1`` (see
  ``zerojax.scan``), so ``f`` needs no ``gathered``; under ``nnx.remat`` its policy
  decides what the backward pass keeps.
  Layers are read, not written: what ``f`` changes in a layer's state is lost.

  Args:
    f: one layer's step, ``f(layer, carry, x) -> (carry, y)``.
    layers: the stacked module (every variable with a leading layer axis).
    carry: the initial carry.
    xs: other per-layer inputs, each with a leading layer axis, or ``None``.
    prefetch: as for ``zerojax.scan``.
    policy: the ``jax.checkpoint`` policy of a layer, as for ``zerojax.scan``.
    defer_reductions: as for ``zerojax.scan``.

  Returns:
    ``(carry, ys)``.

  Example:
    >>> import jax, jax.numpy as jnp, zerojax.flax.nnx
    >>> from flax import nnx
    >>> layers = nnx.vmap(lambda rngs: nnx.Linear(16, 16, rngs=rngs))(nnx.Rngs(0).split(3))
    >>> step = lambda layer, h, _: (jnp.tanh(layer(h)), None)
    >>> zerojax.flax.nnx.scan(step, layers, jnp.ones((8, 16)))[0].shape
    (8, 16)
  """
  graphdef, params, rest = nnx.split(layers, nnx.Param, ...)

  def layer(carry, inputs):
    params, rest, x = inputs
    return f(nnx.merge(graphdef, params, rest), carry, x)

  return scan_lib.scan(
    layer,
    carry,
    (params, rest, xs),
    prefetch=prefetch,
    policy=policy,
    defer_reductions=defer_reductions,
  )


def pipeline(
  f: Callable[..., Any],
  layers: nnx.Module,
  carry: Any,
  *,
  microbatches: int,
  schedule: str = "gpipe",
  loss_fn: Callable[..., Any] | None = None,
  loss_params: Any = None,
  targets: tuple[Any, ...] = (),
  axis_name: str = "stage",
  reduce: str | None = None,
  prefetch: int = 1,
  policy: Callable[..., bool] | None = None,
) -> Any:
  """``zerojax.pipeline`` over a stack of NNX layers (a module with stacked state, ``nnx.vmap``).

  The stack's ``n`` layers are split into as many stages as the mesh's
  ``axis_name`` axis has devices (``n`` must divide), each stage runs its
  layers with ``zerojax.scan`` (``f(layer, carry) -> carry`` once per layer,
  each layer gathered one ahead under ``value_and_grad(..., gather=False)``),
  and micro-batches of ``carry`` flow through the stages as ``schedule``
  says. Place the stack's state on the stage axis along its leading
  dimension before ``tx.shard``. Layers are read, not written.

  Args:
    f: one layer's step, ``f(layer, carry) -> carry``.
    layers: the stacked module (every variable with a leading layer axis).
    carry: the first stage's input, split into ``microbatches`` along its
      leading axis.
    microbatches: how many micro-batches.
    schedule: ``"gpipe"`` or ``"1f1b"``.
    loss_fn: as for ``zerojax.pipeline``: ``loss_fn(loss_params, h,
      *targets)``, the loss computed by the last stage.
    loss_params: what ``loss_fn`` differentiates (an ``nnx.State``, say).
    targets: arrays ``loss_fn`` reads, split into micro-batches.
    axis_name: the mesh axis of the stages.
    reduce: as for ``zerojax.pipeline``.
    prefetch: as for ``zerojax.scan``, inside each stage.
    policy: the ``jax.checkpoint`` policy of a layer, as for ``zerojax.scan``.

  Returns:
    The last stage's output, or the mean loss with ``loss_fn``.

  Example:
    >>> import jax, jax.numpy as jnp, zerojax.flax.nnx
    >>> from flax import nnx
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> layers = nnx.vmap(lambda rngs: nnx.Linear(16, 16, rngs=rngs))(nnx.Rngs(0).split(4))
    >>> mesh = jax.make_mesh((2, 4), ("stage", "data"))
    >>> state = nnx.state(layers)
    >>> nnx.update(layers, jax.device_put(state, NamedSharding(mesh, P("stage"))))
    >>> step = lambda layer, h: jnp.tanh(layer(h))
    >>> with jax.set_mesh(mesh):
    ...   y = zerojax.flax.nnx.pipeline(step, layers, jnp.ones((8, 16)), microbatches=2)
    >>> y.shape
    (8, 16)
  """
  graphdef, params, rest = nnx.split(layers, nnx.Param, ...)

  def stage_fn(state, h):
    def layer(h, state):
      return f(nnx.merge(graphdef, *state), h), None

    return scan_lib.scan(layer, h, state, prefetch=prefetch, policy=policy)[0]

  return pipeline_lib.pipeline(
    stage_fn,
    pipeline_lib.by_stage((params, rest), axis_name),
    carry,
    microbatches=microbatches,
    schedule=schedule,
    loss_fn=loss_fn,
    loss_params=loss_params,
    targets=targets,
    axis_name=axis_name,
    reduce=reduce,
  )

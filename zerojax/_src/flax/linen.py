"""Linen modules that gather their parameters when they are called.

Inside ``zerojax.value_and_grad`` the parameters the layout splits reach
``model.apply`` as ``zerojax.Shard`` s. Wrapping a module class with
``gathered`` passes its ``"params"`` through ``zerojax.gather`` at each call,
so each module opens its own parameters right before it uses them; under
``nn.scan`` over stacked layers that is one layer per iteration. ``scan``
runs a stack of layers with ``zerojax.scan`` instead, each layer gathered one
ahead of its compute, and ``pipeline`` splits such a stack into pipeline
stages (``zerojax.pipeline``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from zerojax._src.comm import shards as shards_lib
from zerojax._src.pipeline import loop as pipeline_lib
from zerojax._src.step import scan as scan_lib


def gathered(target: Any) -> Any:
  """Makes a Linen module gather its parameters when it is called, not before.

  ``gathered(Block)`` is ``Block`` wrapped in ``nn.map_variables`` with
  ``zerojax.gather`` as ``trans_in_fn``: every call first gathers the module's
  ``"params"`` (its submodules' included) into full arrays. Wrap the modules
  at the granularity you want whole at once: the block that ``nn.scan``
  repeats, so that one layer is gathered per iteration, and the embedding and
  the head. Every parameter must be inside a wrapped module: an unwrapped one
  receives ``zerojax.Shard`` s, which in stage 3 fail Flax's own shape check
  in ``self.param`` (``ScopeParamShapeError``). Put a parameter that the
  top-level module would declare into a small module of its own, and wrap it.

  ``init`` creates full parameters as usual, and ``apply`` on full parameters
  (outside ``value_and_grad``, for evaluation) runs unchanged, since
  ``gather`` passes plain arrays through. As with other lifted transforms,
  automatic names get a prefix (``Map_variablesDense_0``); pass ``name=`` to
  choose your own.

  Args:
    target: a Linen ``Module`` class (or a function of a module, as
      ``nn.map_variables`` accepts).

  Returns:
    The wrapped class (or function).

  Example:
    >>> import jax, jax.numpy as jnp, optax, zerojax, zerojax.flax.linen
    >>> import flax.linen as nn
    >>> dense = zerojax.flax.linen.gathered(nn.Dense)(64)
    >>> params = dense.init(jax.random.key(0), jnp.ones((8, 16)))["params"]
    >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
    >>> tx = zerojax.zero3(optax.sgd(0.1), mesh=mesh)
    >>> def loss_fn(params, x):
    ...   return jnp.mean(dense.apply({"params": params}, x) ** 2)
    >>> loss, grads = zerojax.value_and_grad(loss_fn, tx)(tx.shard(params), jnp.ones((8, 16)))
    >>> grads["kernel"].sharding.spec
    P(None, 'data')
  """
  # mutable=True rather than init=True: at init the parameters are created
  # inside the mapped scope all the same, while init=True would also run the
  # module on the raw shards whenever ``apply`` makes any collection mutable
  # (batch statistics, say). Outside init, "params" is not mutable in the
  # enclosing scope, so nothing is written back.
  return nn.map_variables(target, "params", trans_in_fn=shards_lib.gather, mutable=True)


def remat_gathered(
  target: Any, *, policy: Callable[..., bool] | str | None = None, **remat_kwargs: Any
) -> Any:
  """``gathered(target)`` under ``nn.remat``, never saving the gathered parameters.

  The checkpoint wraps the gather, so the backward pass gathers the module's
  parameters again instead of keeping them alive from the forward pass. Under
  ``nn.scan`` with stage 3 this keeps one layer whole at a time in both
  passes. The order matters: ``gathered(nn.remat(Block, ...))`` would gather
  outside the checkpoint, whose inputs are kept for the backward pass, and
  hold every layer.

  Args:
    target: a Linen ``Module`` class.
    policy: a ``jax.checkpoint`` policy for the rest (see
      ``zerojax.except_gathered``); by default everything else is saved.
    **remat_kwargs: other arguments of ``nn.remat`` (``prevent_cse``,
      ``static_argnums``, ``methods``).

  Returns:
    The wrapped class.

  Example:
    >>> import jax, jax.numpy as jnp, zerojax.flax.linen
    >>> import flax.linen as nn
    >>> class Block(nn.Module):
    ...   @nn.compact
    ...   def __call__(self, h, _):
    ...     return jnp.tanh(nn.Dense(h.shape[-1])(h)), None
    >>> layers = nn.scan(
    ...   zerojax.flax.linen.remat_gathered(Block, prevent_cse=False),
    ...   variable_axes={"params": 0}, split_rngs={"params": True}, length=3,
    ... )()
    >>> params = layers.init(jax.random.key(0), jnp.ones((8, 32)), None)["params"]
    >>> params["Dense_0"]["kernel"].shape
    (3, 32, 32)
  """
  return nn.remat(gathered(target), policy=shards_lib.except_gathered(policy), **remat_kwargs)


def scan(
  target: type[nn.Module],
  *,
  length: int,
  prefetch: int = 1,
  policy: Callable[..., bool] | str | None = None,
  defer_reductions: bool | None = None,
) -> type[nn.Module]:
  """``nn.scan`` of a layer over stacked parameters, run by ``zerojax.scan``.

  ``zerojax.flax.linen.scan(Block, length=n)`` is a module class that ``init`` s
  exactly as ``nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params":
  True}, length=n)`` does (the same parameter tree, from the same random
  numbers), and that ``apply`` runs with ``zerojax.scan``: under
  ``zerojax.value_and_grad`` each layer's parameters arrive gathered, one
  layer ahead of the compute with ``prefetch=1`` (see ``zerojax.scan``), so
  ``Block`` needs no ``gathered`` wrapper; under ``nn.remat`` its policy decides what
  the backward pass keeps (``zerojax.scan``). ``Block`` has
  ``nn.scan``'s form ``(carry, x) -> (carry, y)``; construct the result with
  ``Block``'s own fields.

  Only parameters are scanned: a block with other collections (batch
  statistics) is refused at ``apply``. Random numbers a block draws with
  ``make_rng`` (``nn.Dropout``) come from the streams ``apply`` is given,
  ``rngs={"dropout": key}``, each split into one key per layer: on the same
  key, the same numbers inside ``zerojax.value_and_grad`` and outside. For
  one mask per example, call ``apply`` under ``jax.vmap`` over the examples
  and their keys (docs/flax.md, "Randomness").

  Args:
    target: the Linen module class of one layer.
    length: the number of layers.
    prefetch: as for ``zerojax.scan``.
    policy: the ``jax.checkpoint`` policy of a layer, as for ``zerojax.scan``
      (``jax.checkpoint_policies.dots_saveable``, say); by default only the
      layer's inputs are saved, the layer computed again in the backward pass.
    defer_reductions: as for ``zerojax.scan``.

  Returns:
    The module class.

  Example:
    >>> import jax, jax.numpy as jnp, optax, zerojax, zerojax.flax.linen
    >>> import flax.linen as nn
    >>> class Block(nn.Module):
    ...   width: int
    ...   @nn.compact
    ...   def __call__(self, h, _):
    ...     return jnp.tanh(nn.Dense(self.width)(h)), None
    >>> layers = zerojax.flax.linen.scan(Block, length=3)(32)
    >>> params = layers.init(jax.random.key(0), jnp.ones((8, 32)), None)["params"]
    >>> params["Dense_0"]["kernel"].shape
    (3, 32, 32)
    >>> tx = zerojax.zero3(optax.sgd(0.1), mesh=jax.make_mesh((jax.device_count(),), ("data",)))
    >>> loss_fn = lambda params, x: jnp.mean(layers.apply({"params": params}, x, None)[0])
    >>> loss, grads = zerojax.value_and_grad(loss_fn, tx)(tx.shard(params), jnp.ones((8, 32)))
    >>> grads["Dense_0"]["kernel"].sharding.spec
    P(None, 'data')
  """
  stacked = nn.scan(target, variable_axes={"params": 0}, split_rngs={"params": True}, length=length)
  fields = [f.name for f in dataclasses.fields(target) if f.name not in ("parent", "name")]

  class Scanned(stacked):
    def __call__(self, carry: Any, xs: Any = None) -> tuple[Any, Any]:
      if self.is_initializing():
        return super().__call__(carry, xs)
      others = sorted(set(self.variables) - {"params"})
      if others:
        raise ValueError(
          f"zerojax.flax.linen.scan scans parameters only, and {target.__name__} also has the "
          f"collections {others}: use nn.scan for it, or keep that state out of the block."
        )
      block = target(**{name: getattr(self, name) for name in fields}, parent=None)

      def layer(carry, inputs):
        params, rngs, x = inputs
        return block.apply({"params": params}, carry, x, rngs=rngs)

      params = self.variables["params"]
      # Each random stream apply was given (rngs={"dropout": key}) splits into one key a layer.
      streams = self.scope.rngs if self.scope is not None else {}
      rngs = {name: jax.random.split(self.make_rng(name), length) for name in streams}
      return scan_lib.scan(
        layer,
        carry,
        (params, rngs, xs),
        prefetch=prefetch,
        policy=policy,
        defer_reductions=defer_reductions,
      )

  Scanned.__name__ = Scanned.__qualname__ = f"Scan{target.__name__}"
  return Scanned


def pipeline(
  target: type[nn.Module],
  *,
  length: int,
  microbatches: int,
  schedule: str = "gpipe",
  axis_name: str = "stage",
  reduce: str | None = None,
  prefetch: int = 1,
  policy: Callable[..., bool] | None = None,
) -> type[nn.Module]:
  """``nn.scan`` of a layer whose stack runs as a pipeline over the ``axis_name`` mesh axis.

  ``zerojax.flax.linen.pipeline(Block, length=n, microbatches=m)`` is a module
  class that ``init`` s exactly as ``zerojax.flax.linen.scan(Block, length=n)`` does
  (the same parameter tree, stacked ``(n, ...)``, from the same random
  numbers), and that ``apply`` runs with ``zerojax.pipeline``: the stack is
  split into as many stages as the mesh axis has devices (``n`` must divide),
  each stage runs its layers with ``zerojax.scan`` (each layer gathered one
  ahead, ``prefetch``), and micro-batches flow through the stages as
  ``schedule`` says. Place the stacked parameters on the stage axis
  (``NamedSharding(mesh, P(axis_name))``) before ``tx.shard``.

  Calling the module as ``layers(h)`` returns the last layer's output
  (``schedule="gpipe"``). ``layers(h, loss_fn=..., loss_params=...,
  targets=(y,))`` computes the loss inside the pipeline and returns its mean
  over micro-batches (any schedule; ``"1f1b"`` needs it): see
  ``zerojax.pipeline``. ``Block`` has ``nn.scan``'s form ``(carry, x) ->
  (carry, y)``; it receives ``x=None`` and its ``y`` is dropped.

  Random streams given to ``apply`` (``rngs={"dropout": key}``) reach the
  blocks: the module draws one key per stream (``make_rng``), and layer ``i``
  of stage ``s`` gets, for micro-batch ``m``, that key folded with ``m``,
  ``s`` and ``i`` in turn (``zerojax.pipeline``'s ``key=``, then the layer).

  Args:
    target: the Linen module class of one layer.
    length: the number of layers (all stages together).
    microbatches: how many micro-batches the input is split into.
    schedule: ``"gpipe"`` or ``"1f1b"``.
    axis_name: the mesh axis of the stages.
    reduce: as for ``zerojax.pipeline``.
    prefetch: as for ``zerojax.scan``, inside each stage.
    policy: the ``jax.checkpoint`` policy of a layer, as for ``zerojax.scan``.

  Returns:
    The module class.

  Example:
    >>> import jax, jax.numpy as jnp, zerojax.flax.linen
    >>> import flax.linen as nn
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> class Block(nn.Module):
    ...   @nn.compact
    ...   def __call__(self, h, _):
    ...     return jnp.tanh(nn.Dense(h.shape[-1])(h)), None
    >>> layers = zerojax.flax.linen.pipeline(Block, length=4, microbatches=2)()
    >>> params = layers.init(jax.random.key(0), jnp.ones((8, 16)))["params"]
    >>> mesh = jax.make_mesh((2, 4), ("stage", "data"))
    >>> params = jax.device_put(params, NamedSharding(mesh, P("stage")))
    >>> with jax.set_mesh(mesh):
    ...   jax.jit(layers.apply)({"params": params}, jnp.ones((8, 16))).shape
    (8, 16)
  """
  stacked = nn.scan(target, variable_axes={"params": 0}, split_rngs={"params": True}, length=length)
  fields = [f.name for f in dataclasses.fields(target) if f.name not in ("parent", "name")]

  class Pipelined(stacked):
    def __call__(self, carry, *, loss_fn=None, loss_params=None, targets=()):
      if self.is_initializing():
        h = super().__call__(carry, None)[0]
        return h if loss_fn is None else loss_fn(loss_params, h, *targets)
      block = target(**{name: getattr(self, name) for name in fields}, parent=None)
      stages = pipeline_lib.by_stage(self.variables["params"], axis_name)
      per_stage = length // pipeline_lib.stage_count(stages, axis_name)
      # The random streams apply was given (dropout, say), one key each for the pipeline.
      streams = sorted(self.scope.rngs if self.scope is not None else ())
      keys = {name: self.make_rng(name) for name in streams if name != "params"}

      def stage_fn(params, h, keys=None):
        def layer(h, inputs):
          params, i = inputs
          rngs = None if keys is None else {n: jax.random.fold_in(k, i) for n, k in keys.items()}
          return block.apply({"params": params}, h, None, rngs=rngs)

        layers = (params, jnp.arange(per_stage))
        return scan_lib.scan(layer, h, layers, prefetch=prefetch, policy=policy)[0]

      return pipeline_lib.pipeline(
        stage_fn,
        stages,
        carry,
        microbatches=microbatches,
        schedule=schedule,
        axis_name=axis_name,
        reduce=reduce,
        loss_fn=loss_fn,
        loss_params=loss_params,
        targets=targets,
        key=keys or None,
      )

  Pipelined.__name__ = Pipelined.__qualname__ = f"Pipelined{target.__name__}"
  return Pipelined

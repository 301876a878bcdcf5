"""``Stored``: a stage-3 parameter as zerojax stores it, which knows its own layout.

Stage 3 stores each parameter split over the data axes, padded where its
sharded dimension does not divide by the device count. ``tx.shard`` returns
each such leaf as a ``Stored``: a pytree node whose one child is the stored
array and whose static data is the leaf's ``LeafLayout`` (its logical shape,
the split dimension, the padding, the spec). So every API that is handed
stored parameters reads what they are instead of inferring it from shapes;
and ``jax.tree.map``, ``jax.jit``, ``jax.grad`` and ``optax.apply_updates``
carry the layout for free, as static data of the tree's structure (gradients
and updates come back in the same nodes).

A ``Stored`` is not an array: a model that uses one as if it were the whole
parameter (evaluating on stored parameters, or a drop-in step that forgot
``tx.unpad``) gets zerojax's error saying what to call instead, rather than a
shape or sharding error from deep inside JAX.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax

if TYPE_CHECKING:
  from zerojax._src.sharding import layout as layout_lib


class Stored:
  """A stage-3 parameter as stored: its ``value`` (split over the data axes) and its ``layout``.

  Attributes:
    value: the stored array (or a ``jax.ShapeDtypeStruct``, a tracer, ...).
    layout: the ``zerojax.LeafLayout`` it was stored with (static).

  Example:
    >>> import jax, jax.numpy as jnp, optax, zerojax
    >>> tx = zerojax.zero3(optax.sgd(0.1), mesh=jax.make_mesh((jax.device_count(),), ("data",)))
    >>> w = tx.shard({"w": jnp.ones((4, 1001))})["w"]
    >>> w.shape, w.layout.shape, w.sharding.spec
    ((4, 1008), (4, 1001), P(None, 'data'))
  """

  __slots__ = ("layout", "value")

  def __init__(self, value: Any, layout: layout_lib.LeafLayout):
    self.value = value
    self.layout = layout

  @property
  def shape(self) -> tuple[int, ...]:
    """The stored (padded) shape; ``layout.shape`` is the model's (``tx.num_params`` counts it)."""
    return tuple(self.value.shape)

  @property
  def dtype(self) -> Any:
    return self.value.dtype

  @property
  def sharding(self) -> Any:
    return self.value.sharding

  def __repr__(self) -> str:
    return f"Stored({self.value!r}, logical shape {self.layout.shape})"

  def __jax_array__(self) -> Any:
    raise used_as_array(self)

  def __array__(self, *args: Any, **kwargs: Any) -> Any:
    raise used_as_array(self)

  def __getitem__(self, index: Any) -> Any:
    raise used_as_array(self)


def used_as_array(stored: Stored) -> ValueError:
  """The error for a ``Stored`` used as the whole parameter: what to call instead."""
  padded = f" (padded from {stored.layout.shape})" if stored.layout.padding else ""
  return ValueError(
    f"a stage-3 parameter stored as {stored.shape}{padded}, 1/N of it on each device, was used "
    "as a whole array. Inside zerojax.value_and_grad, open it with zerojax.gather(params) (or "
    "zerojax.scan); in a drop-in jax.grad step, call the model on tx.unpad(params); to evaluate "
    "or export, use tx.gather(params)."
  )


def _operator(name: str) -> Any:
  def refuse(self: Stored, *args: Any) -> Any:
    raise used_as_array(self)

  refuse.__name__ = name
  return refuse


# Arithmetic with an array tries the array's operator first, which returns NotImplemented for a
# type JAX does not know, then this one: the same error, not "unsupported operand type(s)".
for _name in ("add", "sub", "mul", "matmul", "truediv", "floordiv", "pow", "mod"):
  for _dunder in (f"__{_name}__", f"__r{_name}__"):
    setattr(Stored, _dunder, _operator(_dunder))


jax.tree_util.register_pytree_with_keys(
  Stored,
  lambda s: (((jax.tree_util.GetAttrKey("value"), s.value),), s.layout),
  lambda layout, children: Stored(*children, layout=layout),
  lambda s: ((s.value,), s.layout),
)


def is_stored(x: Any) -> bool:
  return isinstance(x, Stored)


def unwrap(tree: Any) -> Any:
  """``tree`` with each ``Stored`` replaced by its array (a plain tree of the stored arrays)."""
  return jax.tree.map(lambda x: x.value if is_stored(x) else x, tree, is_leaf=is_stored)


def wraps(tree: Any) -> bool:
  """Whether ``tree`` holds any ``Stored``."""
  return any(is_stored(x) for x in jax.tree.leaves(tree, is_leaf=is_stored))


def wrap(layout: layout_lib.Layout, tree: Any) -> Any:
  """The plain stored ``tree`` of ``layout`` with each leaf a ``Stored`` of its leaf layout."""
  return layout.map(lambda leaf, x: Stored(x, leaf), tree)


def logical(tree: Any) -> Any:
  """``tree`` with each ``Stored`` replaced by a ``jax.ShapeDtypeStruct`` of its logical leaf,
  checked against its array: what planning the tree starts from."""

  def leaf(x: Any) -> Any:
    if not is_stored(x):
      return x
    if x.value is not None and tuple(x.shape) != x.layout.stored_shape:
      raise ValueError(
        f"a zerojax.Stored parameter holds an array of shape {tuple(x.shape)}, but its layout "
        f"stores {x.layout.stored_shape} (logical {x.layout.shape}): a jax.tree.map changed "
        "its shape. Map over tx.gather(params) or tx.unpad(params) instead, or store the new "
        "arrays with tx.shard."
      )
    return jax.ShapeDtypeStruct(x.layout.shape, x.layout.dtype)

  return jax.tree.map(leaf, tree, is_leaf=is_stored)


def rewrap(like: Any, tree: Any) -> Any:
  """The plain ``tree`` with a ``Stored`` wherever ``like`` (of the same structure) has one."""
  template, treedef = jax.tree.flatten(like, is_leaf=is_stored)
  leaves = jax.tree.leaves(tree)
  return jax.tree.unflatten(
    treedef,
    [Stored(x, t.layout) if is_stored(t) else x for t, x in zip(template, leaves, strict=True)],
  )

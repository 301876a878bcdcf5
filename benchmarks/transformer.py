"""A decoder-only transformer of Llama's shape, for the big-model benchmark: its four programs.

Pre-norm RMSNorm layers of grouped-query attention (no rotary embedding: it
changes no shape and no byte) and a SwiGLU MLP, untied input and output
embeddings, bfloat16 compute. The layers' weights are stacked along a leading
layer axis. ``CONFIGS`` holds the two sizes wave 5 proves: a 7.5B model and a
70B one (Llama-2-70B's shape: 80 layers, d 8192, 64 query heads over 8 key
and value heads, MLP 28672).

Each program comes in two forms over the same arrays:

* zerojax's, on stored parameters (``zerojax.value_and_grad`` and
  ``zerojax.forward``): the layers run under ``zerojax.scan``, one gathered at
  a time, the other parameters opened with ``zerojax.gather``;
* GSPMD FSDP's, on whole parameters that ``NamedSharding`` annotations split
  (``fsdp_specs``): ``jax.lax.scan`` over ``jax.checkpoint`` ed layers, and
  the compiler places the gathers.

Like ``model.py`` and ``mlp.py`` it describes arrays and steps only, so the
benchmark may compile for hardware it does not have.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

import zerojax

#: The data-parallel mesh axis GSPMD FSDP keeps the batch on.
AXIS = "data"
#: What every layer's ``jax.checkpoint`` saves: nothing but the layer's input (the carry).
POLICY = "nothing_saveable"
#: The ``checkpoint_name`` s of a layer's activations a policy may keep by name: the query
#: projection, the keys' and values' projection, and the MLP's hidden activations (the
#: gate-and-up projection's output, ``2 * mlp`` wide).
NAMES = ("q_proj", "kv_proj", "mlp_hidden")


@dataclasses.dataclass(frozen=True)
class Config:
  """The transformer's shape, and the sequences a device trains on and samples from."""

  layers: int
  d: int
  heads: int
  kv_heads: int
  mlp: int
  vocab: int = 32000
  head_dim: int = 128
  seq_len: int = 2048

  @property
  def parameters(self) -> int:
    """How many parameters the model has."""
    return sum(s.size for s in jax.tree.leaves(abstract_params(self)))

  @property
  def layer_parameters(self) -> int:
    """How many parameters one layer has: what a gather opens at once."""
    return sum(s.size // self.layers for s in jax.tree.leaves(abstract_params(self)["layers"]))


CONFIGS = {
  "7.5B": Config(layers=30, d=4096, heads=32, kv_heads=32, mlp=14080),
  "70B": Config(layers=80, d=8192, heads=64, kv_heads=8, mlp=28672),
}


def abstract_params(config: Config) -> dict[str, Any]:
  """The float32 parameters' shapes."""
  c = config
  stacked = lambda *shape: jax.ShapeDtypeStruct((c.layers, *shape), jnp.float32)
  return {
    "embed": jax.ShapeDtypeStruct((c.vocab, c.d), jnp.float32),
    "layers": {
      "attn_norm": stacked(c.d),
      "q": stacked(c.d, c.heads * c.head_dim),
      "kv": stacked(c.d, 2 * c.kv_heads * c.head_dim),
      "o": stacked(c.heads * c.head_dim, c.d),
      "mlp_norm": stacked(c.d),
      "gate_up": stacked(c.d, 2 * c.mlp),
      "down": stacked(c.mlp, c.d),
    },
    "norm": jax.ShapeDtypeStruct((c.d,), jnp.float32),
    "head": jax.ShapeDtypeStruct((c.d, c.vocab), jnp.float32),
  }


def init_fn(config: Config, key: jax.Array) -> dict[str, Any]:
  """The float32 parameters drawn from ``key``: norms at one, matrices at ``1/sqrt(fan_in)``."""
  paths, treedef = jax.tree_util.tree_flatten_with_path(abstract_params(config))
  keys = jax.random.split(key, len(paths))

  def draw(key: jax.Array, path: Any, s: jax.ShapeDtypeStruct) -> jax.Array:
    if path[-1].key.endswith("norm"):
      return jnp.ones(s.shape, s.dtype)
    return jax.random.normal(key, s.shape, s.dtype) * s.shape[-2] ** -0.5

  return jax.tree.unflatten(treedef, [draw(k, *leaf) for k, leaf in zip(keys, paths, strict=True)])


def fsdp_specs(config: Config, axis: str = AXIS) -> dict[str, Any]:
  """GSPMD FSDP's placement: each matrix split over ``axis`` along its model dimension (d),
  the norms whole; the layer axis is never split."""
  c = config

  def spec(s: jax.ShapeDtypeStruct) -> P:
    dims = [None] * s.ndim
    if s.ndim - (s.shape[0] == c.layers) >= 2:  # a matrix: split its d dimension
      dims[list(s.shape).index(c.d, s.ndim - 2)] = axis
    return P(*dims)

  return jax.tree.map(spec, abstract_params(config))


def rms_norm(x: jax.Array, scale: jax.Array) -> jax.Array:
  x32 = x.astype(jnp.float32)
  normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-6)
  return (normed * scale).astype(x.dtype)


def _bf16(tree: Any) -> Any:
  return jax.tree.map(lambda w: w.astype(jnp.bfloat16), tree)


def attention_inputs(config: Config, h: jax.Array, w: dict[str, jax.Array]):
  """The layer's queries, keys and values, ``(batch, time, heads, head_dim)`` each."""
  c = config
  batch, time, _ = h.shape
  x = rms_norm(h, w["attn_norm"])
  q = checkpoint_name(x @ w["q"], "q_proj").reshape(batch, time, c.heads, c.head_dim)
  kv = checkpoint_name(x @ w["kv"], "kv_proj")
  k, v = jnp.split(kv.reshape(batch, time, 2 * c.kv_heads, c.head_dim), 2, axis=2)
  return q, k, v


def layer_rest(h: jax.Array, attended: jax.Array, w: dict[str, jax.Array]) -> jax.Array:
  """The layer after attention: its output projection, then the SwiGLU MLP, both residual."""
  batch, time = h.shape[:2]
  h = h + attended.reshape(batch, time, -1) @ w["o"]
  hidden = checkpoint_name(rms_norm(h, w["mlp_norm"]) @ w["gate_up"], "mlp_hidden")
  gate, up = jnp.split(hidden, 2, axis=-1)
  return h + (jax.nn.silu(gate) * up) @ w["down"]


def layer(config: Config, h: jax.Array, w: dict[str, jax.Array]) -> jax.Array:
  """One layer over whole sequences, causal, in bfloat16."""
  w = _bf16(w)
  q, k, v = attention_inputs(config, h, w)
  return layer_rest(h, jax.nn.dot_product_attention(q, k, v, is_causal=True), w)


def per_example_loss(
  config: Config,
  params: dict[str, Any],
  tokens: jax.Array,
  zero: bool,
  prefetch: int = 1,
  remat: Any = None,
) -> jax.Array:
  """Each sequence's mean next-token cross-entropy (``tokens`` of ``seq_len + 1``).

  ``zero``: on stored parameters inside zerojax's ``shard_map`` (the layers under
  ``zerojax.scan``, ``prefetch`` layers ahead, the rest opened with
  ``zerojax.gather``); otherwise on whole (annotated) parameters under
  ``jax.lax.scan``.

  ``remat``: the user's own wrapping of the layer, the same on both sides
  (``jax.checkpoint`` with a policy, or ``lambda f: f`` for none, which keeps every
  value on both sides), under a scan given no policy of its own; ``None``: ``POLICY``, as zerojax's
  ``policy=`` and as GSPMD's ``jax.checkpoint``.
  """
  x, y = tokens[:, :-1], tokens[:, 1:]
  outer = zerojax.gather({k: v for k, v in params.items() if k != "layers"}) if zero else params
  h = _bf16(outer["embed"])[x]
  step = lambda h, w: (_batch_split(layer(config, h, w), zero), None)
  if remat is not None:
    wrapped = remat(step)
    # A layer left plain keeps every value, as jax.lax.scan of it does (zerojax.scan's default
    # keeps only the layer's inputs); a checkpointed one keeps what its policy says.
    policy = "everything_saveable" if wrapped is step else None
    scan = functools.partial(zerojax.scan, prefetch=prefetch, policy=policy)
    h, _ = (scan if zero else jax.lax.scan)(wrapped, h, params["layers"])
  elif zero:
    h, _ = zerojax.scan(step, h, params["layers"], prefetch=prefetch, policy=POLICY)
  else:
    policy = getattr(jax.checkpoint_policies, POLICY)
    h, _ = jax.lax.scan(jax.checkpoint(step, policy=policy), h, params["layers"])
  logits = (rms_norm(h, outer["norm"]) @ _bf16(outer["head"])).astype(jnp.float32)
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(axis=-1)


def _batch_split(h: jax.Array, zero: bool) -> jax.Array:
  """``h``; for GSPMD under a mesh, constrained to stay split over the batch as FSDP's are."""
  if zero or jax.sharding.get_abstract_mesh().empty:
    return h
  return jax.lax.with_sharding_constraint(h, P(AXIS))


def mean_loss(config: Config, zero: bool, remat: Any = None, prefetch: int = 1):
  """``loss(params, tokens)``: the batch's mean, for a training step (``remat`` and ``prefetch``
  as for ``per_example_loss``)."""
  return lambda params, tokens: per_example_loss(
    config, params, tokens, zero, prefetch, remat=remat
  ).mean()


def decode(
  config: Config,
  params: dict[str, Any],
  tokens: jax.Array,
  cache: dict[str, jax.Array],
  position: jax.Array,
  zero: bool,
  prefetch: int = 1,
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """One sampling step: each sequence's next token (greedy) after ``tokens`` at ``position``.

  ``cache`` holds every layer's keys and values, ``(batch, layers, seq_len,
  kv_heads, head_dim)`` in bfloat16, batch first (so that ``zerojax.forward``
  splits it like the batch); the step writes the new position's into it.
  """
  c = config
  outer = zerojax.gather({k: v for k, v in params.items() if k != "layers"}) if zero else params
  h = _bf16(outer["embed"])[tokens][:, None]
  visible = (jnp.arange(c.seq_len) <= position[:, None])[:, None, None, :]
  write = jax.vmap(lambda past, new, at: jax.lax.dynamic_update_slice_in_dim(past, new, at, 0))

  def step(carry, w):
    h, i = carry
    w = _bf16(w)
    q, k, v = attention_inputs(config, h, w)
    past = lambda name: jax.lax.dynamic_index_in_dim(cache[name], i, axis=1, keepdims=False)
    keys, values = write(past("k"), k, position), write(past("v"), v, position)
    attended = jax.nn.dot_product_attention(q, keys, values, mask=visible)
    return (_batch_split(layer_rest(h, attended, w), zero), i + 1), (k[:, 0], v[:, 0])

  scan = functools.partial(zerojax.scan, prefetch=prefetch) if zero else jax.lax.scan
  (h, _), (k, v) = scan(step, (h, jnp.int32(0)), params["layers"])
  batch = jnp.arange(tokens.shape[0])
  cache = {
    name: cache[name].at[batch, :, position].set(jnp.moveaxis(new, 0, 1))
    for name, new in (("k", k), ("v", v))
  }
  logits = rms_norm(h[:, 0], outer["norm"]) @ _bf16(outer["head"])
  return jnp.argmax(logits, axis=-1).astype(jnp.int32), cache


def abstract_cache(config: Config, batch: int) -> dict[str, jax.ShapeDtypeStruct]:
  """The keys and values of ``batch`` sequences, every layer, bfloat16."""
  c = config
  shape = (batch, c.layers, c.seq_len, c.kv_heads, c.head_dim)
  return {name: jax.ShapeDtypeStruct(shape, jnp.bfloat16) for name in ("k", "v")}

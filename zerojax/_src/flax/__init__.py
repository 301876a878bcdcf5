"""Flax: ``linen`` modules that gather their parameters when called, and ``nnx`` models trained
with ``zerojax.value_and_grad``."""

"""NNX: models trained with ``zerojax.value_and_grad``, their layers gathered where used.

``value_and_grad`` is ``zerojax.value_and_grad`` for a loss of an
``nnx.Module``, as ``nnx.value_and_grad`` is ``jax.value_and_grad``'s;
``gathered`` gathers one submodule where the model calls it; ``scan`` runs
stacked layers with ``zerojax.scan`` and ``pipeline`` splits them into pipeline
stages. See docs/flax.md.
"""

from zerojax._src.flax.nnx import gathered, pipeline, scan, value_and_grad

__all__ = ("gathered", "pipeline", "scan", "value_and_grad")

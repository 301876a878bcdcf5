"""NNX: models trained with ``zerojax.value_and_grad``, their layers gathered where used.

``value_and_grad`` is ``zerojax.value_and_grad`` for a loss of an
``nnx.Module``, as ``nnx.value_and_grad`` is ``jax.value_and_grad``'s, and
``forward`` is ``zerojax.forward`` for one (evaluating, sampling);
``gathered`` gathers one submodule where the model calls it; ``scan`` runs
stacked layers with ``zerojax.scan`` and ``pipeline`` splits them into pipeline
stages. See docs/flax.md.
"""

from zerojax._src.flax.nnx import forward, gathered, pipeline, scan, value_and_grad

__all__ = ("forward", "gathered", "pipeline", "scan", "value_and_grad")

"""Flax integration: Linen modules and NNX models trained with zerojax.

Linen: ``gathered`` and ``remat_gathered`` wrap module classes so that each
module gathers its own parameters when it is called (one layer per iteration
under ``nn.scan``), and ``scan`` runs a layer stack with ``zerojax.scan``
(each layer gathered one ahead), and ``pipeline`` splits that stack into
pipeline stages (``zerojax.pipeline``). NNX: ``nnx_value_and_grad`` is
``zerojax.value_and_grad`` for a loss of an ``nnx.Module``, ``nnx_gathered``
gathers one submodule, and ``nnx_scan`` runs stacked layers with
``zerojax.scan``.
``flax.training.train_state.TrainState`` and ``nnx.Optimizer`` take a
``zerojax`` transformation as their ``tx`` unchanged. See docs/flax.md.

The NNX names import ``flax.nnx`` (and, through it, IPython) on first use, not
with this module: a Linen program starts 0.7 s sooner.
"""

import importlib
from typing import TYPE_CHECKING

from zerojax._src.flax.linen import gathered, pipeline, remat_gathered, scan

if TYPE_CHECKING:
  from zerojax._src.flax.nnx import nnx_gathered, nnx_pipeline, nnx_scan, nnx_value_and_grad

_NNX = frozenset({"nnx_gathered", "nnx_pipeline", "nnx_scan", "nnx_value_and_grad"})


def __getattr__(name: str):
  if name in _NNX:
    value = getattr(importlib.import_module("zerojax._src.flax.nnx"), name)
    globals()[name] = value
    return value
  raise AttributeError(f"module 'zerojax.flax' has no attribute {name!r}")


def __dir__() -> list[str]:
  return sorted({*globals(), *_NNX})


__all__ = (
  "gathered",
  "nnx_gathered",
  "nnx_pipeline",
  "nnx_scan",
  "nnx_value_and_grad",
  "pipeline",
  "remat_gathered",
  "scan",
)

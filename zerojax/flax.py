"""Flax integration: Linen modules and NNX models trained with zerojax.

Linen: ``gathered`` and ``remat_gathered`` wrap module classes so that each
module gathers its own parameters when it is called (one layer per iteration
under ``nn.scan``). NNX: ``nnx_value_and_grad`` is ``zerojax.value_and_grad``
for a loss of an ``nnx.Module``, and ``nnx_gathered`` gathers one submodule.
``flax.training.train_state.TrainState`` and ``nnx.Optimizer`` take a
``zerojax`` transformation as their ``tx`` unchanged. See docs/flax.md.
"""

from zerojax._src.flax_linen import gathered, remat_gathered
from zerojax._src.flax_nnx import nnx_gathered, nnx_value_and_grad

__all__ = ("gathered", "nnx_gathered", "nnx_value_and_grad", "remat_gathered")

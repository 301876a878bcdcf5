"""Flax integration, named as Flax names its APIs: ``zerojax.flax.linen`` and ``zerojax.flax.nnx``.

``import zerojax.flax.linen`` for Linen modules that gather their parameters
when called (``gathered``, ``remat_gathered``) and layer stacks run by
``zerojax.scan`` or ``zerojax.pipeline`` (``scan``, ``pipeline``);
``import zerojax.flax.nnx`` for NNX models (``value_and_grad``, ``gathered``,
``scan``, ``pipeline``). Each imports only its own Flax API: a Linen program
does not pay for importing NNX. ``flax.training.train_state.TrainState`` and
``nnx.Optimizer`` take a zerojax transformation as their ``tx`` unchanged. See
docs/flax.md.
"""

__all__ = ()  # the APIs are its submodules, each imported on its own

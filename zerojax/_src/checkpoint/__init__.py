"""Checkpoints: what a state looks like (``spec``), the ``record`` kept of it, restore decisions
(``verdict``), the master copy's moves (``master``), the ``directory`` on disk, the ``manager``
that saves and restores, and ``export`` to safetensors."""

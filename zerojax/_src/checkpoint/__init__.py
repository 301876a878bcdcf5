"""Checkpoints: what a state looks like (``spec``), the ``record`` kept of it, restore decisions
(``verdict``), the master copy's moves (``master``), the ``directory`` on disk, the ``manager``
that saves and restores, ``export`` to safetensors, ``load`` of pretrained weights into shards,
and ``pretrained_export`` of them back out in another framework's names and layout."""

"""The ZeRO-wrapped optimizer: its ``settings``, what each stage splits (``stages``), the
``plans`` of a tree, the ``state``, ``precision`` and ``offload``, the ``checks`` of what users
pass, the ``optimizer`` step and the public ``transformation``."""

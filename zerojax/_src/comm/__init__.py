"""The collectives: one array's (``primitives``), in fewer bytes (``quantized``), inside a node
(``hierarchical``, ZeRO++'s hpZ), a layer's shards opened for compute (``opening``), and their
order on XLA:CPU (``ordering``)."""

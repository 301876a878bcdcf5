"""How a tree is split over a mesh: each leaf's layout (``layout``), the mesh it lives on
(``mesh``), and a stored leaf that carries its layout (``stored``). Imports nothing else of
zerojax."""

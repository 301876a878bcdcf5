"""How a tree is split over a mesh: each leaf's layout (``layout``) and the mesh it lives on
(``mesh``). Imports nothing else of zerojax."""

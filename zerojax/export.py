"""Command line: write a checkpoint's full-precision parameters to one ``.safetensors`` file.

Example:
  From a shell::

    python -m zerojax.export ckpt model.safetensors --step 600

From Python, ``zerojax.export_safetensors("ckpt", "model.safetensors")`` does the same.
"""

from zerojax._src.checkpoint.export import main

__all__ = ("main",)

if __name__ == "__main__":
  main()

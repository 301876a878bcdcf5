"""Reading programs and predicting them: ``hlo`` (collectives in HLO text), ``overlap`` (what a
loop's compute waits on), ``gpu_log`` (XLA:GPU's own estimate), ``deviceless`` (compiling for
GPUs and TPUs without them), ``profile``, and the ``estimate`` (and its command line,
``estimate_cli``) of memory and communication before compiling."""

"""What zload knows of the libraries around it: DeepSpeed's internals, transformers and peft models.

Each module here imports its library only inside its functions, and only once a model of that
library is being built, loaded or saved: importing zload, or loading a plain torch model, never
imports them.

- ``deepspeed.py``: every use of DeepSpeed's internals (ZeRO-3 parameters' attributes, an engine's
  optimizer, zero.Init), and the check of the installed DeepSpeed's version.

- ``transformers.py``: transformers' checkpoint conversion mapping turned into byte ranges
  (``names.Piece``), or into the slow path where no byte range expresses a conversion.
- ``transformers_registry.py``: transformers' conversion registry built with deferred transforms,
  a speed-up that rebuilds one of transformers' private functions.
- ``peft.py``: the names peft's own checkpoints use for a ``PeftModel``'s tensors.
"""

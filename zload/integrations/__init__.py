"""The optional parts: what zload knows of transformers and peft models.

Each module here builds on zload's core (``names.py``: name matching without either library) and
imports transformers or peft only inside its functions, and only once a model of that library is
being loaded or saved: importing zload, or loading a plain torch model, never imports them.

- ``transformers.py``: transformers' checkpoint conversion mapping turned into byte ranges
  (``names.Piece``), or into the slow path where no byte range expresses a conversion.
- ``transformers_registry.py``: transformers' conversion registry built with deferred transforms,
  a speed-up that rebuilds one of transformers' private functions.
- ``peft.py``: the names peft's own checkpoints use for a ``PeftModel``'s tensors.
"""

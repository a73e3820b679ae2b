"""The tasks of ``specfx bench``, one module each."""

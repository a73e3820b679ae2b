"""The inputs of one ``generate()`` call: HF's arguments resolved as transformers resolves them,
their values checked, and the sampling parameters they imply.
"""

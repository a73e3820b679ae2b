"""The shipped demo pair (``specfx demo``) and its heads.
"""

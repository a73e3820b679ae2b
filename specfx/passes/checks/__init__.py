"""Verification passes: they change nothing and raise when a graph breaks an invariant.
"""

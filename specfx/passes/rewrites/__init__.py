"""Transformation passes: each rewrites a graph and returns how many sites it changed.
"""

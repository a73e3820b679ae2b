"""Token trees: the static and dynamic tree types a round verifies.
"""

"""Drafters: whatever proposes the K tokens of a round. One module per drafter; heads that read
the target's hidden states (Medusa, EAGLE, EAGLE-3) and their checkpoint layouts in
:mod:`specfx.drafters.heads`.
"""

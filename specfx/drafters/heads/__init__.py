"""Draft heads over the target's hidden states (Medusa, EAGLE-1/2, EAGLE-3) and the public
checkpoint layouts they are read from and written in.
"""

"""The shipped demo pair (``specfx demo``) and its heads (:mod:`specfx.demo.pair`), and
SmolLM2-135M-Instruct, a real chat model fetched from PyPI and cached (:mod:`specfx.demo.smollm2`).
"""

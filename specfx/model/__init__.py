"""One model as specfx runs it, each concern one module, dependencies one way:

- :mod:`~specfx.model.runner`: the forward with static KV, explicit masks and positions;
- :mod:`~specfx.model.admission`: whether specfx can run a model exactly (checks, probes,
  refusals), with the probe's measurements in :mod:`~specfx.model.probe`;
- :mod:`~specfx.model.taps`: the tapped forward returning hidden states, a capture
  (:mod:`~specfx.model.capture`) rewritten by the hidden-taps pass;
- :mod:`~specfx.model.cache` (the static slot cache), :mod:`~specfx.model.masks`,
  :mod:`~specfx.model.hf_names`, :mod:`~specfx.model.dynamo`, :mod:`~specfx.model.load`;
- :mod:`~specfx.model.architectures`: the architecture table (data and pure queries).

runner -> admission -> architectures -> probe; runner -> taps -> capture; none imports the runner.
"""

"""Draft heads over the target's hidden states (Medusa, EAGLE-1/2, EAGLE-3) and the public
checkpoint layouts they are read from and written in.

One head, one drafter module, its pieces beside it:

* Medusa: :mod:`~specfx.drafters.heads.medusa` (the drafter) and
  :mod:`~specfx.drafters.heads.medusa_checkpoint` (FasterDecoding's and vLLM's layouts).
* EAGLE-1/2: :mod:`~specfx.drafters.heads.eagle` (the head), :mod:`~specfx.drafters.heads.eagle_layer`
  (its decoder layer, of the target's class), :mod:`~specfx.drafters.heads.eagle_checkpoint`
  (SafeAILab's layout).
* EAGLE-3: :mod:`~specfx.drafters.heads.eagle3` (the head), :mod:`~specfx.drafters.heads.eagle3_head`
  (its modules), :mod:`~specfx.drafters.heads.eagle3_checkpoint` (taps and layout).
* DFlash: :mod:`~specfx.drafters.heads.dflash` (the block drafter over the target's taps),
  :mod:`~specfx.drafters.heads.dflash_head` (its modules and z-lab's layout).
* Both EAGLE heads run the cache protocol of :class:`~specfx.drafters.heads.eagle_base.EagleBase`;
  every head reads and writes files through :mod:`~specfx.drafters.heads.checkpoint`
  (safetensors only) and warns, on saving, where a serving engine would not run it as specfx does.
"""

"""Speculative decoding: drafters propose tokens, the target model verifies them in one step.

* ``speculator.py``: ``Speculator``, what the engine calls: draft slots per sequence
  (``lookahead``), the drafts of a scheduled batch (``propose``) and the counters behind the
  ``spec_decode_*`` metrics (``record``).
* ``tree.py``: ``DraftTree``, a step's drafts for one sequence (a chain, or a tree when
  ``spec_tree_width`` > 1), and how the target's samples accept a path of it.
* ``ngram.py``: ``NgramDrafter``, prompt lookup: the tokens that followed the latest earlier
  occurrences of the sequence's last few tokens.
* ``draft_model.py``: ``DraftModelDrafter``, a small draft model's greedy drafts.
* ``medusa.py``: ``MedusaDrafter``, Medusa heads on the target's final hidden state.
* ``eagle.py``: ``EagleDrafter``, an EAGLE head (one layer with its own paged KV) on the
  target's hidden states; ``eagle_heads.py`` reads the published layouts.
* ``head_nets.py``: both kinds of head as trainable modules under their published names.
* ``adaptive.py``: ``AdaptiveDraftLength``, the draft length that gives the most tokens a second.
"""

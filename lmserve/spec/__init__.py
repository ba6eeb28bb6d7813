"""Speculative decoding: drafters propose tokens, the target model verifies them in one step.

* ``speculator.py``: ``Speculator``, what the engine calls: draft slots per sequence
  (``lookahead``), the drafts of a scheduled batch (``propose``) and the counters behind the
  ``spec_decode_*`` metrics (``record``).
* ``tree.py``: ``DraftTree``, a step's drafts for one sequence (a chain, or a tree when
  ``spec_tree_width`` > 1), and how the target's samples accept a path of it.
* ``ngram.py``: ``NgramDrafter``, prompt lookup: the tokens that followed the latest earlier
  occurrences of the sequence's last few tokens.
* ``draft_model.py``: ``DraftModelDrafter``, a small draft model's greedy drafts.
* ``adaptive.py``: ``AdaptiveDraftLength``, the draft length that gives the most tokens a second.
"""

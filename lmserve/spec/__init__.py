"""Speculative decoding: drafters propose tokens, the target model verifies them in one step.

* ``speculator.py``: ``Speculator``, what the engine calls: draft slots per sequence
  (``lookahead``), the drafts of a scheduled batch (``propose``), the acceptance of the target's
  tokens (``accept``) and the counters behind the ``spec_decode_*`` metrics.
* ``ngram.py``: ``NgramDrafter``, prompt lookup: the tokens that followed the latest earlier
  occurrence of the sequence's last few tokens.
"""

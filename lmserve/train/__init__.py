"""``lmserve train-heads``: speculative-decoding heads trained on a CPU from a model's own answers.

* ``prompts.py``: the built-in varied prompt set, and reading a user's file of prompts.
* ``data.py``: the model's answers (batched by the engine) and its hidden states along them.
* ``fit.py``: training Medusa heads and an EAGLE-1 head (regression plus cross-entropy).
* ``command.py``: the command: generate, record, train, write the published layouts, measure.
"""

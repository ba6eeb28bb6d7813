"""Attention backends; importing the package registers the built-in ones."""

from lmserve.attention import torch_native  # noqa: F401  (registers "torch_native")

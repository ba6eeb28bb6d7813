"""Model libraries: a model compiled ahead of time (``lmserve compile``) and served with
``EngineConfig(model_lib=DIR)``; see ``library.py`` and docs/model_library.md."""

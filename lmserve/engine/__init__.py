"""The engine: its thread (``loop``) running ``EngineCore.step`` (``core``: schedule, start,
verify, append, update), and the Python API over it (``engine``, ``async_engine``)."""

"""OpenAI's chat and text completion APIs: request and response schemas (``protocol``), the
``create`` facades (``facades``) and the builders that shape engine outputs (``builders``)."""

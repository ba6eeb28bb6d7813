"""What speaks to clients: the OpenAI API's schemas and facades (``openai/``), tool calling
(``tools/``), the HTTP server (``server/``) and the terminal chat. Each API surface is a
sibling package over the engine's token-level ``generate``."""

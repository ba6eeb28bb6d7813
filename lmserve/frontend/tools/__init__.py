"""Tool calling: ``formats`` (each model family's call syntax, its parser and the grammar forcing
it), ``parser`` (calls read from a streamed answer) and ``prompt`` (tools and call history put
into the prompt, by the model's chat template or by lmserve when the template has no tools)."""

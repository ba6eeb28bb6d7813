"""``lmserve bench``: a serving benchmark client for any OpenAI-compatible server.

* ``datasets``: synthetic prompts (random, shared-prefix) of exact token lengths.
* ``tokenizers``: the tokenizer prompts are built with (the server's /tokenize, or local).
* ``client``: the load generator (Poisson arrivals, bounded concurrency, streamed requests).
* ``metrics``: per-request results -> TTFT / TPOT / ITL / E2EL statistics and throughputs.
* ``report``: vLLM's result table and JSON keys, latency histograms.
* ``cli``: the command line.
"""

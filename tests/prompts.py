"""Prompts shared by the model-level tests: varied, and one over 1000 tokens."""

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
    "List three prime numbers greater than 50.",
    "Translate 'good morning, my friend' into Spanish.",
    "def fibonacci(n):\n    # complete this Python function",
    "Tell me a very short story about a robot who learns to paint.",
]

_PARAGRAPH = (
    "The history of the lighthouse at Cape Verity begins in 1823, when a storm wrecked three "
    "merchant ships on the reef within a single night. The keepers who followed kept logs of "
    "every passing vessel, the weather at each watch, and the price of whale oil, which rose "
    "and fell with the seasons. "
)


def long_prompt() -> str:
    """About 1300 tokens: a repeated record with numbered entries, then a question."""
    entries = [f"Entry {i}: {_PARAGRAPH}" for i in range(22)]
    return "\n".join(entries) + "\nSummarise the record above in one sentence."

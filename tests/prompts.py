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

# Requests for small JSON answers: structured output is checked over all of them.
JSON_PROMPTS = [
    "Give the name and age of a person as a JSON object.",
    "Describe a cat as JSON.",
    "Return a JSON object describing the weather in Paris.",
    "Make up a book with a title and an author, as JSON.",
    "Describe your favourite meal as a JSON object.",
    "Give me a city and its country in JSON.",
    "Create a JSON object for a car with make, model and year.",
    "Describe a planet of the solar system as JSON.",
    "Invent a user profile in JSON.",
    "Return the colour of the sky as a JSON object.",
    "Describe a recipe for pancakes as JSON.",
    "Give a movie and its release year as JSON.",
    "Describe a dog called Rex as a JSON object.",
    "Make a JSON object for a flight from London to Rome.",
    "Describe a tree in JSON.",
    "Give me a JSON object with a greeting.",
    "Describe a small shop as JSON.",
    "Make up a song with a title and an artist, as JSON.",
    "Describe the ocean as a JSON object.",
    "Give a product with a name and a price as JSON.",
]

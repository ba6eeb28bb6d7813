"""The prompts ``lmserve train-heads`` asks the model to answer when the user gives none.

Heads learn what the model says, so the prompts should draw out the kinds of answer users ask
for: explanations, how-tos, lists, stories and poems, code, arithmetic, comparisons, rewriting,
advice, summaries. Each kind is a template filled with its own subjects, so the set is varied
without being long to ship; ``builtin_prompts`` interleaves the kinds, so any prefix of it
(a short training run) covers them all.
"""

from __future__ import annotations

import json
import random

_KINDS: list[tuple[list[str], list[str]]] = [
    (["Explain {} to a curious twelve-year-old.", "What is {} and why does it matter?",
      "Give a short, clear explanation of {}."],
     ["photosynthesis", "gravity", "inflation", "the water cycle", "vaccines", "black holes",
      "compound interest", "plate tectonics", "the immune system", "machine learning",
      "supply and demand", "electric circuits", "DNA", "climate change", "the internet",
      "encryption", "evolution", "the French Revolution", "democracy", "volcanoes"]),
    (["How do I {}? Give step-by-step instructions.", "What is the best way to {}?",
      "Give me three practical tips to {}."],
     ["bake bread at home", "learn a new language", "start running", "save money each month",
      "write a good resume", "grow tomatoes", "fix a flat bicycle tire", "sleep better",
      "prepare for a job interview", "organize a small kitchen", "make a cup of tea",
      "change a light bulb safely", "study for an exam", "plan a road trip",
      "keep a houseplant alive", "give a short speech", "cook rice", "clean a laptop keyboard"]),
    (["Write a short poem about {}.", "Write a four-line rhyme about {}.",
      "Tell a very short story about {}."],
     ["the ocean at night", "a lost cat finding its way home", "autumn leaves", "a robot learning "
      "to paint", "the first day of school", "a lighthouse keeper", "rain on a tin roof",
      "a dragon who is afraid of fire", "friendship", "a city waking up", "the moon", "an old map",
      "a garden in spring", "a train journey"]),
    (["Write a Python function that {}.", "Show how to {} in Python, with a short explanation.",
      "Write a JavaScript function that {}."],
     ["reverses a string", "checks whether a number is prime", "counts the words in a sentence",
      "returns the largest item of a list", "computes the factorial of n", "sorts a list of "
      "names alphabetically", "reads a text file line by line", "removes duplicates from a list",
      "converts Celsius to Fahrenheit", "finds the average of a list of numbers",
      "checks whether a word is a palindrome", "merges two dictionaries", "computes Fibonacci "
      "numbers", "validates an email address"]),
    (["What is {}? Show your working.", "Solve this step by step: {}."],
     ["17 times 23", "15% of 240", "the sum of the numbers from 1 to 50", "144 divided by 12 plus 7",
      "the area of a circle with radius 3", "the average of 4, 8, 15 and 21",
      "how many minutes are in three days", "2 to the power of 10", "the perimeter of a 5 by 8 "
      "rectangle", "the price after a 20% discount on 85 dollars", "half of 3.5 plus a quarter "
      "of 10", "how many seconds are in an hour"]),
    (["Compare {} in a few sentences.", "What are the main differences between {}?",
      "List the pros and cons of {}."],
     ["cats and dogs as pets", "trains and planes for travel", "tea and coffee", "renting and "
      "buying a home", "Python and JavaScript", "summer and winter", "books and films",
      "working from home and working in an office", "solar and wind power", "cities and "
      "the countryside", "paper notes and note-taking apps", "running and swimming"]),
    (["Rewrite this sentence to sound more formal: \"{}\"", "Fix the grammar in this "
      "sentence: \"{}\"", "Translate into simple English: \"{}\""],
     ["hey, can u send me the report asap", "me and him goes to the store yesterday",
      "the meeting got moved cuz the boss is sick", "i dont know where is the keys",
      "this product is super cool and works real good", "we was late because of the traffic",
      "pls let me know if theres any problems", "she dont like when people is loud"]),
    (["I feel {}. What could I do?", "My friend says they feel {}. How can I help them?"],
     ["stressed about work", "bored on weekends", "nervous before exams", "lonely after moving "
      "to a new city", "tired every afternoon", "overwhelmed by my to-do list",
      "unmotivated to exercise", "worried about money"]),
    (["Summarize in two sentences: {}", "What is the main idea of this text? {}"],
     ["The honeybee is a social insect that lives in colonies. Each colony has a queen, "
      "workers and drones, and the workers collect nectar and pollen to feed the hive.",
      "Regular exercise improves mood, strengthens the heart and helps people sleep. Experts "
      "recommend at least thirty minutes of moderate activity on most days.",
      "The printing press, invented in the fifteenth century, made books cheaper and spread "
      "ideas quickly across Europe, changing religion, science and politics.",
      "Coral reefs cover a tiny part of the ocean floor but shelter a quarter of all marine "
      "species. Warming seas cause bleaching, which can kill the corals.",
      "Many cities are adding bike lanes and pedestrian streets. Supporters say this cuts "
      "pollution and traffic, while critics worry about deliveries and parking."]),
    (["Give me a list of {}.", "Name five {} and say one thing about each."],
     ["healthy breakfast ideas", "famous scientists", "board games for families", "countries "
      "in South America", "ways to reduce plastic waste", "classic novels", "indoor hobbies",
      "programming languages", "birds that cannot fly", "tips for a long flight"]),
]


def builtin_prompts() -> list[str]:
    """Every template with every subject of its kind, the kinds interleaved in a fixed
    shuffled order (the same on every run)."""
    per_kind = []
    for templates, subjects in _KINDS:
        prompts = [t.format(s) for t in templates for s in subjects]
        random.Random(len(prompts)).shuffle(prompts)
        per_kind.append(prompts)
    out: list[str] = []
    for i in range(max(len(p) for p in per_kind)):
        out.extend(p[i] for p in per_kind if i < len(p))
    return out


def read_prompts(path: str) -> list[str]:
    """The prompts in a user's file: one per line, or a JSON Lines file whose lines are
    strings or objects with a ``prompt`` field (blank lines skipped)."""
    prompts = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            if path.endswith(".jsonl"):
                item = json.loads(line)
                if isinstance(item, dict):
                    item = item.get("prompt")
                if not isinstance(item, str):
                    raise ValueError(f"{path}:{number}: expected a string or an object with a "
                                     f"'prompt' string")
                line = item
            prompts.append(line)
    if not prompts:
        raise ValueError(f"{path} has no prompts")
    return prompts

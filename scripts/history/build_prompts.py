"""Build the prompt set behind tdpipe's recorded output-length history (issue 5; TD-Pipe §3.3 needs one).

No ShareGPT is reachable offline, so the prompts come from two sources that install from PyPI:
  * chatterbot-corpus (BSD-3): the English conversations. A conversation's first user line is a prompt; its
    bot replies serve as text to rewrite, summarise or continue; two-turn dialogues become chat prompts.
  * templates over fixed topic lists (below): short answers, lists, stories, poems, code, explanations,
    comparisons, rewrites, translations, letters.
Deterministic (seed 0). Writes JSONL: {"id", "category", "messages": [{"role", "content"}, ...]}.

    pip install chatterbot-corpus==1.3.3 pyyaml --no-deps
    python scripts/history/build_prompts.py -o data/history/prompts.jsonl
"""
from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import os
import random

import yaml

COUNTRIES = ["France", "Japan", "Brazil", "Kenya", "Canada", "India", "Norway", "Egypt", "Mexico", "Australia",
             "Germany", "Peru", "Vietnam", "Italy", "Chile", "Spain", "Turkey", "Ghana", "Poland", "Thailand"]
CONCEPTS = ["photosynthesis", "inflation", "gravity", "machine learning", "the water cycle", "democracy",
            "black holes", "vaccines", "blockchain", "evolution", "compound interest", "climate change",
            "the internet", "supply and demand", "DNA", "electricity", "recursion", "the stock market",
            "plate tectonics", "the immune system", "quantum computing", "a hash table", "entropy",
            "the French Revolution", "jet engines", "operating systems", "antibiotics", "the moon's phases",
            "renewable energy", "neural networks", "the Pythagorean theorem", "public key cryptography"]
AUDIENCES = ["a five-year-old", "a high school student", "a software engineer", "my grandmother", "an expert"]
THINGS = ["fruits", "programming languages", "board games", "famous scientists", "ways to save money",
          "healthy breakfast ideas", "European capitals", "hobbies to try", "books for beginners",
          "interview questions", "birds", "musical instruments", "habits of productive people",
          "sorting algorithms", "things to pack for a trip", "uses for a paperclip", "names for a cat"]
ACTIVITIES = ["learning a language", "running a marathon", "sleeping better", "cooking rice", "studying",
              "public speaking", "gardening", "writing a resume", "saving energy at home", "debugging code"]
CHARACTERS = ["a lonely robot", "a brave knight", "a curious cat", "an old lighthouse keeper", "a young wizard",
              "a detective", "a talking tree", "two friends", "a pirate captain", "an astronaut"]
EVENTS = ["finds a secret door", "loses their memory", "meets a dragon", "wins a contest", "travels in time",
          "learns to fly", "gets lost in a city", "discovers a new planet", "opens a bakery", "solves a mystery"]
TASKS = ["reverses a string", "checks whether a number is prime", "computes the factorial of n",
         "merges two sorted lists", "counts the words in a text", "finds the largest element of a list",
         "converts Celsius to Fahrenheit", "removes duplicates from a list", "checks for a palindrome",
         "computes Fibonacci numbers", "parses a CSV line", "sorts a dictionary by value",
         "implements binary search", "flattens a nested list", "validates an email address"]
LANGS = ["Python", "JavaScript", "C", "Java", "Rust", "Go", "SQL", "Bash"]
PAIRS = [("cats", "dogs"), ("Python", "Java"), ("tea", "coffee"), ("summer", "winter"), ("trains", "planes"),
         ("books", "movies"), ("TCP", "UDP"), ("renting", "buying a home"), ("iOS", "Android"),
         ("stocks", "bonds"), ("RAM", "storage"), ("mitosis", "meiosis")]
TOPICS = ["the ocean", "autumn", "friendship", "the city at night", "a rainy day", "coffee", "mountains",
          "the stars", "time", "home", "music", "a garden"]
LENGTH_HINTS = ["", "", "", " Keep it short.", " Answer in one sentence.", " Be detailed.",
                " Use at least three paragraphs.", " Answer in a few words."]


def templated(rng: random.Random, n: int) -> list[tuple[str, str]]:
    makers = [
        ("short", lambda: f"What is the capital of {rng.choice(COUNTRIES)}?"),
        ("short", lambda: f"In one sentence, what is {rng.choice(CONCEPTS)}?"),
        ("short", lambda: f"What is {rng.randint(2, 99)} times {rng.randint(2, 99)}?"),
        ("list", lambda: f"List {rng.randint(3, 12)} {rng.choice(THINGS)}."),
        ("list", lambda: f"Give me {rng.randint(3, 10)} tips for {rng.choice(ACTIVITIES)}."),
        ("story", lambda: f"Write a short story about {rng.choice(CHARACTERS)} who {rng.choice(EVENTS)}."),
        ("story", lambda: f"Write a poem about {rng.choice(TOPICS)}."),
        ("story", lambda: f"Write a long story about {rng.choice(CHARACTERS)} who {rng.choice(EVENTS)}."),
        ("code", lambda: f"Write a {rng.choice(LANGS)} function that {rng.choice(TASKS)}."),
        ("code", lambda: f"How do I write a program that {rng.choice(TASKS)}? Explain the code."),
        ("explain", lambda: f"Explain {rng.choice(CONCEPTS)} to {rng.choice(AUDIENCES)}."),
        ("explain", lambda: f"How does {rng.choice(CONCEPTS)} work?"),
        ("compare", lambda: "Compare {} and {}.".format(*rng.choice(PAIRS))),
        ("letter", lambda: f"Write an email to my manager asking for a day off for {rng.choice(ACTIVITIES)}."),
    ]
    out = []
    for _ in range(n):
        cat, make = rng.choice(makers)
        out.append((cat, make() + rng.choice(LENGTH_HINTS)))
    return out


def corpus_dir() -> str:
    spec = importlib.util.find_spec("chatterbot_corpus")
    if spec is None:
        raise SystemExit("chatterbot-corpus is not installed: pip install chatterbot-corpus==1.3.3 --no-deps")
    return os.path.join(spec.submodule_search_locations[0], "data", "english")


def corpus(rng: random.Random) -> list[tuple[str, list[dict]]]:
    convs = []
    for path in sorted(glob.glob(os.path.join(corpus_dir(), "*.yml"))):
        with open(path) as f:
            convs += [c for c in yaml.safe_load(f)["conversations"] if c and all(isinstance(t, str) for t in c)]
    seen, out = set(), []
    replies = [t.strip() for c in convs for t in c[1:] if len(t.split()) >= 6]
    for c in convs:
        first = c[0].strip()
        if first.lower() not in seen:
            seen.add(first.lower())
            out.append(("chat", [{"role": "user", "content": first}]))
        if len(c) >= 3 and rng.random() < 0.5:  # a two-turn dialogue: the corpus's reply is the assistant turn
            out.append(("dialogue", [{"role": "user", "content": c[0].strip()},
                                     {"role": "assistant", "content": c[1].strip()},
                                     {"role": "user", "content": c[2].strip()}]))
    rewrites = ["Rewrite this in a formal tone:", "Summarize in one sentence:", "Translate into French:",
                "Fix the grammar and spelling:", "Continue this text:", "Turn this into a bulleted list:",
                "Explain what this means:", "Make this funnier:"]
    for text in rng.sample(replies, min(len(replies), 500)):
        out.append(("rewrite", [{"role": "user", "content": f"{rng.choice(rewrites)}\n\n{text}"}]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-o", "--output", default="data/history/prompts.jsonl")
    ap.add_argument("--templated", type=int, default=1000, help="prompts made from the templates")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    rng = random.Random(a.seed)
    items = corpus(rng) + [(c, [{"role": "user", "content": p}]) for c, p in templated(rng, a.templated)]
    rng.shuffle(items)
    os.makedirs(os.path.dirname(a.output) or ".", exist_ok=True)
    with open(a.output, "w") as f:
        for i, (cat, msgs) in enumerate(items):
            f.write(json.dumps({"id": i, "category": cat, "messages": msgs}) + "\n")
    cats: dict[str, int] = {}
    for c, _ in items:
        cats[c] = cats.get(c, 0) + 1
    print(f"{len(items)} prompts -> {a.output}: {cats}")


if __name__ == "__main__":
    main()

"""The speculative-decoding benchmark's two workloads, as chat prompts.

- copy-heavy: edit, summarize or refactor a text or code given in the prompt, where much of
  the answer repeats the prompt (prompt lookup's best case);
- open chat: short open questions, where the answer repeats little (its worst case).
"""

from __future__ import annotations

CODE = """def load_users(path):
    users = []
    with open(path) as f:
        for line in f:
            name, email, age = line.strip().split(",")
            users.append({"name": name, "email": email, "age": int(age)})
    return users


def adults(users):
    result = []
    for user in users:
        if user["age"] >= 18:
            result.append(user)
    return result
"""

TEXT = (
    "Paged attention stores the keys and values of every sequence in fixed-size blocks. "
    "A block table maps each sequence's logical blocks to physical blocks in a shared pool, "
    "so memory is allocated on demand and freed as soon as a request finishes. Blocks that "
    "hold the same prefix can be shared between requests, which is called prefix caching. "
    "Continuous batching adds new requests to the running batch at every step instead of "
    "waiting for the whole batch to finish, which keeps the accelerator busy."
)

COPY_HEAVY = [
    f"Add type hints to this Python code and return the whole code:\n\n{CODE}",
    f"Rename the function `adults` to `filter_adults` in this code; return all of it:\n\n{CODE}",
    f"Fix the grammar of this text and return it in full:\n\n{TEXT}",
    f"Repeat this paragraph, replacing 'blocks' with 'pages':\n\n{TEXT}",
    f"Rewrite this code to use a list comprehension in `adults`; show the full code:\n\n{CODE}",
    f"Summarize this text in three sentences, reusing its wording:\n\n{TEXT}",
    f"Add a docstring to each function and return the code:\n\n{CODE}",
    f"Copy this text exactly, then add one sentence about speculative decoding:\n\n{TEXT}",
]

OPEN_CHAT = [
    "What is a good name for a bakery in a small mountain town?",
    "Give me three ideas for a rainy weekend.",
    "Why is the sky blue? Answer briefly.",
    "Write a haiku about autumn leaves.",
    "What should I pack for a two-day hike?",
    "Explain what a neural network is to a ten-year-old.",
    "Suggest a dinner recipe with lentils and spinach.",
    "How do I politely decline a meeting invitation?",
]

WORKLOADS = {"copy": COPY_HEAVY, "chat": OPEN_CHAT}


def prompts(workload: str, count: int) -> list[list[dict[str, str]]]:
    """`count` conversations of the workload (its prompts repeated in order)."""
    base = WORKLOADS[workload]
    return [[{"role": "user", "content": base[i % len(base)]}] for i in range(count)]

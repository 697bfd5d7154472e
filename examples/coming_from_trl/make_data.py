"""Writes data.jsonl: 64 additions as chat messages with an `answer` column (TRL's conversational format)."""

import json
import random

rng = random.Random(0)
with open("data.jsonl", "w") as f:
    for _ in range(64):
        a, b = rng.randint(0, 50), rng.randint(0, 50)
        row = {"prompt": [{"role": "user", "content": f"What is {a} + {b}? Reply with the number."}],
               "answer": str(a + b)}
        f.write(json.dumps(row) + "\n")

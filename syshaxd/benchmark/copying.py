"""Chat requests whose answers copy from their prompt: where speculative decoding's prompt lookup pays
(bench/bench_speculation.py measures it, tests/plugins/test_speculation.py checks that a guess changes none of their texts).
A few short paragraphs and code files, each request built around one of them."""

from __future__ import annotations

PARAGRAPHS = [
    "The lighthouse stood on the northern cliff for two hundred years. Its keeper, an old sailor named Tom, climbed "
    "the ninety-nine steps every evening to light the lamp. Ships passing in the night saw its beam and steered clear "
    "of the rocks below. One winter a storm broke the great lens, and Tom had to keep a fire burning on the gallery "
    "until the new lens arrived from the city in spring.",
    "Bread needs only four things: flour, water, salt and yeast. Mix them into a dough, knead it for ten minutes "
    "until it is smooth, and leave it covered in a warm place for an hour. When it has doubled in size, shape it into "
    "a loaf, let it rise again, and bake it in a hot oven for thirty-five minutes until the crust is brown.",
    "The committee met on Tuesday to discuss the new library. The architect presented three designs: a glass tower, "
    "a low brick building around a garden, and a wooden hall with a reading room under the roof. After a long debate "
    "the committee chose the brick building, because it was the cheapest to heat and the easiest to extend later.",
    "Photosynthesis takes place in the chloroplasts of plant cells. Light energy splits water into oxygen, protons "
    "and electrons; the electrons pass along a chain of proteins that pumps protons across a membrane, and the "
    "resulting gradient drives the synthesis of ATP, which the Calvin cycle then uses to fix carbon dioxide.",
]
CODES = [
    "def mean(xs):\n    total = 0\n    for x in xs:\n        total += x\n    return total / len(x)\n\n"
    "def variance(xs):\n    m = mean(xs)\n    return sum((x - m) ** 2 for x in xs) / len(xs)\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"
    "        self.items.append(item)\n\n    def pop(self):\n        return self.items.pop(0)\n\n"
    "    def is_empty(self):\n        return len(self.items) == 0\n",
    "def fizzbuzz(n):\n    for i in range(1, n):\n        if i % 15 == 0:\n            print('FizzBuzz')\n"
    "        elif i % 3 == 0:\n            print('Fizz')\n        elif i % 5 == 0:\n            print('Buzz')\n"
    "        else:\n            print(i)\n",
]


def copy_chats(round_index: int = 0) -> list[list[dict]]:
    """8 chats whose answers copy from their prompt: repeat, quote, fix code and give it whole, summarise quoting,
    document code, simplify a text in order, rename a variable, copy and add; other pieces each round."""
    p = [PARAGRAPHS[(round_index + k) % len(PARAGRAPHS)] for k in range(4)]
    c = [CODES[(round_index + k) % len(CODES)] for k in range(3)]
    asks = [
        f"Repeat the following text exactly, word for word:\n\n{p[0]}",
        f"Here is a text:\n\n{p[1]}\n\nQuote its first three sentences.",
        f"Fix the bug in this code and give the whole corrected code:\n\n{c[0]}",
        f"Summarise this text in two sentences, quoting it where you can:\n\n{p[2]}",
        f"Add a docstring to every function of this code and give the whole code back:\n\n{c[1]}",
        f"Translate this text into simpler English, keeping its sentences in order:\n\n{p[3]}",
        f"Rename the variable i to number in this code and give the whole code:\n\n{c[2]}",
        f"Copy this text, then add one sentence at its end:\n\n{p[0]}",
    ]
    return [[{"role": "user", "content": a}] for a in asks]

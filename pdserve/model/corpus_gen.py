"""Generator of the plain-text corpus under corpus/ that make-model trains tokenizers on.

The text is synthetic English-like prose, dialogue, recipes, code and tables, written by this
module from a fixed seed (no downloads, no third-party text). The generated files are committed;
re-run `python -m pdserve.model.corpus_gen` only to change them.
"""

from __future__ import annotations

import random
from pathlib import Path

CORPUS_DIR = Path(__file__).with_name("corpus")

NOUNS = """river mountain city garden window letter station harbor engine market forest valley bridge
lantern kitchen library village island castle meadow orchard factory theatre journey morning evening
winter summer autumn spring season country road path wall door table chair clock candle book page
story song voice friend brother sister mother father teacher student doctor farmer sailor soldier
merchant painter writer king queen child stranger neighbour captain miller baker smith weaver
horse dog cat bird fish wolf fox bear deer sheep goat cow hen owl crow raven eagle sparrow
stone iron silver gold copper glass paper cloth wool bread cheese apple pear plum cherry grape
water fire wind rain snow cloud storm thunder light shadow sun moon star sky sea shore wave
question answer reason promise secret memory dream idea plan rule law price cost trade coin
ship boat wagon cart wheel hammer needle rope basket barrel bottle cup plate spoon knife
hill field farm barn fence gate tower church school hall court prison palace cottage cabin
hour minute week month year century number measure weight distance speed height depth
machine signal wire lamp motor pump valve gear lever spring piston boiler furnace chimney
message network server client request response buffer packet socket thread process kernel
memory cache block layer token model vector matrix tensor gradient weight bias kernel""".split()

VERBS = """walk run carry bring build break open close watch follow find lose keep hold write read
sing speak listen answer ask tell show teach learn remember forget begin finish wait hurry climb
cross sail ride pull push lift drop throw catch cut paint mend sew bake cook boil pour fill empty
count measure weigh sell buy trade pay borrow lend send receive gather scatter plant harvest
burn freeze melt shine fade grow shrink wander travel return arrive leave enter search discover
explain describe compare choose decide refuse allow forbid guard protect serve obey command
compute store load copy move split merge sort filter parse encode decode compress verify""".split()

ADJECTIVES = """old young small large tall short long narrow wide deep shallow quiet loud bright dark
warm cold soft hard smooth rough heavy light quick slow early late rich poor kind cruel brave
proud humble clever foolish gentle fierce honest strange familiar distant near empty full
green blue red yellow white black grey golden silver wooden broken hidden open secret ancient
modern simple careful patient sudden steady silent restless weary eager curious faithful""".split()

ADVERBS = "slowly quickly quietly carefully suddenly gently often rarely always never soon again".split()
PLACES = "north south east west upstream downstream inland abroad uphill downhill".split()
SYLLABLES = """ba be bi bo bu da de di do du ka ke ki ko ku la le li lo lu ma me mi mo mu na ne ni no nu
ra re ri ro ru sa se si so su ta te ti to tu va ve vi vo vu za zo an en in on ar er or el al
th sh ch st br gr tr dr fl pl cl kr""".split()


def _name(rng: random.Random) -> str:
    return "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(2, 4))).capitalize()


def _sentence(rng: random.Random, names: list[str]) -> str:
    subject = rng.choice([f"the {rng.choice(ADJECTIVES)} {rng.choice(NOUNS)}", rng.choice(names),
                          f"a {rng.choice(NOUNS)}", f"{rng.choice(names)} the {rng.choice(NOUNS)}"])
    verb = rng.choice(VERBS)
    verb = verb + ("ed" if not verb.endswith("e") else "d") if rng.random() < 0.5 else verb + "s"
    obj = f"the {rng.choice(NOUNS)}"
    tail = rng.choice(["", f" {rng.choice(ADVERBS)}", f" near the {rng.choice(NOUNS)}",
                       f" and went {rng.choice(PLACES)}", f" before the {rng.choice(ADJECTIVES)} {rng.choice(NOUNS)}",
                       f" because {rng.choice(names)} said so", f" in {rng.randint(2, 1999)}"])
    text = f"{subject} {verb} {obj}{tail}"
    return text[0].upper() + text[1:] + rng.choice([".", ".", ".", "!", "?", ";"])


def prose(rng: random.Random, size: int, names: list[str]) -> str:
    out: list[str] = []
    while sum(map(len, out)) < size:
        title = f"Chapter {len(out) + 1}: The {rng.choice(ADJECTIVES).title()} {rng.choice(NOUNS).title()}"
        paragraphs = [" ".join(_sentence(rng, names) for _ in range(rng.randint(3, 9)))
                      for _ in range(rng.randint(3, 7))]
        out.append(title + "\n\n" + "\n\n".join(paragraphs) + "\n\n")
    return "".join(out)


def dialogue(rng: random.Random, size: int, names: list[str]) -> str:
    out: list[str] = []
    while sum(map(len, out)) < size:
        a, b = rng.sample(names, 2)
        lines = []
        for _ in range(rng.randint(4, 10)):
            speaker = rng.choice([a, b])
            kind = rng.random()
            if kind < 0.3:
                line = f"Where is the {rng.choice(NOUNS)}, {rng.choice([a, b])}?"
            elif kind < 0.6:
                line = f"I {rng.choice(VERBS)} it {rng.choice(ADVERBS)}, as you asked."
            else:
                line = _sentence(rng, names)
            lines.append(f'{speaker}: "{line}"')
        out.append("\n".join(lines) + "\n\n")
    return "".join(out)


def recipes(rng: random.Random, size: int, names: list[str]) -> str:
    out: list[str] = []
    while sum(map(len, out)) < size:
        dish = f"{rng.choice(names)}'s {rng.choice(ADJECTIVES)} {rng.choice(NOUNS)} pie"
        items = [f"- {rng.randint(1, 12)} {rng.choice(['cups', 'grams', 'spoons', 'pieces'])} of {rng.choice(NOUNS)}"
                 for _ in range(rng.randint(3, 7))]
        steps = [f"{i + 1}. {rng.choice(VERBS).capitalize()} the {rng.choice(NOUNS)} for {rng.randint(2, 90)} minutes."
                 for i in range(rng.randint(3, 6))]
        out.append(f"Recipe: {dish}\nIngredients:\n" + "\n".join(items) + "\nSteps:\n" + "\n".join(steps) + "\n\n")
    return "".join(out)


def code(rng: random.Random, size: int) -> str:
    out: list[str] = []
    while sum(map(len, out)) < size:
        fn = f"{rng.choice(VERBS)}_{rng.choice(NOUNS)}"
        args = ", ".join(rng.sample(NOUNS, rng.randint(1, 3)))
        first = args.split(", ")[0]
        body = [f"    {rng.choice(NOUNS)} = {first} * {rng.randint(2, 64)} + {rng.randint(0, 9)}",
                f"    if {first} > {rng.randint(0, 100)}:",
                f"        return {rng.choice(VERBS)}_{rng.choice(NOUNS)}({first})",
                f"    for i in range({rng.randint(2, 32)}):",
                f"        {first} += i  # {rng.choice(ADVERBS)} {rng.choice(VERBS)}",
                f"    return {first}"]
        out.append(f"def {fn}({args}):\n" + '    """' + _sentence(rng, ["it"]) + '"""\n' + "\n".join(body) + "\n\n\n")
    return "".join(out)


def tables(rng: random.Random, size: int, names: list[str]) -> str:
    out: list[str] = []
    while sum(map(len, out)) < size:
        rows = [f"| {rng.choice(names)} | {rng.choice(NOUNS)} | {rng.randint(0, 99999)} | {rng.uniform(0, 100):.2f} |"
                for _ in range(rng.randint(3, 8))]
        out.append("| name | item | count | share |\n|---|---|---|---|\n" + "\n".join(rows) + "\n\n")
        a, b = rng.randint(1, 999), rng.randint(1, 999)
        out.append(f"{a} + {b} = {a + b}; {a} * {b} = {a * b}; {a} - {b} = {a - b}.\n\n")
    return "".join(out)


def generate(seed: int = 20261130, kib: int = 360) -> dict[str, str]:
    """The corpus files by name; same seed -> same text."""
    rng = random.Random(seed)
    names = sorted({_name(rng) for _ in range(2500)})
    share = kib * 1024 // 6
    return {
        "prose.txt": prose(rng, 2 * share, names),
        "dialogue.txt": dialogue(rng, share, names),
        "recipes.txt": recipes(rng, share, names),
        "code.txt": code(rng, share),
        "tables.txt": tables(rng, share, names),
    }


def main() -> None:
    CORPUS_DIR.mkdir(exist_ok=True)
    for name, text in generate().items():
        (CORPUS_DIR / name).write_text(text, encoding="utf-8")


if __name__ == "__main__":
    main()

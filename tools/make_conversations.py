"""Write data/conversations.jsonl: synthetic multi-turn chats for the embedded default run.

The conversations are composed from topic and sentence templates written for this
project (no outside text). They exist to (1) train the tiny model's BPE tokenizer on
plausible English and code, and (2) give the workflow realistic shapes: system prompts
or not, 1-8 turns, answers from a few tokens to a few thousand tokens.

Deterministic: the same seed writes the same bytes. Run from the repository root:

    python tools/make_conversations.py [--out data/conversations.jsonl] [--n 300] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
from pathlib import Path

# --------------------------------------------------------------------------- topic pools
TOPICS: dict[str, dict[str, list[str]]] = {
    "programming": {
        "subjects": [
            "Python generators", "Rust lifetimes", "SQL joins", "git rebase", "unit testing",
            "async I/O", "hash maps", "binary search", "memory leaks", "regular expressions",
            "REST APIs", "Docker images", "type hints", "recursion", "dependency injection",
            "the borrow checker", "database indexes", "race conditions", "caching", "logging",
        ],
        "facts": [
            "{s} are easier to reason about when each function does one thing",
            "the most common mistake with {s} is assuming the input is always valid",
            "a small example that fails is worth more than a long explanation of {s}",
            "most performance problems with {s} come from doing work twice",
            "{s} behave differently under load than they do on a developer laptop",
            "reading the error message slowly usually points straight at the problem with {s}",
            "the documentation for {s} has a section on edge cases that is worth reading",
            "tests that check exact values catch regressions in {s} early",
            "you can measure the cost of {s} with a profiler before changing anything",
            "naming things clearly matters more for {s} than clever tricks",
        ],
        "asks": [
            "Can you explain {s} to me?", "I keep getting confused by {s}. Where should I start?",
            "What is the best way to debug problems with {s}?", "How do {s} work under the hood?",
            "Could you give me an example that uses {s}?", "Why does my code with {s} run so slowly?",
            "What are common pitfalls with {s}?", "Is it worth learning {s} in depth?",
        ],
    },
    "math": {
        "subjects": [
            "prime numbers", "derivatives", "probability", "matrices", "the Pythagorean theorem",
            "logarithms", "integrals", "fractions", "linear equations", "geometric series",
            "modular arithmetic", "eigenvalues", "permutations", "the normal distribution",
        ],
        "facts": [
            "{s} become clearer once you draw a picture of a small case",
            "every rule about {s} can be checked on a simple example with small numbers",
            "the definition of {s} is short, but the consequences take time to absorb",
            "{s} show up in physics, computer science and finance alike",
            "it helps to write down what you know and what you want before working with {s}",
            "many textbook problems about {s} reduce to one or two standard tricks",
            "mistakes with {s} usually come from a sign error or a forgotten case",
        ],
        "asks": [
            "Can you help me understand {s}?", "My homework is about {s} and I am stuck.",
            "What is the intuition behind {s}?", "How are {s} used in real life?",
            "Could you walk me through a problem involving {s}?",
        ],
    },
    "cooking": {
        "subjects": [
            "sourdough bread", "a tomato sauce", "roast chicken", "vegetable curry", "pancakes",
            "risotto", "a lemon tart", "lentil soup", "stir-fried noodles", "chocolate cookies",
            "fresh pasta", "grilled fish", "a green salad", "banana bread", "onion soup",
        ],
        "facts": [
            "{s} tastes better when the ingredients are at room temperature before you start",
            "salt added early gives {s} a deeper flavour than salt added at the end",
            "the oven temperature matters more for {s} than the exact cooking time",
            "you can prepare most of {s} a day ahead and finish it just before serving",
            "a heavy pan spreads the heat evenly, which helps with {s}",
            "tasting as you go is the simplest way to get {s} right",
            "fresh herbs added at the end make {s} smell wonderful",
            "resting {s} for a few minutes lets the flavours settle",
        ],
        "asks": [
            "How do I make {s}?", "My {s} never turns out right. What am I doing wrong?",
            "Do you have a simple recipe for {s}?", "What can I serve with {s}?",
            "Can I make {s} without an oven?", "How long does {s} keep in the fridge?",
        ],
    },
    "travel": {
        "subjects": [
            "Lisbon", "Kyoto", "the Scottish Highlands", "Patagonia", "Vienna", "Morocco",
            "a road trip across Norway", "Iceland in winter", "the Amalfi coast", "Vancouver",
            "Istanbul", "a rail trip through the Alps", "Mexico City", "New Zealand",
        ],
        "facts": [
            "{s} is busiest in the summer, so spring and autumn are calmer and cheaper",
            "booking accommodation in {s} early gives you far more choice",
            "walking is often the best way to see {s} and to find small restaurants",
            "public transport around {s} is reliable, but check the timetables on holidays",
            "the weather in {s} can change quickly, so pack a light rain jacket",
            "local markets in {s} are a good place to try regional food",
            "a few words of the local language go a long way in {s}",
            "many museums in {s} are free on one day of the month",
        ],
        "asks": [
            "I am planning a trip to {s}. What should I know?", "What is the best time to visit {s}?",
            "Can you suggest a three-day itinerary for {s}?", "Is {s} expensive for travellers?",
            "What should I pack for {s}?", "Is {s} a good destination for a family with children?",
        ],
    },
    "science": {
        "subjects": [
            "photosynthesis", "black holes", "plate tectonics", "the immune system", "entropy",
            "DNA replication", "climate feedback loops", "quantum tunnelling", "volcanoes",
            "the water cycle", "neurons", "superconductors", "ocean currents", "vaccines",
        ],
        "facts": [
            "{s} can be described at several levels, from molecules to whole systems",
            "scientists first measured {s} indirectly, long before they could observe it",
            "the basic idea of {s} fits in one sentence, but the details fill textbooks",
            "experiments on {s} are repeated by independent groups before results are trusted",
            "models of {s} make predictions that can be tested against new data",
            "energy is conserved in {s}, even when it changes form",
            "{s} was misunderstood for a long time because the effects are slow or small",
        ],
        "asks": [
            "How does {s} work?", "Can you explain {s} in simple terms?",
            "Why is {s} important?", "What do we still not know about {s}?",
            "My daughter asked me about {s} and I could not answer. Can you help?",
        ],
    },
    "health": {
        "subjects": [
            "a running routine", "better sleep", "stretching after work", "drinking enough water",
            "strength training", "posture at a desk", "reducing stress", "a balanced breakfast",
        ],
        "facts": [
            "small changes repeated every day matter more for {s} than big plans",
            "it is wise to start {s} slowly and increase the effort over several weeks",
            "keeping a simple log helps you notice progress with {s}",
            "a doctor can give advice on {s} that fits your own health history",
            "rest days are part of {s}, not a break from it",
        ],
        "asks": [
            "How can I get started with {s}?", "I have tried {s} before and gave up. Any tips?",
            "How long until I see results from {s}?",
        ],
    },
    "finance": {
        "subjects": [
            "a monthly budget", "an emergency fund", "index funds", "paying off a credit card",
            "saving for a house", "compound interest", "retirement accounts", "tracking expenses",
        ],
        "facts": [
            "writing down every expense for a month is the first step towards {s}",
            "automating transfers makes {s} much easier to stick with",
            "fees look small but add up over the years, which matters for {s}",
            "{s} works best with a clear goal and a date attached to it",
            "this is general information about {s}, not personal financial advice",
        ],
        "asks": [
            "How should I think about {s}?", "Can you explain {s} like I am new to this?",
            "What mistakes do people make with {s}?",
        ],
    },
    "writing": {
        "subjects": [
            "a cover letter", "a short story", "a wedding speech", "a product description",
            "an email to my landlord", "a poem about autumn", "a project proposal", "meeting notes",
        ],
        "facts": [
            "a strong first sentence decides whether people keep reading {s}",
            "cutting every word that does no work makes {s} clearer",
            "reading {s} out loud reveals awkward sentences quickly",
            "concrete details make {s} more convincing than general claims",
            "it helps to know who will read {s} and what they need from it",
        ],
        "asks": [
            "Can you help me write {s}?", "Could you improve {s} that I drafted?",
            "What makes {s} good?", "I need {s} by tomorrow. Where do I begin?",
        ],
    },
}

# --------------------------------------------------------------------------- story lexicon
# A wider vocabulary for the short stories and anecdotes, so the BPE sees many distinct words.
NOUNS = """
lighthouse harbour village mountain river forest meadow bridge tower castle garden orchard library
market station bakery workshop kitchen cellar attic balcony window doorway staircase corridor
lantern compass notebook pencil violin guitar piano drum trumpet clock mirror ladder basket bucket
umbrella blanket pillow candle kettle teapot saucer spoon knife hammer chisel shovel wheelbarrow
fox badger otter heron sparrow raven owl wolf bear deer rabbit squirrel hedgehog tortoise dolphin
whale octopus jellyfish salmon trout beetle butterfly dragonfly spider ant bee wasp moth snail
farmer baker sailor teacher doctor engineer painter carpenter gardener librarian musician pilot
detective shepherd fisherman blacksmith tailor merchant traveller stranger neighbour grandmother
grandfather cousin nephew niece apprentice inventor astronomer geologist botanist chemist poet
storm thunder lightning rainbow fog mist frost snowflake breeze sunrise sunset twilight midnight
island desert glacier canyon valley cliff cave volcano lagoon swamp prairie plateau peninsula
letter parcel ticket passport map journey voyage expedition adventure festival carnival wedding
secret promise riddle puzzle mystery legend rumour memory dream wish habit lesson mistake surprise
machine engine gear lever pulley spring magnet battery telescope microscope radio satellite rocket
bicycle carriage wagon tram ferry canoe sailboat submarine airship balloon tractor motorcycle
cheese bread honey jam porridge soup stew pie cake biscuit apple pear plum cherry lemon orange
potato carrot cabbage onion garlic pepper mushroom pumpkin cucumber spinach barley wheat rice oats
""".split()
ADJECTIVES = """
ancient quiet curious brave clumsy gentle stubborn cheerful anxious patient restless sleepy
golden silver rusty dusty muddy frozen shiny wooden woven broken crooked hollow narrow enormous
tiny fragile sturdy crowded empty hidden forgotten famous peculiar ordinary mysterious elegant
shabby generous grumpy clever foolish honest polite rude wise careless careful lonely friendly
distant nearby northern southern eastern western coastal rural bustling sleepy windy rainy sunny
foggy chilly humid bitter sweet sour salty spicy fragrant smoky crisp tender fluffy crunchy
""".split()
VERBS = """
discover:discovered repair:repaired paint:painted whisper:whispered wander:wandered
follow:followed borrow:borrowed collect:collected deliver:delivered explore:explored
climb:climbed carry:carried notice:noticed measure:measured polish:polished gather:gathered
question:questioned rescue:rescued remember:remembered imagine:imagined invent:invented
open:opened visit:visited watch:watched bake:baked plant:planted sketch:sketched
study:studied hide:hid build:built find:found write:wrote sing:sang dig:dug sell:sold
catch:caught lose:lost steal:stole bring:brought teach:taught keep:kept leave:left
""".split()
NAMES = """
Amara Bruno Clara Dmitri Elena Farid Greta Hiro Ines Jonas Kofi Lena Mateo Nadia Oskar Priya
Quentin Rosa Sven Tomas Uma Viktor Wren Ximena Yusuf Zara
""".split()
NOUNS += """
accordion acorn alley anchor anthem apron aqueduct archive armchair arrow atlas avalanche avenue
awning backpack bandage banner barn barrel beacon bellows bench berry blizzard blossom boulder
bracelet branch brook buckle bulletin cabin cactus calendar canal candlestick cannon canopy caravan
cathedral cauldron chapel chimney cinnamon citadel cloak clover cobblestone cockpit coin comet
constellation cottage courtyard crane crater crown crystal cupboard curtain cushion dam dandelion
diary dinghy dock dome doorbell dragon drawbridge driftwood dune eclipse elevator embassy emerald
fern ferris fiddle fireplace fjord flag flute fountain fortress fossil furnace gallery gargoyle
gate gazebo geyser glove gondola granary greenhouse guitarist hammock hangar harp hatchet hayloft
helmet hermit hillside hive horizon hourglass hut iceberg inkwell ivy jacket jar jetty jewel jungle
kayak keyhole kiln kite labyrinth lagoon lamppost lantern lattice lawn ledger lens lighthouse lily
locket loom lute mailbox mansion marble marsh mast meadowlark melody mill minaret moat monastery
mosaic moss mural necklace nest nutmeg oak oar oasis observatory orchid organ outpost paddle
pagoda palace parchment pavilion pebble pendulum pier pilgrim pine plank plaza pond porch quarry
quill quilt raft railway rampart reef reservoir ribbon ridge robin rooftop rope ruby saddle
sandcastle sapphire scarecrow scarf scroll seashell shack shelter shipwreck shrine sled sleigh
spire sponge stable statue steeple stove sundial swan sword tapestry tavern temple tent terrace
thimble thistle throne tide timber tinker torch totem trapdoor treasure trellis trolley trunk
tunnel turret valve vase vineyard violet walnut wardrobe waterfall weathervane well whistle
willow windmill wreath yacht yarn zeppelin
""".split()
ADJECTIVES += """
absent-minded agile amber ambitious amused ashamed awkward bashful bewildered blissful blunt
boisterous bright brittle bumpy calm cautious charming chubby cloudy colossal cozy cranky creaky
crimson cunning daring dazzling delicate delightful determined diligent dim dizzy drowsy eager
earnest eerie enchanted energetic faithful fancy fearless fierce flickering flimsy fluttering
forlorn frantic frosty fuzzy gigantic glamorous gleaming gloomy glossy graceful grateful greasy
gritty hasty hazy hearty hopeful humble icy idle immense jagged jolly joyful knobbly lanky lavish
lively lofty lopsided lucky majestic marvellous meek mellow merry mighty misty modest moody
mossy nervous nimble noble noisy obedient odd overgrown pale peaceful plump proud puzzled radiant
ragged rapid rickety roaring robust rugged rustic scarlet scruffy serene shaggy shimmering silent
slender sluggish smoldering snug soggy solemn sparkling speckled splendid spotless squeaky stately
sticky stormy striped sullen swift tattered thoughtful thrifty tidy timid towering tranquil
tremendous trusty twinkling untidy vast velvet vibrant vivid wary weary whimsical wiry witty
wobbly wrinkled zealous
""".split()
VERBS += """
admire:admired balance:balanced bury:buried chase:chased decorate:decorated examine:examined
fold:folded guard:guarded hurry:hurried juggle:juggled knit:knitted launch:launched
mend:mended navigate:navigated organise:organised paddle:paddled recite:recited scatter:scattered
stitch:stitched tumble:tumbled unlock:unlocked varnish:varnished weave:wove yodel:yodelled
""".split()
NAMES += """
Alistair Beatrix Cosima Desmond Esperanza Florian Gwendolyn Horatio Isadora Jasper Katarina
Leopold Marguerite Nikolai Ophelia Percival Rosalind Sebastian Theodora Ulrich Valentina
Wilhelmina Xavier Yolanda Zebedee
""".split()
STORY_FRAMES = [
    "{Name} was a {adj} {noun} who lived near the {adj2} {noun2}.",
    "Every morning {Name} {past} the {noun} and {past2} a {adj} {noun2}.",
    "One {adj} evening, a {noun} {past} something strange by the {noun2}.",
    "Nobody in the {adj} {noun} knew why the {noun2} had been {past}.",
    "\"We should {verb} the {noun} before the {noun2} arrives,\" said {Name}.",
    "The {noun} was {adj}, and the {noun2} smelled {adj2}.",
    "Years later, {Name} still remembered the {adj} {noun} and the {noun2} they {past}.",
    "At last the {adj} {noun} {past} the {noun2}, and everyone laughed.",
    "{Name} decided to {verb} a {noun} made of {noun2}.",
]


def _story(rng: random.Random, n: int) -> str:
    out = []
    for _ in range(n):
        base, past = rng.choice(VERBS).split(":")
        base2, past2 = rng.choice(VERBS).split(":")
        out.append(rng.choice(STORY_FRAMES).format(
            Name=rng.choice(NAMES), adj=rng.choice(ADJECTIVES), adj2=rng.choice(ADJECTIVES),
            noun=rng.choice(NOUNS), noun2=rng.choice(NOUNS), verb=base, past=past, past2=past2))
    return " ".join(out)


SYSTEM_PROMPTS = [
    "You are a helpful assistant.",
    "You are a concise assistant. Answer in as few words as possible.",
    "You are a patient tutor who explains things step by step.",
    "You are Kimi, an AI assistant. Be accurate, friendly and direct.",
    "You are a senior software engineer reviewing code and answering questions.",
    "You are a travel agent who knows many cities well.",
    "You are a cooking instructor. Give practical, kitchen-tested advice.",
    "You answer questions about science for curious teenagers.",
]

OPENERS = [
    "Good question.", "Sure.", "Happy to help.", "Let me explain.", "Here is how I would think about it.",
    "That is a common question.", "Of course.", "Great, let's go through it.",
]
CONNECTORS = [
    "Also, ", "In practice, ", "On top of that, ", "One more thing: ", "Keep in mind that ",
    "For example, ", "As a rule of thumb, ", "It is worth noting that ", "", "", "",
]
CLOSERS = [
    "Let me know if you want more detail on any part.", "I hope this helps!",
    "Feel free to ask a follow-up question.", "Would you like an example?",
    "Tell me how it goes.", "",
]
FOLLOWUPS = [
    "Thanks! Can you say more about that?", "What about {s} specifically?",
    "Could you make it shorter?", "That makes sense. What should I do next?",
    "Why is that?", "Can you give me a concrete example?", "ok", "Thanks, that helps.",
    "Wait, I don't understand the second point.", "Is there anything I should avoid?",
    "How would an expert approach this?", "Can you summarise that in a list?",
]
GREETINGS = [("hi", "Hello! How can I help you today?"), ("Hello", "Hi there. What can I do for you?"),
             ("thanks", "You're welcome."), ("Are you there?", "Yes, I am here."), ("?", "How can I help?")]
SHORT_REPLIES = ["You're welcome!", "Glad it helped.", "Any time.", "Good luck!", "Sure thing."]


def _cap(text: str) -> str:
    return text[:1].upper() + text[1:] if text else text


def _sentence(rng: random.Random, topic: dict[str, list[str]], s: str) -> str:
    return _cap(rng.choice(CONNECTORS) + rng.choice(topic["facts"]).format(s=s)) + "."


def _paragraph(rng: random.Random, topic: dict[str, list[str]], s: str, n: int) -> str:
    # facts drawn without replacement so a paragraph never repeats itself
    facts = rng.sample(topic["facts"], min(n, len(topic["facts"])))
    return " ".join(_cap(rng.choice(CONNECTORS) + f.format(s=s)) + "." for f in facts)


def _python_snippet(rng: random.Random) -> str:
    name = rng.choice(["total", "average", "count_words", "dedupe", "chunked", "clamp", "flatten"])
    var = rng.choice(["items", "values", "rows", "numbers", "words"])
    bodies = {
        "total": f"    result = 0\n    for x in {var}:\n        result += x\n    return result",
        "average": f"    if not {var}:\n        raise ValueError(\"empty input\")\n"
        f"    return sum({var}) / len({var})",
        "count_words": f"    counts = {{}}\n    for w in {var}:\n        counts[w] = counts.get(w, 0) + 1\n"
        "    return counts",
        "dedupe": f"    seen = set()\n    out = []\n    for x in {var}:\n        if x not in seen:\n"
        "            seen.add(x)\n            out.append(x)\n    return out",
        "chunked": f"    size = {rng.randint(2, 64)}\n"
        f"    return [{var}[i:i + size] for i in range(0, len({var}), size)]",
        "clamp": f"    lo, hi = {rng.randint(0, 10)}, {rng.randint(11, 100)}\n"
        f"    return [min(max(x, lo), hi) for x in {var}]",
        "flatten": f"    return [x for sub in {var} for x in sub]",
    }
    return f"```python\ndef {name}({var}):\n{bodies[name]}\n```"


def _math_exchange(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(2, 999), rng.randint(2, 99)
    kind = rng.choice(["mul", "add", "pow", "mod", "mean"])
    if kind == "mul":
        return (f"What is {a} times {b}?",
                f"{a} × {b} = {a * b}. Split it as {a} × {b // 10 * 10} = {a * (b // 10 * 10)} "
                f"plus {a} × {b % 10} = {a * (b % 10)}, and add the two parts.")
    if kind == "add":
        return f"Add {a} and {b} for me.", f"{a} + {b} = {a + b}."
    if kind == "pow":
        e = rng.randint(2, 5)
        return f"What is {b} to the power of {e}?", f"{b}^{e} = {b ** e}."
    if kind == "mod":
        return (f"What is the remainder when {a} is divided by {b}?",
                f"{a} = {b} × {a // b} + {a % b}, so the remainder is {a % b}.")
    xs = [rng.randint(1, 100) for _ in range(rng.randint(3, 7))]
    return (f"What is the mean of {', '.join(map(str, xs))}?",
            f"The sum is {sum(xs)} and there are {len(xs)} numbers, so the mean is "
            f"{sum(xs) / len(xs):.3f}.")


def _long_answer(rng: random.Random, topic: dict[str, list[str]], s: str, sections: int) -> str:
    """A structured answer with headings, lists and paragraphs: the long samples."""
    parts = [f"{rng.choice(OPENERS)} Here is a detailed guide to {s}."]
    for k in range(1, sections + 1):
        heading = _cap(rng.choice(["background", "the basics", "common mistakes", "a worked example", "going further",
                                   "checklist", "details that matter"]))
        parts.append(f"## {k}. {heading}")
        parts.append(_paragraph(rng, topic, s, rng.randint(4, 9)))
        if rng.random() < 0.5:
            parts.append("\n".join(f"- {_sentence(rng, topic, s)}" for _ in range(rng.randint(3, 6))))
        if topic is TOPICS["programming"] and rng.random() < 0.5:
            parts.append(_python_snippet(rng))
    parts.append(rng.choice(CLOSERS))
    return "\n\n".join(p for p in parts if p)


def _answer(rng: random.Random, topic: dict[str, list[str]], s: str) -> str:
    r = rng.random()
    if r < 0.15:
        return _cap(rng.choice(topic["facts"]).format(s=s)) + "."
    parts = [rng.choice(OPENERS), _paragraph(rng, topic, s, rng.randint(2, 6))]
    if rng.random() < 0.25:
        parts.append("A small story to illustrate: " + _story(rng, rng.randint(2, 5)))
    if rng.random() < 0.3:
        parts.append("\n".join(f"{i}. {_sentence(rng, topic, s)}" for i in range(1, rng.randint(3, 6))))
    if topic is TOPICS["programming"] and rng.random() < 0.6:
        parts.append(_python_snippet(rng))
    parts.append(rng.choice(CLOSERS))
    return "\n\n".join(p for p in parts if p)


def make_conversation(rng: random.Random, long: bool) -> dict[str, list[dict[str, str]]]:
    name = rng.choice(sorted(TOPICS))
    topic = TOPICS[name]
    s = rng.choice(topic["subjects"])
    messages: list[dict[str, str]] = []
    if not long and rng.random() < 0.2:  # a short story, one or two rounds
        noun, adj = rng.choice(NOUNS), rng.choice(ADJECTIVES)
        messages.append({"role": "user", "content": f"Write a short story about a {adj} {noun}."})
        messages.append({"role": "assistant", "content": _story(rng, rng.randint(4, 20))})
        if rng.random() < 0.5:
            messages.append({"role": "user",
                             "content": rng.choice(["Make it longer.", "Continue the story.",
                                                    "Now give it a happy ending."])})
            messages.append({"role": "assistant", "content": _story(rng, rng.randint(6, 30))})
        return {"messages": messages}
    if not long and rng.random() < 0.04:  # the shortest samples: a handful of tokens
        user, assistant = rng.choice(GREETINGS)
        return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]}
    if rng.random() < 0.4:
        messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    turns = 1 if long else rng.choice([1, 1, 2, 2, 3, 3, 4, 5, 6, 8])
    for t in range(turns):
        if name == "math" and rng.random() < 0.35:
            user, assistant = _math_exchange(rng)
        elif t == 0:
            user = rng.choice(topic["asks"]).format(s=s)
            assistant = _long_answer(rng, topic, s, rng.randint(10, 28)) if long else _answer(rng, topic, s)
        else:
            follow = rng.choice(FOLLOWUPS)
            if "{s}" in follow:
                s = rng.choice(topic["subjects"])
                follow = follow.format(s=s)
            user = follow
            assistant = rng.choice(SHORT_REPLIES) if follow.startswith("Thanks,") else _answer(rng, topic, s)
        messages.append({"role": "user", "content": user})
        messages.append({"role": "assistant", "content": assistant})
    return {"messages": messages}


def make_conversations(n: int = 300, seed: int = 0, n_long: int = 10) -> list[dict]:
    rng = random.Random(seed)
    long_at = set(rng.sample(range(n), n_long))
    return [make_conversation(rng, i in long_at) for i in range(n)]


def write_jsonl(records: list[dict], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as f:
            for rec in records:
                f.write(json.dumps(rec, ensure_ascii=False) + "\n")
        os.chmod(tmp, 0o644)
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("data/conversations.jsonl"))
    p.add_argument("--n", type=int, default=300)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    write_jsonl(make_conversations(args.n, args.seed), args.out)


if __name__ == "__main__":
    main()

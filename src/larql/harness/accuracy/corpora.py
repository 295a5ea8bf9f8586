"""The prompt corpora, written for this project.

- Parametric: facts a small model knows from its weights; the answer's first token is scored.
- Needles: a made-up fact hidden in a long neutral haystack, asked about at the end.
- Conflict: the context overrides a fact the model knows; does it follow the context?
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FactPrompt:
    prompt: str
    expected: str
    category: str
    source: str = "parametric"  # or "in_context"


@dataclass(frozen=True)
class ConflictPrompt:
    prompt: str
    override: str
    parametric: str
    category: str


PARAMETRIC: tuple[FactPrompt, ...] = tuple(
    FactPrompt(p, e, c)
    for c, p, e in [
        ("capitals", "The capital of France is", "Paris"),
        ("capitals", "The capital of Germany is", "Berlin"),
        ("capitals", "The capital of Italy is", "Rome"),
        ("capitals", "The capital of Spain is", "Madrid"),
        ("capitals", "The capital of Japan is", "Tokyo"),
        ("capitals", "The capital of England is", "London"),
        ("capitals", "The capital of Russia is", "Moscow"),
        ("capitals", "The capital of Canada is", "Ottawa"),
        ("capitals", "The capital of China is", "Beijing"),
        ("capitals", "The capital of Egypt is", "Cairo"),
        ("capitals", "The capital city of Greece is", "Athens"),
        ("capitals", "The capital city of Portugal is", "Lisbon"),
        ("science", "The largest planet in our solar system is", "Jupiter"),
        ("science", "The chemical symbol for gold is", "Au"),
        ("science", "Water is made of hydrogen and", "oxygen"),
        ("science", "The closest star to the Earth is the", "Sun"),
        ("science", "Albert Einstein developed the theory of", "relativity"),
        ("science", "The freezing point of water in degrees Fahrenheit is", "32"),
        ("science", "Plants make food from sunlight through", "photosynthesis"),
        ("science", "The planet known as the Red Planet is", "Mars"),
        ("people", "Romeo and Juliet was written by William", "Shakespeare"),
        ("people", "The first president of the United States was George", "Washington"),
        ("people", "The author of Harry Potter is J.K.", "Rowling"),
        ("people", "The Mona Lisa was painted by Leonardo da", "Vinci"),
        ("people", "The theory of evolution was proposed by Charles", "Darwin"),
        ("geography", "The tallest mountain in the world is Mount", "Everest"),
        ("geography", "The Eiffel Tower is in the city of", "Paris"),
        ("geography", "The longest river in Africa is the", "Nile"),
        ("geography", "The largest ocean on Earth is the", "Pacific"),
        ("geography", "The Statue of Liberty is in New", "York"),
        ("language", "The opposite of hot is", "cold"),
        ("language", "The opposite of up is", "down"),
        ("language", "Monday, Tuesday,", "Wednesday"),
        ("language", "One, two, three, four,", "five"),
        ("language", "January, February, March,", "April"),
        ("language", "A week has seven", "days"),
        ("everyday", "The currency of Japan is the", "yen"),
        ("everyday", "Cows are animals that give us", "milk"),
        ("everyday", "To write on a blackboard you use", "chalk"),
        ("everyday", "Bees make", "honey"),
        # (appended after the first 40, so `--quick`'s pick of every eighth stays the same)
        ("capitals", "The capital of Austria is", "Vienna"),
        ("capitals", "The capital of Ireland is", "Dublin"),
        ("capitals", "The capital of Sweden is", "Stockholm"),
        ("capitals", "The capital of Norway is", "Oslo"),
        ("capitals", "The capital of Poland is", "Warsaw"),
        ("capitals", "The capital of Australia is", "Canberra"),
        ("capitals", "The capital of India is New", "Delhi"),
        ("capitals", "The capital of Kenya is", "Nairobi"),
        ("capitals", "The capital of Argentina is Buenos", "Aires"),
        ("capitals", "The capital of Thailand is", "Bangkok"),
        ("capitals", "The capital of Turkey is", "Ankara"),
        ("capitals", "The capital of South Korea is", "Seoul"),
        ("science", "The chemical symbol for water is", "H"),
        ("science", "The chemical symbol for iron is", "Fe"),
        ("science", "The gas that plants take in from the air is carbon", "dioxide"),
        ("science", "The force that pulls objects towards the Earth is", "gravity"),
        ("science", "The hardest natural substance on Earth is", "diamond"),
        ("science", "The centre of an atom is called the", "nucleus"),
        ("science", "Light travels faster than", "sound"),
        ("science", "The planet closest to the Sun is", "Mercury"),
        ("science", "The boiling point of water in degrees Celsius is", "100"),
        ("science", "The organ that pumps blood through the body is the", "heart"),
        ("science", "The study of living things is called", "biology"),
        ("science", "The natural satellite of the Earth is the", "Moon"),
        ("people", "The first man to walk on the Moon was Neil", "Armstrong"),
        ("people", "The composer of the Moonlight Sonata was Ludwig van", "Beethoven"),
        ("people", "The theory of gravity was described by Isaac", "Newton"),
        ("people", "The telephone was invented by Alexander Graham", "Bell"),
        ("people", "The founder of Microsoft is Bill", "Gates"),
        ("people", "The ship Titanic sank in the year", "1912"),
        ("people", "Pride and Prejudice was written by Jane", "Austen"),
        ("people", "The first woman to win a Nobel Prize was Marie", "Curie"),
        ("people", "The painter of The Starry Night was Vincent van", "Gogh"),
        ("people", "The leader of India's independence movement was Mahatma", "Gandhi"),
        ("geography", "The largest desert in Africa is the", "Sahara"),
        ("geography", "The longest river in South America is the", "Amazon"),
        ("geography", "The largest country in the world by area is", "Russia"),
        ("geography", "The Great Wall is in", "China"),
        ("geography", "The Colosseum is in the city of", "Rome"),
        ("geography", "The Taj Mahal is in", "India"),
        ("geography", "Big Ben is in the city of", "London"),
        ("geography", "The country shaped like a boot is", "Italy"),
        ("geography", "The continent with the most people is", "Asia"),
        ("geography", "The coldest continent on Earth is", "Antarctica"),
        ("language", "The opposite of big is", "small"),
        ("language", "The opposite of day is", "night"),
        ("language", "The opposite of fast is", "slow"),
        ("language", "The plural of mouse is", "mice"),
        ("language", "Red, orange, yellow, green,", "blue"),
        ("language", "Spring, summer, autumn,", "winter"),
        ("language", "A, B, C, D,", "E"),
        ("language", "The past tense of go is", "went"),
        ("everyday", "The currency of the United Kingdom is the pound", "sterling"),
        ("everyday", "The currency of the United States is the", "dollar"),
        ("everyday", "A baby cat is called a", "kitten"),
        ("everyday", "A baby dog is called a", "puppy"),
        ("everyday", "A year has twelve", "months"),
        ("everyday", "A day has twenty-four", "hours"),
        ("everyday", "To cut paper you use a pair of", "scissors"),
        ("everyday", "The colour of a ripe banana is", "yellow"),
    ]
)

CONFLICT: tuple[ConflictPrompt, ...] = tuple(
    ConflictPrompt(
        f"In this story, {fact} {override}. Remember the story. In this story, {fact}",
        override,
        parametric,
        category,
    )
    for category, fact, override, parametric in [
        ("capitals", "the capital of France is", "Lyon", "Paris"),
        ("capitals", "the capital of Germany is", "Munich", "Berlin"),
        ("capitals", "the capital of Japan is", "Osaka", "Tokyo"),
        ("capitals", "the capital of Italy is", "Milan", "Rome"),
        ("capitals", "the capital of Spain is", "Seville", "Madrid"),
        ("science", "the largest planet in the solar system is", "Saturn", "Jupiter"),
        ("science", "the chemical symbol for gold is", "Gd", "Au"),
        ("science", "the planet known as the Red Planet is", "Venus", "Mars"),
        ("people", "Romeo and Juliet was written by William", "Wordsworth", "Shakespeare"),
        ("people", "the Mona Lisa was painted by Pablo", "Picasso", "Vinci"),
        ("geography", "the tallest mountain in the world is Mount", "Kilimanjaro", "Everest"),
        ("geography", "the Eiffel Tower is in the city of", "Rome", "Paris"),
        ("language", "the opposite of hot is", "purple", "cold"),
        ("everyday", "the currency of Japan is the", "euro", "yen"),
        ("everyday", "bees make", "silk", "honey"),
        ("everyday", "cows are animals that give us", "wool", "milk"),
        ("capitals", "the capital of England is", "Manchester", "London"),
        ("science", "the closest star to the Earth is the", "Moon", "Sun"),
        ("people", "the theory of evolution was proposed by Isaac", "Newton", "Darwin"),
        ("geography", "the longest river in Africa is the", "Congo", "Nile"),
        ("language", "the opposite of up is", "left", "down"),
    ]
)

NEEDLE_FACT = "The secret project code name is ZEPHYR-4821."
NEEDLE_QUERY = (
    "\n\nQuestion: What is the secret project code name?\nAnswer: The secret project code name is"
)
NEEDLE_ANSWER = "ZEPHYR"
NEEDLE_LENGTHS = (256, 512, 1024, 2048, 4096, 8192, 16384, 32768)

_FILLER = (
    "The weather in the valley stayed mild for most of the season.",
    "Farmers brought their vegetables to the market every Saturday morning.",
    "A small river ran past the old mill and under the stone bridge.",
    "The library opened a new reading room with large windows.",
    "Children played football in the park until the evening lights came on.",
    "The baker started work before dawn to prepare fresh bread.",
    "Several trains passed through the station without stopping.",
    "The museum added a collection of maps from the last century.",
    "A gentle wind moved the leaves of the tall oak trees.",
    "The town council met on Tuesday to discuss the new road.",
    "Visitors often stopped at the cafe near the harbour for coffee.",
    "The teacher asked the class to read two chapters before Friday.",
    "Snow covered the hills in the north for a few weeks in winter.",
    "A cyclist repaired a flat tyre beside the quiet country lane.",
    "The orchestra rehearsed in the hall every Thursday evening.",
    "Fishing boats returned to the port late in the afternoon.",
)


def haystack_with_needle(tokenizer, n_tokens: int, depth: float = 0.1) -> str:
    """About `n_tokens` tokens of filler, the needle `depth` of the way in, then the query."""
    budget = n_tokens - len(tokenizer.encode(NEEDLE_FACT + NEEDLE_QUERY, add_special_tokens=False))
    sentences: list[str] = []
    used = 0
    while used < budget:
        sentence = _FILLER[len(sentences) % len(_FILLER)]
        used += len(tokenizer.encode(" " + sentence, add_special_tokens=False))
        sentences.append(sentence)
    sentences.insert(int(len(sentences) * depth), NEEDLE_FACT)
    return " ".join(sentences) + NEEDLE_QUERY


def needle_prompts(tokenizer, max_tokens: int, context_limit: int) -> list[tuple[int, FactPrompt]]:
    lengths = [n for n in NEEDLE_LENGTHS if n <= min(max_tokens, context_limit - 1)]
    return [
        (
            n,
            FactPrompt(
                haystack_with_needle(tokenizer, n), NEEDLE_ANSWER, f"needle-{n}", "in_context"
            ),
        )
        for n in lengths
    ]

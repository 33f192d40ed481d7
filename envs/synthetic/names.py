"""Names for synthetic entities, built from syllables and word lists with a seeded RNG.

Names must not be memorisable: a policy trained on one seed must not know any fact of another seed's
world, so every root word is assembled from syllables ("Velmora", "Quorinth") and changes with the
seed. They must also be unique and distinctive, because the agent finds an entity's page by
searching its name: :class:`NameBook` never hands out the same root word or full name twice.
"""

from __future__ import annotations

import random
from collections.abc import Callable

_ONSETS = ("b", "br", "c", "ch", "d", "dr", "f", "fl", "g", "gr", "h", "j", "k", "kr", "l", "m",
           "n", "p", "pr", "qu", "r", "s", "sh", "sk", "st", "t", "th", "tr", "v", "w", "z", "")
_VOWELS = ("a", "e", "i", "o", "u", "a", "e", "o", "ae", "ai", "ea", "ie", "ou", "y")
_CODAS = ("", "", "", "n", "r", "l", "s", "m", "th", "nd", "rn", "st", "x", "k", "rd", "v")

_ORG_SUFFIXES = ("Institute", "Company", "Works", "Foundation", "Press", "Holdings", "Trading House",
                 "Laboratories", "Bank", "Records", "Studios", "Cooperative", "Shipyards",
                 "Observatory", "Mills")
_HUB_SUFFIXES = ("Society", "League", "Guild", "Academy", "Federation", "Circle", "Fellowship",
                 "Brotherhood", "Assembly", "Order")
_CITY_SUFFIXES = ("", "", "holm", "ford", "mouth", "burg", "vale", "stead", "wick", "port", "gate")
_COUNTRY_SUFFIXES = ("ia", "land", "istan", "ara", "onia", "ovia")
_CURRENCY_UNITS = ("crown", "mark", "florin", "thaler", "drachm", "ducat", "shilling", "real")
_ADJECTIVES = ("Silent", "Glass", "Hollow", "Burning", "Patient", "Crooked", "Northern", "Velvet",
               "Broken", "Distant", "Golden", "Quiet", "Restless", "Salt", "Iron", "Paper",
               "Midnight", "Copper", "Wandering", "Frozen", "Hidden", "Last", "Painted", "Bitter",
               "Lantern", "Winter", "Amber", "Ashen", "Drowned", "Secret")
_NOUNS = ("Orchard", "Harbour", "Letters", "Bridge", "Mirror", "Garden", "Tide", "Lighthouse",
          "Archive", "Compass", "Meadow", "Clock", "River", "Tower", "Ferry", "Ledger", "Atlas",
          "Chorus", "Feather", "Market", "Engine", "Window", "Vineyard", "Cathedral", "Kite",
          "Labyrinth", "Canal", "Signal", "Quarry", "Procession")
_MODELS = ("Mk II", "Mk III", "X40", "S7", "Pro", "Deluxe", "Mini", "200", "Type B", "Series 5",
           "Aero", "Classic")
_EVENT_WORDS = ("Cup", "Open", "Festival", "Games", "Fair", "Congress", "Week", "Gala", "Trophy",
                "Derby")


class NameBook:
    """Hands out unique names. Same seed, same names in the same order."""

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng
        self._roots: set[str] = set()
        self._names: set[str] = set()

    def root(self, min_syllables: int = 2, max_syllables: int = 3) -> str:
        """A fresh capitalised syllable word that no other name has used as a root."""
        for _ in range(10_000):
            count = self._rng.randint(min_syllables, max_syllables)
            word = "".join(self._syllable(first=i == 0, last=i == count - 1) for i in range(count))
            word = word[:1].upper() + word[1:]
            if 4 <= len(word) <= 11 and word.lower() not in self._roots:
                self._roots.add(word.lower())
                return word
        raise RuntimeError("ran out of syllable words; lower the number of entities")

    def _syllable(self, first: bool, last: bool) -> str:
        onset = self._rng.choice(_ONSETS if first else _ONSETS[:-1])  # no vowel clashes inside
        vowel = self._rng.choice(_VOWELS)
        coda = self._rng.choice(_CODAS) if last or self._rng.random() < 0.3 else ""
        return onset + vowel + coda

    def unique(self, make: Callable[[], str]) -> str:
        for _ in range(1_000):
            name = make()
            if name.lower() not in self._names:
                self._names.add(name.lower())
                return name
        raise RuntimeError("could not find a unique name; lower the number of entities")

    def pools(self, given: int, family: int) -> tuple[list[str], list[str]]:
        """Given names and family names for people (family names are shared, as in life)."""
        return ([self.root(2, 2) for _ in range(given)], [self.root(2, 3) for _ in range(family)])

    def person(self, given: list[str], family: list[str]) -> str:
        return self.unique(lambda: f"{self._rng.choice(given)} {self._rng.choice(family)}")

    def organisation(self, hub: bool) -> str:
        suffixes = _HUB_SUFFIXES if hub else _ORG_SUFFIXES
        return self.unique(lambda: f"{self.root()} {self._rng.choice(suffixes)}")

    def city(self) -> str:
        return self.unique(lambda: self.root(2, 2) + self._rng.choice(_CITY_SUFFIXES))

    def country(self) -> str:
        return self.unique(lambda: self.root(1, 2) + self._rng.choice(_COUNTRY_SUFFIXES))

    def currency(self, country: str) -> str:
        return f"{country} {self._rng.choice(_CURRENCY_UNITS)}"

    def work(self) -> str:
        def make() -> str:
            pattern = self._rng.randrange(4)
            adjective, noun = self._rng.choice(_ADJECTIVES), self._rng.choice(_NOUNS)
            if pattern == 0:
                return f"The {adjective} {noun}"
            if pattern == 1:
                return f"The {noun} of {self.root()}"
            if pattern == 2:
                return f"{self.root()} {noun}"
            return f"{adjective} {noun} at {self.root()}"

        return self.unique(make)

    def product(self) -> str:
        return self.unique(lambda: f"{self.root()} {self._rng.choice(_MODELS)}")

    def event(self) -> str:
        return self.unique(lambda: f"{self.root()} {self._rng.choice(_EVENT_WORDS)}")


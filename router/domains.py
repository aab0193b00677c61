"""A new request's domain before any drafter has drafted for it: the exemplar prior.

Each drafter declares specialities (labels) and a few exemplar texts. By default every specialist scores the prompt
while prefilling it (router/drafting.py `score_prompts`: its mean log-probability of the prompt's tokens, beside the
target's prefill, while the request decodes plainly) and the best one's speciality is the domain: the drafter that
predicts the prompt best is the one most likely to be accepted on its continuation. `DomainClassifier` is the
model-free fallback (and the `exemplars` prior): the speciality whose exemplars the prompt resembles most (cosine
similarity of hashed character trigrams and layout shapes, microseconds per prompt).
"""

from __future__ import annotations

import math
import re

import numpy as np

FEATURES = 8192  # hashed features of a text's vector

_LETTERS = re.compile(r"[^\W\d_]+")  # a run of letters: one "a" in a text's layout
_DIGIT = re.compile(r"\d")
_MIX = (np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB))
_LAYOUT_SALT = np.uint64(0x9E3779B97F4A7C15)  # a layout 4-gram hashes apart from a trigram of the same characters


def _mixed(x: np.ndarray) -> np.ndarray:
    """A 64-bit integer hash of each element (splitmix64's finaliser: every input bit moves every output bit)."""
    x = (x ^ (x >> np.uint64(30))) * _MIX[0]
    x = (x ^ (x >> np.uint64(27))) * _MIX[1]
    return x ^ (x >> np.uint64(31))


def _gram_hashes(text: str, n: int) -> np.ndarray:
    """A hash of each n characters in a row of `text`, all in numpy (a prompt's vector is on the event loop)."""
    codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32).astype(np.uint64)
    count = len(codes) - n + 1
    if count <= 0:
        return np.zeros(0, dtype=np.uint64)
    key = codes[:count]
    for j in range(1, n):
        key = _mixed(key) ^ codes[j : j + count]
    return _mixed(key)


def _trigram_vector(text: str, dims: int = FEATURES) -> tuple[np.ndarray, np.ndarray]:
    """A text's unit vector of hashed counts of character trigrams (what words it uses) and of 4-grams of its
    layout, each run of letters one letter and digits folded (indentation, `key: value`, brackets): its nonzero
    features, ascending, and their values."""
    padded = f"  {text}  "
    layout = _DIGIT.sub("0", _LETTERS.sub("a", padded))
    hashes = np.concatenate([_gram_hashes(padded, 3), _gram_hashes(layout, 4) ^ _LAYOUT_SALT])
    counts = np.bincount((hashes % np.uint64(dims)).astype(np.int64), minlength=dims)
    features = np.flatnonzero(counts)
    values = counts[features].astype(np.float64)
    return features, values / (math.sqrt(float(values @ values)) or 1.0)


class DomainClassifier:
    """The speciality of the exemplar most similar to the prompt (nearest neighbour).

    The exemplars' vectors are kept as an inverted index in numpy (for each feature, the exemplars that have it and
    their values), so a prompt costs a gather of the nonzeros it shares with them and one sum, not a pass over every
    exemplar's nonzeros (its cost: docs/benchmarks/exemplar-margin.md)."""

    def __init__(self, exemplars: dict[str, list[str]]):
        self.labels: list[str] = []  # each exemplar's label, by exemplar index
        self._names: list[str] = []  # each label with exemplars, and the row of its first (they are consecutive)
        firsts: list[int] = []
        rows, features, values = [], [], []
        for label, texts in exemplars.items():
            if texts:
                self._names.append(label)
                firsts.append(len(self.labels))
            for text in texts:
                f, v = _trigram_vector(text)
                rows.append(np.full(len(f), len(self.labels), dtype=np.int64))
                features.append(f)
                values.append(v)
                self.labels.append(label)
        every = np.concatenate(features) if features else np.zeros(0, dtype=np.int64)
        order = np.argsort(every, kind="stable")
        self._rows = np.concatenate(rows)[order] if rows else np.zeros(0, dtype=np.int64)
        self._values = np.concatenate(values)[order] if values else np.zeros(0, dtype=np.float64)
        by_feature = every[order]
        # Feature f's nonzeros are entries _starts[f] to _starts[f + 1] - 1.
        self._starts = np.searchsorted(by_feature, np.arange(FEATURES + 1))
        self._firsts = np.asarray(firsts, dtype=np.int64)

    def scores(self, prompt: str) -> dict[str, float]:
        """Each label's best cosine similarity between the prompt and one of its exemplars."""
        if not self.labels:
            return {}
        features, values = _trigram_vector(prompt[-2000:])
        starts, lengths = self._starts[features], self._starts[features + 1] - self._starts[features]
        # The entries of every shared feature, in one index: each feature's run starts where its own entries do.
        offsets = np.cumsum(lengths) - lengths
        entries = np.repeat(starts - offsets, lengths) + np.arange(int(lengths.sum()))
        weights = self._values[entries] * np.repeat(values, lengths)
        similarity = np.bincount(self._rows[entries], weights=weights, minlength=len(self.labels))
        # A label's exemplars are consecutive rows: its best is the maximum over its run.
        return dict(zip(self._names, np.maximum.reduceat(similarity, self._firsts).tolist()))

    def classify(self, prompt: str) -> str:
        return best_label(self.scores(prompt))

    def sure(self, prompt: str, margin: float) -> str:
        """The prompt's label where its best exemplar beats every other label's by at least `margin`, else ""."""
        return sure_label(self.scores(prompt), margin) if margin > 0 else ""


def best_label(scores: dict[str, float]) -> str:
    """The label of the best score ("" with none)."""
    return max(scores, key=scores.get) if scores else ""


def sure_label(scores: dict[str, float], margin: float) -> str:
    """The best label where it leads every other by at least `margin` (> 0), else ""."""
    ranked = sorted(scores, key=scores.get, reverse=True)
    if not ranked or (len(ranked) > 1 and scores[ranked[0]] - scores[ranked[1]] < margin):
        return ""
    return ranked[0]

"""A BM25 keyword search over bundled documents: capability `rag.search@2.1.0` (cost B).

The documents live in `examples/data/docs.json`; the index is built while the
agent is Spawning (its start-up hook), the way a real agent would load a model.

    python -m examples.search_agent      # AGENT_ID, AGENT_PORT, TEMPORAL_ADDRESS, ...
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentroster.agent.runtime import AgentRuntime, run_agent

DOCS_PATH = Path(__file__).parent / "data" / "docs.json"
STOPWORDS = frozenset(
    "a an and are as at be by for from has in is it its of on or so such that the their them then there these this to "
    "was were when which while who will with without".split()
)
_TOKEN = re.compile(r"[a-z0-9]+")


def _stem(token: str) -> str:
    """A deliberately tiny stemmer: plural 's' off ("heartbeats" -> "heartbeat")."""
    return token[:-1] if len(token) > 3 and token.endswith("s") and not token.endswith("ss") else token


def tokenize(text: str) -> list[str]:
    """Lower-case, lightly stemmed word tokens without stop words."""
    return [_stem(t) for t in _TOKEN.findall(text.lower()) if t not in STOPWORDS]


@dataclass(frozen=True)
class Hit:
    id: str
    title: str
    score: float


class BM25Index:
    """Okapi BM25 over a small in-memory corpus of `{id, title, text}` documents."""

    def __init__(self, docs: Sequence[Mapping[str, str]], *, k1: float = 1.5, b: float = 0.75) -> None:
        if not docs:
            raise ValueError("BM25Index needs at least one document")
        self.k1 = k1
        self.b = b
        self.docs = [dict(d) for d in docs]
        # The title counts twice: it is the densest summary of the document.
        self._tf = [Counter(tokenize(f"{d['title']} {d['title']} {d['text']}")) for d in self.docs]
        self._len = [sum(tf.values()) for tf in self._tf]
        self._avg_len = sum(self._len) / len(self._len)
        df: Counter[str] = Counter()
        for tf in self._tf:
            df.update(tf.keys())
        n = len(self.docs)
        self._idf = {term: math.log((n - count + 0.5) / (count + 0.5) + 1.0) for term, count in df.items()}

    @classmethod
    def from_file(cls, path: Path = DOCS_PATH) -> BM25Index:
        return cls(json.loads(path.read_text(encoding="utf-8")))

    def score(self, query_terms: Sequence[str], i: int) -> float:
        tf, length = self._tf[i], self._len[i]
        total = 0.0
        for term in query_terms:
            f = tf.get(term, 0)
            if f:
                norm = f * (self.k1 + 1) / (f + self.k1 * (1 - self.b + self.b * length / self._avg_len))
                total += self._idf[term] * norm
        return total

    def search(self, query: str, k: int = 3) -> list[Hit]:
        """The `k` best documents with a positive score, best first (ties by id)."""
        terms = tokenize(query)
        scored = [(self.score(terms, i), d["id"], d["title"]) for i, d in enumerate(self.docs)]
        ranked = sorted((s for s in scored if s[0] > 0), key=lambda s: (-s[0], s[1]))
        return [Hit(id=doc_id, title=title, score=round(score, 4)) for score, doc_id, title in ranked[:k]]


INPUT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "query": {"type": "string", "minLength": 1, "maxLength": 2000},
        "k": {"type": "integer", "minimum": 1, "maximum": 20, "default": 3},
    },
    "required": ["query"],
    "additionalProperties": False,
}
OUTPUT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "hits": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"id": {"type": "string"}, "title": {"type": "string"}, "score": {"type": "number"}},
                "required": ["id", "title", "score"],
            },
        }
    },
    "required": ["hits"],
}


def build_agent(env: Mapping[str, str] | None = None, *, docs_path: Path = DOCS_PATH, **defaults: Any) -> AgentRuntime:
    """The search agent, configured from `env` (default: the process environment)."""
    defaults.setdefault("deployment", "search-agent")
    agent = AgentRuntime.from_env(env, **defaults)
    index: list[BM25Index] = []

    @agent.on_startup
    def load_index() -> None:
        index.append(BM25Index.from_file(docs_path))

    @agent.capability("rag.search", "2.1.0", input_schema=INPUT_SCHEMA, output_schema=OUTPUT_SCHEMA, max_concurrency=2, cost_class="B")
    def search(payload: dict[str, Any]) -> dict[str, Any]:
        hits = index[0].search(payload["query"], payload.get("k", 3))
        return {"hits": [{"id": h.id, "title": h.title, "score": h.score} for h in hits]}

    return agent


if __name__ == "__main__":
    run_agent(build_agent())

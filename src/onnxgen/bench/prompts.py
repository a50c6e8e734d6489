"""The prompts ``onnxgen bench`` times: synthetic ids, built-in texts for speculation, or a file.

- ``synthetic``: deterministic ids spread over the vocabulary (no tokenizer needed).
- ``repetitive``: a code snippet quoted twice, then its beginning again, so the natural continuation
  repeats an earlier span (what prompt lookup drafts from): ``body + sep + body + sep + body[:m]``.
- ``novel``: prose with nothing to copy (no sentence or phrase repeats).

Built-in texts are encoded with the model's tokenizer (no special tokens inside the text; the ids a
tokenizer adds in front of any text, such as a BOS, lead the prompt) and cut to the requested length
in tokens, so every kind gives exactly ``--prompt-tokens`` ids.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from onnxgen.bench.genai_engine import BenchError

SYNTHETIC, REPETITIVE, NOVEL = "synthetic", "repetitive", "novel"
PROMPT_KINDS = (SYNTHETIC, REPETITIVE, NOVEL)

# text, add_special_tokens -> ids (the onnxgen worker's tokenizer)
Encode = Callable[[str, bool], list[int]]

CODE_SNIPPET = '''def merge_intervals(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Merge overlapping closed intervals; the result is sorted by start."""
    if not intervals:
        return []
    ordered = sorted(intervals, key=lambda pair: pair[0])
    merged = [ordered[0]]
    for start, end in ordered[1:]:
        last_start, last_end = merged[-1]
        if start <= last_end:
            merged[-1] = (last_start, max(last_end, end))
        else:
            merged.append((start, end))
    return merged


class LRUCache:
    """A least-recently-used cache of at most `capacity` entries."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1 (got {capacity})")
        self.capacity = capacity
        self.entries: dict[str, bytes] = {}

    def get(self, key: str) -> bytes | None:
        value = self.entries.pop(key, None)
        if value is not None:
            self.entries[key] = value
        return value

    def put(self, key: str, value: bytes) -> None:
        self.entries.pop(key, None)
        self.entries[key] = value
        while len(self.entries) > self.capacity:
            oldest = next(iter(self.entries))
            del self.entries[oldest]


def word_frequencies(text: str, top: int = 10) -> list[tuple[str, int]]:
    counts: dict[str, int] = {}
    for word in text.lower().split():
        word = word.strip(".,;:!?\\"'()[]")
        if word:
            counts[word] = counts.get(word, 0) + 1
    ranked = sorted(counts.items(), key=lambda item: (-item[1], item[0]))
    return ranked[:top]
'''

NOVEL_TEXT = (
    "Morning fog rolled across the harbor while fishermen untangled nets beside weathered crates. "
    "A baker two streets inland pulled rye loaves from an oven older than anyone in town could remember. "
    "Children raced toward school, dodging puddles left by last night's storm, their laughter bouncing "
    "off brick walls painted ochre decades ago. At the railway station a conductor checked his pocket "
    "watch, frowned, then waved forward a freight train loaded with timber bound for northern sawmills. "
    "Inside the library, volunteers catalogued donated atlases whose borders showed countries that no "
    "longer exist. Meanwhile an astronomer at the hilltop observatory reviewed photographs of a comet "
    "discovered by an amateur in Patagonia, noting its greenish tail and unusually slow rotation. "
    "Farmers south of the river debated whether early frost would spare their pumpkins; one suggested "
    "covering vines with straw, another trusted luck. By noon the fog lifted, revealing sailboats tacking "
    "against a brisk westerly wind. A retired violinist practiced scales on her balcony, pausing whenever "
    "gulls screeched overhead. Down at city hall, clerks argued about budgets for repairing cobblestones "
    "versus funding summer concerts in Elm Park. Late afternoon brought golden light over vineyards "
    "climbing terraced slopes east of town, where pickers filled wicker baskets with dusky grapes. "
    "Evening settled quietly: lanterns flickered along the pier, a ferry horn sounded twice, and somewhere "
    "a dog barked at shadows only it could see. Few residents noticed the new lighthouse keeper arriving "
    "with a battered suitcase, a telescope wrapped in wool, and a notebook full of tide tables copied by "
    "hand. He climbed spiral stairs counting each step aloud, reached the lamp room just after dusk, and "
    "wound the clockwork mechanism exactly as his predecessor's letter had described. Beyond the breakwater "
    "whales surfaced briefly, exhaling silver plumes into cold air. Tomorrow, merchants would unload saffron, "
    "copper kettles, bolts of indigo cloth, and crates of oranges from a schooner delayed by gales near Crete. "
    "Gossip about its captain, a woman rumored to have sailed alone around Cape Horn, had already spread "
    "through every tavern, barbershop, and tailor's workshop between the docks and the cathedral square."
)


def synthetic_prompt(length: int, vocab_size: int) -> list[int]:
    """``length`` deterministic token ids spread over [1, vocab_size) (a fixed stride, no randomness)."""
    span = max(vocab_size - 1, 1)
    return [1 + (i * 7919 + 13) % span for i in range(length)]


def repetitive_prompt(length: int, encode: Encode) -> list[int]:
    """``lead + body + sep + body + sep + body[:m]`` of exactly ``length`` ids, ``m`` about a third of the
    body: the continuation that copies the body is there to be drafted."""
    lead, sep = encode("", True), encode("\n\n", False)
    room = length - len(lead) - 2 * len(sep)
    body_len = 3 * room // 7  # two bodies and (at least) a third of one fill the room
    code = encode(CODE_SNIPPET, False)
    if room < 3 or body_len > len(code):
        raise BenchError(
            f"--prompt-kind {REPETITIVE} makes prompts of {len(lead) + 2 * len(sep) + 3} to about "
            f"{len(lead) + 2 * len(sep) + 7 * len(code) // 3} tokens with this tokenizer (asked for {length}); "
            "change --prompt-tokens or give a --prompt-file"
        )
    body = code[:body_len]
    return [*lead, *body, *sep, *body, *sep, *body[: room - 2 * body_len]]


def novel_prompt(length: int, encode: Encode) -> list[int]:
    """The first ``length`` ids of the built-in prose (after the tokenizer's leading ids)."""
    ids = encode("", True) + encode(NOVEL_TEXT, False)
    if length > len(ids):
        raise BenchError(
            f"--prompt-kind {NOVEL} has {len(ids)} tokens with this tokenizer (asked for {length}); "
            "lower --prompt-tokens or give a longer --prompt-file"
        )
    return ids[:length]


def kind_prompt(kind: str, length: int, vocab_size: int, encode: Encode) -> list[int]:
    """The prompt of ``kind`` with exactly ``length`` ids."""
    if kind == SYNTHETIC:
        return synthetic_prompt(length, vocab_size)
    if kind == REPETITIVE:
        return repetitive_prompt(length, encode)
    if kind == NOVEL:
        return novel_prompt(length, encode)
    raise BenchError(f"--prompt-kind {kind!r} is not a kind; choose from {', '.join(PROMPT_KINDS)}")


def read_prompt_file(path: str) -> str:
    """The text of a ``--prompt-file`` (the whole file is the prompt)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(
            f"--prompt-file {path!r} cannot be read ({e}); give a readable UTF-8 text file"
        ) from e
    if not text.strip():
        raise ValueError(f"--prompt-file {path!r} is empty; give a file with the prompt text")
    return text

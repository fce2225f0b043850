"""Noun glosses from the WordNet 3.0 database files shipped by Debian's `wordnet-base`.

Used to enrich clip-art captions with a definition of the title's head noun. Lookup follows the
WordNet database format (wndb(5WN)): `index.noun` lists a lemma's synset offsets, most frequent sense
first; `data.noun` holds the synset at that byte offset, its gloss after ` | `.
"""

from __future__ import annotations

from pathlib import Path

from omni_train.prepare.sources import SourceName, require_path

__all__ = ["WordNetGlosses"]

DEFAULT_WORDNET_DIR = Path("/usr/share/wordnet")


class WordNetGlosses:
    """First-sense noun glosses, e.g. `gloss("bat")` -> "nocturnal mouselike mammal with ...".

    Args:
        root: folder holding `index.noun` and `data.noun`.

    Raises:
        MissingSourceError: when the database files are not installed (names `wordnet-base`).
    """

    def __init__(self, root: Path = DEFAULT_WORDNET_DIR) -> None:
        index = require_path(SourceName.WORDNET, root / "index.noun")
        self._data = require_path(SourceName.WORDNET, root / "data.noun").read_bytes()
        self._offsets: dict[str, int] = {}
        for line in index.read_text("ascii").splitlines():
            if line.startswith(" "):  # license header lines start with two spaces
                continue
            fields = line.split()
            lemma, p_cnt = fields[0], int(fields[3])
            # lemma pos synset_cnt p_cnt [ptr_symbol]*p_cnt sense_cnt tagsense_cnt synset_offset...
            self._offsets[lemma] = int(fields[4 + p_cnt + 2])

    def gloss(self, word: str) -> str | None:
        """The first-sense gloss of `word` as a noun (definition only, examples dropped), or None."""
        offset = self._offsets.get(word.lower().replace(" ", "_"))
        if offset is None:
            return None
        end = self._data.index(b"\n", offset)
        record = self._data[offset:end].decode("utf-8")
        definition = record.split(" | ", 1)[1].split(";")[0].strip()
        return definition or None

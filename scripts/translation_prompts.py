"""Translation requests for drafter training, made from the non-English sentences of a ShareGPT file.

    python scripts/translation_prompts.py SHAREGPT.json OUT.json

Spec-Bench's translation questions ask "Translate German to English: <sentence>", and a small
target mostly answers by copying the sentence with changes: a drafter trained only on English
answers has never seen that. This writes one ShareGPT-format conversation per sentence found in
the file's turns that reads as German, French, Spanish, Italian or Portuguese (by counts of each
language's commonest words; 8 to 45 words, no English words or code), asking for it in English,
for `specdecode train ... --self-distill` to answer. No Spec-Bench text is used.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from specdecode.train.data import read_sharegpt

COMMON_WORDS = {
    "German": "und der die das nicht ist mit ich wir für auf eine sich werden von zu den dem auch",
    "French": "le la les des et est une pour dans que qui pas sur avec vous nous du au",
    "Spanish": "el los las y es una para que por con del como su más pero se lo",
    "Portuguese": "não uma para com os as do da em que é um se por mais dos",
    "Italian": "il gli della che non è una per con del sono di alla nel anche",
}
PATTERNS = {
    lang: re.compile(r"\b(" + "|".join(words.split()) + r")\b", re.I) for lang, words in COMMON_WORDS.items()
}
ENGLISH = re.compile(r"\b(the|and|is|of|to|that|for|with|you|this|are)\b", re.I)
NOT_PROSE = re.compile(r"[{}<>=_#`|\\\u0400-\u9fff\uac00-\ud7af]")  # code, Cyrillic, CJK, Hangul
SENTENCE_END = re.compile(r"(?<=[.!?])\s+|\n+")


def language(sentence: str) -> str | None:
    """The language `sentence` reads as, or None (English, code, too short or long, unclear)."""
    if not 8 <= len(sentence.split()) <= 45 or NOT_PROSE.search(sentence):
        return None
    if len(ENGLISH.findall(sentence)) > 1:
        return None
    counts = sorted(((len(p.findall(sentence)), lang) for lang, p in PATTERNS.items()), reverse=True)
    (best, lang), (second, _) = counts[0], counts[1]
    return lang if best >= 4 and second < best - 1 else None


def main(source: str, out: str) -> None:
    seen: set[str] = set()
    conversations = []
    for conversation in read_sharegpt(source):
        for message in conversation:
            for sentence in (s.strip() for s in SENTENCE_END.split(message["content"])):
                lang = language(sentence)
                if lang is None or sentence in seen:
                    continue
                seen.add(sentence)
                request = f"Translate {lang} to English: {sentence}"
                turns = [{"from": "human", "value": request}]  # the target writes the answer
                conversations.append({"id": f"translate-{len(conversations)}", "conversations": turns})
    Path(out).write_text(json.dumps(conversations, ensure_ascii=False, indent=0))
    print(f"{len(conversations)} translation requests -> {out}")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2])

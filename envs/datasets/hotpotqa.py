"""HotpotQA-style multi-hop files: tasks with clue chains, and the offline corpus they are answered from.

Each line holds ``id, source, question, answers[], paragraphs[{title, text, is_supporting}]``. The
paragraphs of all questions together make a small Wikipedia: one :class:`Document` per distinct title,
served by the corpus server at ``url_prefix + title_slug(title)`` and searched by the local index. The
supporting paragraphs become the task's clues, so clue-recovery rewards can check that the agent
visited the evidence.

How a clue is built (kept simple on purpose):

* one clue per supporting paragraph, ``evidence_urls`` = that paragraph's URL;
* the clue whose paragraph contains an answer (whole-word, case-insensitive) has role ``"answer"``;
  if two do, the one whose title the question does not name wins (the question names the first hop),
  then the later one. Yes/no answers never mark a paragraph: comparison questions have no
  answer-bearing paragraph, and "no" occurs in ordinary prose. All other clues are ``"bridge"``;
* clue text = the paragraph's first sentence that names its title, with or without a trailing
  "(disambiguation)" (else its first sentence); for the
  answer clue, followed by the first sentence naming the answer when that is a later sentence;
* aliases: the title for a bridge clue, the accepted answers for the answer clue.
Bridge clues come first, in paragraph order, and the answer clue last, so the chain reads in hop order.
"""

from __future__ import annotations

import hashlib
import json
import re
import unicodedata
from dataclasses import dataclass
from pathlib import Path

from envs.datasets.generic import DatasetError, parse_answers, where
from envs.search.base import Document
from envs.tasks import Clue, Task
from envs.tools.base import JsonValue

# Characters kept as they are in a slug: legal unescaped in a URL path, as on Wikipedia. "_" stands
# for a space and "~" starts a hash suffix, so neither is in this set (that keeps slugs unique).
_PLAIN = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789()',.!-")
_YES_NO = frozenset({"yes", "no"})
_DISAMBIGUATION = re.compile(r"\s*\([^()]*\)$")  # "Kiss and Tell (1945 film)" names "Kiss and Tell"


@dataclass(frozen=True)
class HotpotQA:
    """The tasks of one HotpotQA-style file and the corpus their paragraphs make."""

    tasks: list[Task]
    corpus: list[Document]


def title_slug(title: str) -> str:
    """A URL-path-safe, unique, readable slug for a page title.

    Titles made only of ASCII letters, digits, spaces and ``()',.!-`` read as on Wikipedia
    (``Kiss and Tell (1945 film)`` → ``Kiss_and_Tell_(1945_film)``). Any other title is folded to
    ASCII and gets ``~`` plus 8 hex digits of its SHA-1, so two titles never share a slug.
    """
    if title and all(char in _PLAIN or char == " " for char in title):
        return title.replace(" ", "_")
    folded = unicodedata.normalize("NFKD", title).encode("ascii", "ignore").decode("ascii")
    readable = "".join(char if char in _PLAIN else "_" for char in folded).strip("_")
    digest = hashlib.sha1(title.encode("utf-8")).hexdigest()[:8]
    return f"{readable}~{digest}" if readable else digest


def read_hotpotqa(path: str | Path, url_prefix: str) -> HotpotQA:
    """Read the tasks and the corpus of a HotpotQA-style JSONL file.

    ``url_prefix`` is where the corpus server serves pages (e.g. ``http://127.0.0.1:8765/wiki/``);
    clue evidence URLs and document URLs both start with it, so they match what the agent visits.
    A title seen twice keeps its first text.
    """
    if not url_prefix:
        raise DatasetError(
            f"{path}: url_prefix is empty; set it to the corpus server's page address, "
            "e.g. 'http://127.0.0.1:8765/wiki/'"
        )
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"{path}: no such file; check the dataset path")
    tasks: list[Task] = []
    corpus: dict[str, Document] = {}
    with path.open("rb") as lines:
        for line_no, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            at = where(path, line_no)
            try:
                record = json.loads(line.decode("utf-8"))
            except UnicodeDecodeError:
                raise DatasetError(f"{at}: not valid UTF-8; re-save the file as UTF-8") from None
            except json.JSONDecodeError as exc:
                raise DatasetError(f"{at}: malformed JSON ({exc.msg} at column {exc.colno})") from None
            task, paragraphs = _task(record, at, default_id=f"{path.stem}:{line_no}", url_prefix=url_prefix)
            tasks.append(task)
            for title, text in paragraphs:
                if title not in corpus:
                    slug = title_slug(title)
                    corpus[title] = Document(doc_id=slug, title=title, text=text, url=url_prefix + slug)
    return HotpotQA(tasks=tasks, corpus=list(corpus.values()))


def _task(record: object, at: str, *, default_id: str, url_prefix: str) -> tuple[Task, list[tuple[str, str]]]:
    if not isinstance(record, dict):
        raise DatasetError(f"{at}: expected a JSON object")
    question = record.get("question")
    if not isinstance(question, str) or not question.strip():
        raise DatasetError(f"{at}: field 'question' is missing or empty")
    answers = parse_answers(record.get("answers"), at)
    task_id = str(record.get("id") or default_id)
    paragraphs = record.get("paragraphs")
    if not isinstance(paragraphs, list) or not paragraphs:
        raise DatasetError(f"{at}: field 'paragraphs' must be a non-empty list")
    parsed: list[tuple[str, str, bool]] = []
    for index, paragraph in enumerate(paragraphs):
        if not (isinstance(paragraph, dict) and isinstance(paragraph.get("title"), str)
                and isinstance(paragraph.get("text"), str)):
            raise DatasetError(f"{at}: field 'paragraphs'[{index}] needs string 'title' and 'text'")
        parsed.append((paragraph["title"], paragraph["text"], bool(paragraph.get("is_supporting"))))
    supporting = [(title, text) for title, text, is_supporting in parsed if is_supporting]
    if not supporting:
        raise DatasetError(f"{at}: no paragraph has 'is_supporting': true; a task needs its evidence")

    metadata: dict[str, JsonValue] = {
        "source": str(record.get("source", "hotpotqa")),
        "supporting_titles": [title for title, _ in supporting],
    }
    task = Task(id=task_id, question=question, answers=answers,
                clues=_clues(task_id, question, answers, supporting, url_prefix), metadata=metadata)
    return task, [(title, text) for title, text, _ in parsed]


def _clues(task_id: str, question: str, answers: tuple[str, ...], supporting: list[tuple[str, str]],
           url_prefix: str) -> tuple[Clue, ...]:
    answer_index = _answer_paragraph(question, answers, supporting)
    order = [i for i in range(len(supporting)) if i != answer_index]
    if answer_index is not None:
        order.append(answer_index)
    clues: list[Clue] = []
    for position, index in enumerate(order):
        title, text = supporting[index]
        sentences = split_sentences(text)
        lead = _first_naming(sentences, (title, _DISAMBIGUATION.sub("", title))) or sentences[0]
        url = (url_prefix + title_slug(title),)
        if index == answer_index:
            answer_sentence = _first_naming(sentences, answers)
            if answer_sentence and answer_sentence != lead:
                lead = f"{lead} {answer_sentence}"
            clues.append(Clue(id=f"{task_id}/clue{position}", text=lead, role="answer",
                              evidence_urls=url, aliases=answers))
        else:
            clues.append(Clue(id=f"{task_id}/clue{position}", text=lead, role="bridge",
                              evidence_urls=url, aliases=(title,)))
    return tuple(clues)


def _answer_paragraph(question: str, answers: tuple[str, ...],
                      supporting: list[tuple[str, str]]) -> int | None:
    if all(answer.lower() in _YES_NO for answer in answers):
        return None
    holding = [i for i, (_, text) in enumerate(supporting) if _names_any(text, answers)]
    if not holding:
        return None
    unnamed = [i for i in holding if supporting[i][0].lower() not in question.lower()]
    return (unnamed or holding)[-1]


def split_sentences(text: str) -> list[str]:
    """Sentences of a paragraph. HotpotQA files join sentences with two spaces, so that is used when
    present (it avoids splitting at "U.S."); otherwise split after ``.!?`` before a capital or digit."""
    pattern = r"(?<=\S)\s{2,}(?=\S)" if "  " in text else r"(?<=[.!?])\s+(?=[A-Z0-9\"'(])"
    sentences = [sentence.strip() for sentence in re.split(pattern, text.strip())]
    return [sentence for sentence in sentences if sentence] or [text.strip()]


def _first_naming(sentences: list[str], names: tuple[str, ...]) -> str | None:
    return next((sentence for sentence in sentences if _names_any(sentence, names)), None)


def _names_any(text: str, names: tuple[str, ...]) -> bool:
    return any(re.search(rf"(?<!\w){re.escape(name)}(?!\w)", text, re.IGNORECASE) for name in names if name)

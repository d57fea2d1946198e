"""``embed --file`` and ``ocr`` over several files as long jobs: JSON lines, --output, progress.

A healthy simulator (``polygateway simulate``) serves the happy paths; the
"no lost work" cases run the simulator in this process with a source that
answers 503 to about half the requests (seeded, so a run repeats), and check
the CLI's account of what failed against what the simulator really did.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import threading
from pathlib import Path
from typing import Any

import pytest
from cli_run import Ran, RunCli, cli_command, cli_env

from polygateway.cli.samples import tiny_pdf, tiny_png
from polygateway.simulator import FaultProfile, SimulatedUpstream

TEXTS = [f"line number {i}" for i in range(12)]


def _config(url: str, *, max_attempts: int = 2) -> str:
    """Embed and OCR scopes on the simulator's source ``a`` (no key needed)."""
    return f"""
[gateway]
max_attempts = {max_attempts}
backoff_base_s = 0.01
backoff_cap_s = 0.02
breaker_failures = 1000

[scopes.embed]
kind = "embed"
[[scopes.embed.sources]]
name = "a"
protocol = "openai"
base_url = "{url}/a/v1"
max_batch_size = 2
max_concurrency = 1

[scopes.ocr]
kind = "ocr"
[[scopes.ocr.sources]]
name = "a"
protocol = "monkey_ocr"
base_url = "{url}/a"
"""


@pytest.fixture
def workdir(tmp_path: Path, simulator: str) -> Path:
    """The run's directory: settings for the healthy simulator, texts, two images, a non-image."""
    (tmp_path / "polygateway.toml").write_text(_config(simulator))
    (tmp_path / "texts.txt").write_text("\n".join(TEXTS) + "\n")
    (tmp_path / "page.png").write_bytes(tiny_png())
    (tmp_path / "doc.pdf").write_bytes(tiny_pdf())
    (tmp_path / "notes.png").write_text("not an image at all\n")
    return tmp_path


def _lines(text: str) -> list[dict[str, Any]]:
    """JSON lines parsed, one object per non-empty line."""
    return [json.loads(line) for line in text.splitlines() if line.strip()]


# -- embed ------------------------------------------------------------------------------------


@pytest.mark.usefixtures("workdir")
def test_embed_jsonl_prints_one_object_per_text_in_input_order(run_cli: RunCli) -> None:
    """``embed --file texts.txt --jsonl``: 12 lines on stdout, index and text in input order."""
    ran = run_cli("embed", "--file", "texts.txt", "--jsonl")
    assert ran.code == 0, ran.stderr
    lines = _lines(ran.stdout)
    assert [line["index"] for line in lines] == list(range(len(TEXTS)))
    assert [line["text"] for line in lines] == TEXTS
    assert all(line["ok"] and len(line["vector"]) > 0 for line in lines)
    assert "12 vectors of dimension" in ran.stderr


def test_embed_output_writes_the_file_and_json_prints_a_summary(
    run_cli: RunCli, workdir: Path
) -> None:
    """``--json embed --file texts.txt --output v.jsonl``: vectors in the file, one summary doc."""
    ran = run_cli("--json", "embed", "--file", "texts.txt", "--output", "v.jsonl")
    assert ran.code == 0, ran.stderr
    doc = ran.json()  # exactly one document: json.loads refuses anything after it
    assert doc["ok"] is True
    assert (doc["texts"], doc["served"], doc["failed"], doc["written"]) == (12, 12, 0, 12)
    assert doc["output"] == "v.jsonl"
    assert "vectors" not in doc
    assert len(doc["batches"]) == 6
    lines = _lines((workdir / "v.jsonl").read_text())
    assert [line["text"] for line in lines] == TEXTS


@pytest.mark.usefixtures("workdir")
def test_embed_of_many_texts_shows_a_short_table_and_says_where_the_rest_is(
    run_cli: RunCli, tmp_path: Path
) -> None:
    """Plain ``embed --file`` of 30 texts: 20 table rows, then a note naming --output / --jsonl."""
    (tmp_path / "many.txt").write_text("\n".join(f"text {i}" for i in range(30)))
    ran = run_cli("embed", "--file", "many.txt")
    assert ran.code == 0, ran.stderr
    assert "text 19" in ran.stdout
    assert "text 20" not in ran.stdout
    assert "10 more texts not shown: --output FILE or --jsonl" in ran.stderr


@pytest.mark.usefixtures("workdir")
def test_json_with_jsonl_is_refused_as_bad_usage(run_cli: RunCli) -> None:
    """``--json embed --jsonl``: exit 2 and one JSON failure document, before any call."""
    ran = run_cli("--json", "embed", "--file", "texts.txt", "--jsonl")
    assert ran.code == 2
    doc = ran.json()
    assert doc["ok"] is False
    assert doc["error"]["type"] == "UsageError"
    assert "--json --output FILE" in doc["error"]["message"]
    plain = run_cli("ocr", "page.png", "--jsonl", "--json")
    assert plain.code == 2
    assert plain.json()["error"]["type"] == "UsageError"


@pytest.mark.usefixtures("workdir")
def test_an_unwritable_output_fails_before_any_call(run_cli: RunCli) -> None:
    """``--output no/such/dir/x.jsonl``: exit 1, one error line naming the path."""
    ran = run_cli("embed", "--file", "texts.txt", "--output", "no/such/dir/x.jsonl")
    assert ran.code == 1
    assert (
        ran.stderr.strip() == "error: cannot write no/such/dir/x.jsonl: No such file or directory"
    )
    assert ran.stdout == ""


async def _run_cli_async(cwd: Path, *args: str) -> Ran:
    """The CLI in a subprocess while this loop keeps serving the in-process simulator."""
    proc = await asyncio.create_subprocess_exec(
        *cli_command(*args),
        cwd=cwd,
        env=cli_env(),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), timeout=60)
    assert proc.returncode is not None
    return Ran(args, proc.returncode, out.decode(), err.decode())


HALF_503 = FaultProfile(rate_5xx=0.5, statuses_5xx=(503,))
SEED = 3
"""A seed whose first six draws at 50 % hold both served and refused requests."""


async def test_embed_with_failed_batches_still_writes_every_vector_and_exits_1(
    tmp_path: Path,
) -> None:
    """Some batches answered 503 (one attempt each): the others' vectors are written, exit 1."""
    (tmp_path / "texts.txt").write_text("\n".join(TEXTS) + "\n")
    async with SimulatedUpstream({"a": HALF_503}, seed=SEED) as sim:
        (tmp_path / "polygateway.toml").write_text(_config(sim.url, max_attempts=1))
        ran = await _run_cli_async(tmp_path, "embed", "--file", "texts.txt", "-o", "v.jsonl")
        stats = sim.stats("a")
    assert ran.code == 1, ran.stderr
    assert ran.stdout == ""
    lines = _lines((tmp_path / "v.jsonl").read_text())
    assert [line["index"] for line in lines] == list(range(12))
    assert [line["text"] for line in lines] == TEXTS
    ok = [line for line in lines if line["ok"]]
    bad = [line for line in lines if not line["ok"]]
    # What the simulator did, batch for batch (two texts each, one request each).
    assert stats.requests == 6
    assert len(ok) == 2 * stats.by_outcome["ok"]
    assert len(bad) == 2 * stats.by_outcome["5xx"]
    assert ok, "the seed must leave some batches served"
    assert bad, "the seed must fail some batches"
    assert all(len(line["vector"]) > 0 for line in ok)
    assert all(
        line["error"]["batch"] == [line["index"] // 2 * 2, line["index"] // 2 * 2 + 2]
        for line in bad
    )
    first = bad[0]["error"]
    assert first["type"] == "AllSourcesExhausted"
    assert first["reason"] == "retry_exhausted"
    assert f"{len(ok)} vectors of dimension" in ran.stderr
    assert f"{len(bad)} of 12 texts failed" in ran.stderr
    assert "every other vector was written" in ran.stderr
    assert ran.stderr.count("error: ") == 1


async def test_embed_json_failure_document_holds_the_vectors_computed(tmp_path: Path) -> None:
    """``--json embed`` with failed batches: one document, ok false, null where a batch failed."""
    async with SimulatedUpstream({"a": HALF_503}, seed=SEED) as sim:
        (tmp_path / "polygateway.toml").write_text(_config(sim.url, max_attempts=1))
        ran = await _run_cli_async(tmp_path, "--json", "embed", *TEXTS)
        stats = sim.stats("a")
    assert ran.code == 1, ran.stderr
    doc = ran.json()
    assert doc["ok"] is False
    assert doc["error"]["type"] == "AllSourcesExhausted"
    assert doc["error"]["reason"] == "retry_exhausted"
    vectors = doc["vectors"]
    assert len(vectors) == 12
    missing = [i for i, v in enumerate(vectors) if v is None]
    assert missing == [i for a, b in doc["failed_spans"] for i in range(a, b)]
    assert doc["failed"] == len(missing) == 2 * stats.by_outcome["5xx"]
    assert doc["served"] == 12 - len(missing) > 0


# -- ocr --------------------------------------------------------------------------------------


@pytest.mark.usefixtures("workdir")
def test_ocr_of_several_files_prints_each_under_its_name_and_fails_for_the_bad_one(
    run_cli: RunCli,
) -> None:
    """``ocr page.png notes.png doc.pdf``: the two readable files' texts, exit 1 for notes.png."""
    ran = run_cli("ocr", "page.png", "notes.png", "doc.pdf")
    assert ran.code == 1
    headers = [line for line in ran.stdout.splitlines() if line.startswith("==> ")]
    assert headers == ["==> page.png <==", "==> notes.png <==", "==> doc.pdf <=="]
    assert ran.stdout.count("The quick brown fox") == 2
    assert "2 of 3 files read" in ran.stderr
    errors = [line for line in ran.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1
    assert errors[0].startswith("error: notes.png: ")
    assert "not an image" in errors[0]


@pytest.mark.usefixtures("workdir")
def test_ocr_jsonl_gives_one_line_per_file_in_input_order(run_cli: RunCli) -> None:
    """``ocr --jsonl`` over four files, one missing: four lines in order, two failures typed."""
    ran = run_cli("ocr", "doc.pdf", "missing.png", "page.png", "notes.png", "--jsonl")
    assert ran.code == 1
    lines = _lines(ran.stdout)
    assert [(line["index"], line["file"], line["ok"]) for line in lines] == [
        (0, "doc.pdf", True),
        (1, "missing.png", False),
        (2, "page.png", True),
        (3, "notes.png", False),
    ]
    assert lines[0]["source"] == "a"
    assert "The quick brown fox" in lines[2]["text"]
    assert lines[1]["error"]["type"] == "CliError"
    assert lines[3]["error"]["type"] == "RequestRejected"


def test_ocr_layout_output_with_json_prints_one_summary(run_cli: RunCli, workdir: Path) -> None:
    """``--json ocr --layout --output o.jsonl``: blocks in the file, one summary document."""
    ran = run_cli("--json", "ocr", "--layout", "doc.pdf", "page.png", "--output", "o.jsonl")
    assert ran.code == 0, ran.stderr
    doc = ran.json()
    assert doc == {
        "ok": True,
        "files": 2,
        "served": 2,
        "failed": 0,
        "output": "o.jsonl",
        "written": 2,
        "failed_files": [],
    }
    lines = _lines((workdir / "o.jsonl").read_text())
    assert [line["file"] for line in lines] == ["doc.pdf", "page.png"]
    assert all(line["blocks"] and line["markdown"] for line in lines)


# -- progress ---------------------------------------------------------------------------------


def _run_with_tty_stderr(cwd: Path, *args: str) -> tuple[int, str, str]:
    """Run the CLI with stderr on a pseudo-terminal (as a person's shell has it)."""
    leader, follower = os.openpty()
    chunks: list[bytes] = []

    def drain() -> None:
        while True:
            try:
                data = os.read(leader, 4096)
            except OSError:  # the follower side closed: the child is gone
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=drain)
    reader.start()
    try:
        done = subprocess.run(
            cli_command(*args),
            cwd=cwd,
            env=cli_env({"COLUMNS": "100", "TERM": "xterm"}),
            stdout=subprocess.PIPE,
            stderr=follower,
            timeout=60,
            check=False,
        )
    finally:
        os.close(follower)
        reader.join(timeout=10)
        os.close(leader)
    return done.returncode, done.stdout.decode(), b"".join(chunks).decode(errors="replace")


def test_a_progress_bar_shows_on_a_terminal_and_not_in_a_pipe(
    run_cli: RunCli, workdir: Path
) -> None:
    """stderr a terminal: a bar counting 12/12 texts; stderr a pipe: no bar, only the summary."""
    code, stdout, stderr = _run_with_tty_stderr(
        workdir, "embed", "--file", "texts.txt", "-o", "v.jsonl"
    )
    assert code == 0, stderr
    assert stdout == ""
    assert "embed via embed" in stderr
    assert "12/12" in stderr
    piped = run_cli("embed", "--file", "texts.txt", "-o", "v.jsonl")
    assert piped.code == 0
    assert "embed via embed" not in piped.stderr
    assert "12/12" not in piped.stderr
    code, _, stderr = _run_with_tty_stderr(workdir, "ocr", "page.png", "doc.pdf", "-o", "o.jsonl")
    assert code == 0, stderr
    assert "ocr via ocr" in stderr
    assert "2/2" in stderr

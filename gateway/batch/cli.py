"""`python -m gateway.batch.cli`: submit a JSONL file as a batch, follow it, cancel it, fetch its results."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, TextIO

import openai
from openai.types import Batch

from shared.batches import BATCH_ENDPOINTS, ENDED_STATUSES

BAR_WIDTH = 20


class CLIError(Exception):
    """A failure reported as `error: <message>` with exit status 2."""


def parser() -> argparse.ArgumentParser:
    """The argument parser: one subcommand per action, each taking the server's address and key."""
    server = argparse.ArgumentParser(add_help=False)
    server.add_argument("--url", default=os.environ.get("PAGEDSERVE_URL", "http://127.0.0.1:8000"))
    server.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", "unused"))
    top = argparse.ArgumentParser(prog="python -m gateway.batch.cli", description=__doc__)
    commands = top.add_subparsers(dest="command", required=True)
    submit = commands.add_parser(
        "submit", parents=[server], help="upload a JSONL file and create a batch of it"
    )
    submit.add_argument("path", type=Path)
    submit.add_argument("--wait", action="store_true", help="follow the batch and write its results")
    submit.add_argument("--endpoint", choices=BATCH_ENDPOINTS, help="default: the first line's url")
    submit.add_argument("--completion-window", default="24h")
    submit.add_argument("--poll-s", type=float, default=1.0)
    for name, help_text in [("status", "print a batch as JSON"), ("cancel", "cancel a batch")]:
        commands.add_parser(name, parents=[server], help=help_text).add_argument("batch_id")
    results = commands.add_parser("results", parents=[server], help="write the files of an ended batch")
    results.add_argument("batch_id")
    for command in (submit, results):
        command.add_argument("--output", type=Path, help="where the output file goes")
        command.add_argument("--errors", type=Path, help="where the error file goes")
    return top


def default_endpoint(data: bytes) -> str:
    """The first line's "url" when it names an endpoint, else chat completions."""
    try:
        url = json.loads(data.split(b"\n", 1)[0]).get("url")
    except (ValueError, AttributeError):
        return BATCH_ENDPOINTS[0]
    return url if url in BATCH_ENDPOINTS else BATCH_ENDPOINTS[0]


def progress(batch: Batch) -> str:
    """The progress line but for its clock: a bar, the counts and the status."""
    counts = batch.request_counts
    total, ok, failed = (counts.total, counts.completed, counts.failed) if counts else (0, 0, 0)
    filled = BAR_WIDTH * (ok + failed) // total if total else 0
    bar = "#" * filled + "." * (BAR_WIDTH - filled)
    return f"[{bar}] {ok + failed}/{total} done ({ok} ok, {failed} failed) {batch.status}"


def follow(client: openai.OpenAI, batch_id: str, poll_s: float, err: TextIO) -> Batch:
    """Polls the batch until it ends, drawing its progress on err (in place on a terminal)."""
    tty, start, last = err.isatty(), time.monotonic(), ""
    while True:
        batch = client.batches.retrieve(batch_id)
        state = progress(batch)
        line = f"{state} {time.monotonic() - start:.1f} s"
        if tty:
            err.write(f"\r{line}\033[K")
        elif state != last:  # a new line only when more than the clock moved
            err.write(line + "\n")
            last = state
        err.flush()
        if batch.status in ENDED_STATUSES:
            if tty:
                err.write("\n")
            return batch
        time.sleep(poll_s)


def write_results(client: openai.OpenAI, batch: Batch, output: Path, errors: Path, err: TextIO) -> int:
    """Writes an ended batch's files, prints a summary; 0 when it completed, else 1."""
    written = []
    for file_id, path in [(batch.output_file_id, output), (batch.error_file_id, errors)]:
        if file_id:
            path.write_bytes(client.files.content(file_id).content)
            written.append(str(path))
    counts = batch.request_counts
    ok, failed = (counts.completed, counts.failed) if counts else (0, 0)
    files = f"; wrote {', '.join(written)}" if written else ""
    err.write(f"batch {batch.id} {batch.status}: {ok} ok, {failed} failed{files}\n")
    return 0 if batch.status == "completed" else 1


def submit(client: openai.OpenAI, args: argparse.Namespace) -> int:
    """Uploads the file, creates the batch, prints its id; with --wait follows it and writes its results."""
    path: Path = args.path
    try:
        data = path.read_bytes()
    except OSError as e:
        raise CLIError(f"cannot read {path}: {e.strerror or e}") from e
    uploaded = client.files.create(file=(path.name, data), purpose="batch")
    batch = client.batches.create(
        input_file_id=uploaded.id,
        endpoint=args.endpoint or default_endpoint(data),  # type: ignore[arg-type]
        completion_window=args.completion_window,  # type: ignore[arg-type]
    )
    print(batch.id, flush=True)
    if not args.wait:
        return 0
    try:
        batch = follow(client, batch.id, args.poll_s, sys.stderr)
    except KeyboardInterrupt:
        sys.stderr.write(
            f"\nstopped waiting, the batch goes on. See python -m gateway.batch.cli status {batch.id}\n"
        )
        return 130
    output = args.output or path.with_name(f"{path.stem}.output.jsonl")
    errors = args.errors or path.with_name(f"{path.stem}.errors.jsonl")
    return write_results(client, batch, output, errors, sys.stderr)


def status(client: openai.OpenAI, args: argparse.Namespace) -> int:
    """Prints the batch as JSON."""
    print(client.batches.retrieve(args.batch_id).to_json(indent=2))
    return 0


def cancel(client: openai.OpenAI, args: argparse.Namespace) -> int:
    """Cancels the batch and prints the status it moved to."""
    print(client.batches.cancel(args.batch_id).status)
    return 0


def results(client: openai.OpenAI, args: argparse.Namespace) -> int:
    """Writes the files of an ended batch."""
    batch = client.batches.retrieve(args.batch_id)
    if batch.status not in ENDED_STATUSES:
        raise CLIError(f"batch {batch.id} has not ended: it is {batch.status}")
    output = args.output or Path(f"{batch.id}.output.jsonl")
    errors = args.errors or Path(f"{batch.id}.errors.jsonl")
    return write_results(client, batch, output, errors, sys.stderr)


def error_message(error: openai.APIError) -> str:
    """The server's own message when the body carries one, else the client's."""
    body: Any = error.body
    if isinstance(body, dict) and isinstance(body.get("message"), str):
        return str(body["message"])
    return error.message


def main(argv: list[str] | None = None) -> int:
    """Runs one subcommand; the exit status."""
    args = parser().parse_args(argv)
    client = openai.OpenAI(base_url=f"{args.url.rstrip('/')}/v1", api_key=args.api_key)
    command = {"submit": submit, "status": status, "cancel": cancel, "results": results}[args.command]
    try:
        return command(client, args)
    except CLIError as e:
        message = str(e)
    except openai.APIError as e:
        message = error_message(e)
    print(f"error: {message}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())

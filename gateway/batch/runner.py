"""Running a batch, one slice at a time: read its file, run its lines with a bound on those in flight, and end
it (completed, cancelled or expired) with its output and error files.

A Celery task runs one slice: at most BATCH_SLICE_S of feeding lines, then up as long again for the lines in
flight to finish, so a task always ends well within the broker's visibility timeout (a task still running
then would be delivered twice). The task then queues the next slice (gateway.batch.worker), which attaches to
any line still in flight. One slice runs a batch at a time: it holds the batch's lease, renewed every second;
a task that finds the lease held by another waits its turn.
"""

from __future__ import annotations

import json
import logging
import time
from collections import Counter, deque
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Literal

import redis

from gateway.batch.lines import Line, LineContext, LineRun, is_success
from gateway.serving.batch_files import FileStore, custom_id_of, read_lines
from gateway.serving.batch_records import BatchRecord
from shared.errors import CodedError, ErrorCode
from shared.streams import Lease

logger = logging.getLogger(__name__)

Outcome = Literal["ended", "handover", "busy", "gone"]
LEASE_S = 10.0
# How often the run looks at the batch's record (cancel) and renews its lease.
POLL_S = 0.5
MAX_LINE_CRASHES = 3


def read_batch_lines(files: FileStore, file_id: str) -> list[Line]:
    return [Line(n, raw, custom_id_of(raw)) for n, raw in enumerate(read_lines(files.open(file_id)), 1)]


class BatchRunner:
    """Runs slices of batches in one batch worker process."""

    def __init__(self, ctx: LineContext, files: FileStore, *, lines_in_flight: int, slice_s: float) -> None:
        self._ctx = ctx
        self._store = ctx.store
        self._files = files
        self._lines_in_flight = lines_in_flight
        self._slice_s = slice_s

    def run(self, batch_id: str) -> Outcome:
        """One slice of the batch: "ended" when it has ended (or had), "handover" when a next slice must go
        on, "busy" when another run holds the batch, "gone" when there is no such batch."""
        record = self._store.get(batch_id)
        if record is None:
            return "gone"
        if record.ended:
            return "ended"
        lease = Lease(self._ctx.client, self._store.keys.batch_lease(batch_id), LEASE_S, holder="batch")
        if not lease.acquire():
            return "busy"
        try:
            return self._run(record, lease)
        finally:
            lease.release()

    def _run(self, record: BatchRecord, lease: Lease) -> Outcome:
        bid = record.id
        try:
            lines = read_batch_lines(self._files, record.spec.input_file_id)
        except FileNotFoundError:
            self.fail(
                bid, ErrorCode.INVALID_REQUEST, f"the input file {record.spec.input_file_id} was deleted"
            )
            return "ended"
        if record.status == "validating":
            self._store.set_total(bid, len(lines))
            self._store.move(bid, {"validating"}, "in_progress")
        reason = self._run_lines(record, lines, lease)
        if reason in ("handover", "lost"):
            return "handover" if reason == "handover" else "busy"
        self._finish(bid, lines, expired=reason == "expire")
        return "ended"

    def _run_lines(self, record: BatchRecord, lines: list[Line], lease: Lease) -> str:
        """Feed the lines not done yet, a bounded number at a time, until all are done or the run must stop:
        why it stopped: "done", "cancel", "expire", "handover" or "lost" (the lease went to another run)."""
        bid, endpoint = record.id, record.spec.endpoint
        done = self._store.done_ids(bid)
        todo = deque(line for line in lines if line.key not in done)
        stopping: list[str] = []  # what the lines in flight are told (stop() reads it from their threads)
        in_flight: dict[Future[str], Line] = {}
        crashes: Counter[str] = Counter()
        started = time.monotonic()
        reason = "done"
        with ThreadPoolExecutor(self._lines_in_flight, thread_name_prefix=f"batch-{bid[-8:]}") as pool:
            while todo or in_flight:
                reason = self._stop_reason(record, lease, started)
                if reason in ("cancel", "expire", "lost") or (
                    reason == "handover" and self._drained(started)
                ):
                    stopping.append(reason)  # every line in flight leaves at its next tick
                    break
                while (
                    reason == "done" and todo and len(in_flight) < self._lines_in_flight and self._worker_up()
                ):
                    line = todo.popleft()
                    run = LineRun(self._ctx, bid, endpoint, line)
                    in_flight[pool.submit(run.run, lambda: stopping[0] if stopping else None)] = line
                if not in_flight:
                    if reason == "handover":  # every line this slice sent has finished
                        break
                    time.sleep(POLL_S)  # the workers are away: nothing was sent
                    continue
                finished, _ = wait(in_flight, timeout=POLL_S, return_when=FIRST_COMPLETED)
                for future in finished:
                    line = in_flight.pop(future)
                    if self._outcome(bid, future, line, crashes) == "retry":
                        todo.append(line)
            else:
                reason = "done"
        return reason

    def _stop_reason(self, record: BatchRecord, lease: Lease, started: float) -> str:
        if not lease.renew(every_s=1.0):
            return "lost"
        now = time.time()
        latest = self._store.get(record.id)
        if latest is None or latest.status == "cancelling":
            return "cancel"
        if now >= record.spec.expires_at:
            return "expire"
        return "handover" if time.monotonic() - started >= self._slice_s else "done"

    def _drained(self, started: float) -> bool:
        """Past the slice and its time to let lines in flight finish."""
        return time.monotonic() - started >= 2 * self._slice_s

    def _outcome(self, bid: str, future: Future[str], line: Line, crashes: Counter[str]) -> str:
        """What a line's run ended with; one that raised runs again, up to MAX_LINE_CRASHES times, and then
        gets an internal_error in the error file (a bug must not stall its batch)."""
        try:
            return future.result()
        except Exception as e:
            crashes[line.key] += 1
            logger.log(
                logging.WARNING if isinstance(e, redis.RedisError) else logging.ERROR,
                "batch %s, line %d failed (%s, try %d)",
                bid,
                line.number,
                e,
                crashes[line.key],
                exc_info=not isinstance(e, redis.RedisError),
            )
        if crashes[line.key] < MAX_LINE_CRASHES:
            return "retry"
        error = CodedError(ErrorCode.INTERNAL_ERROR, "the request failed on an internal error")
        self._store.record(bid, line.key, line.failure(bid, error), failed=True)
        return "done"

    def _worker_up(self) -> bool:
        """Some model served here has a live worker (a line of a model that has none ends with no_worker)."""
        return any(model.watch.seconds_without_worker() == 0.0 for model in self._ctx.models)

    def _finish(self, bid: str, lines: list[Line], *, expired: bool) -> None:
        """Write the output and error files and end the batch: cancelled when it was being cancelled, expired
        when its window passed, else completed."""
        record = self._store.get(bid)
        cancelling = record is None or record.status == "cancelling"
        if not cancelling and not expired and not self._store.move(bid, {"in_progress"}, "finalizing"):
            cancelling = True  # cancelled meanwhile
        outputs = self._store.done_lines(bid)
        recorded = [outputs[line.key] for line in lines if line.key in outputs]  # in the file's order
        succeeded = [is_success(json.loads(output)) for output in recorded]
        output_id = self._write(bid, "output", [o for o, ok in zip(recorded, succeeded) if ok])
        errors = [o for o, ok in zip(recorded, succeeded) if not ok]
        if expired and not cancelling:
            errors += [_expired(bid, line) for line in lines if line.key not in outputs]
        error_id = self._write(bid, "error", errors)
        files = {"output_file_id": output_id, "error_file_id": error_id}
        files = {k: v for k, v in files.items() if v is not None}
        if cancelling:
            self._store.move(bid, {"cancelling"}, "cancelled", **files)
        else:
            self._store.move(
                bid, {"in_progress", "finalizing"}, "expired" if expired else "completed", **files
            )
        self._store.drop_progress(bid)

    def _write(self, bid: str, kind: str, lines: list[str]) -> str | None:
        """A result file of the batch (None when it would be empty)."""
        if not lines:
            return None
        chunks = (f"{line}\n".encode() for line in lines)
        return self._files.create(f"{bid}_{kind}.jsonl", "batch_output", chunks).id

    def fail(self, bid: str, code: ErrorCode, message: str) -> None:
        """End the batch as failed, with the error that its `errors` shows."""
        errors = {"object": "list", "data": [{"code": str(code), "message": message, "line": None}]}
        self._store.move(bid, {"validating", "in_progress", "cancelling"}, "failed", errors=errors)
        self._store.drop_progress(bid)


def _expired(bid: str, line: Line) -> str:
    message = "the request did not run within the batch's completion window"
    return json.dumps(line.refusal(bid, ErrorCode.BATCH_EXPIRED, message), ensure_ascii=False)

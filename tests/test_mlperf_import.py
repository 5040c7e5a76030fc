"""``mlscope import mlperf`` stores each run once, against a real stack (nats-server and
server as child processes, real LoadGen logs, the CLI run as a user runs it).

A run is its summary and detail logs (``MLPerfImport.identity``): a results tree
imported again, after a run was added or from another path, stores only what it did
not have, answers the rest with the evaluations stored before ("already imported"),
and one changed character in a log is a new run. The outcome is checked where a user
sees it (the command's output, ``mlscope runs``, ``mlscope report``) and in the
database, where the rows themselves are counted without FINAL: a second import must not
have written them again. Two imports of one run at once are taken in turn on a server;
two servers that both store it write one run under one id, which every FINAL read sees
once.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import pytest

from broker import evalstore, mlperf
from broker import mlperf_logs as logs
from broker.db import Database
from broker.mlperf_record import LOG_PART_CHARS
from cli.mlperf_cmd import import_job
from cli.stack import Stack
from mlscope.contracts import EvaluationSummary, JobEvent, JobRequest
from mlscope.errors import EvaluationError
from mlscope.jobs import submit
from mlscope.record import RunRecord
from tests.conftest import running_stack
from tests.test_mlperf import cli, mlscope, query, run_loadgen

pytestmark = pytest.mark.timeout(300)

FRAMEWORK = "mlperf"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """nats-server and the server, no agent: an import needs none (nor a zoo)."""
    zoo = tmp_path_factory.mktemp("no-zoo")
    with running_stack(tmp_path_factory.mktemp("import"), zoo, []) as s:
        yield s


def text_import(stack: Stack, *args: str) -> str:
    return cli(stack, "import", "mlperf", *args)


def json_import(stack: Stack, *args: str) -> list[dict[str, Any]]:
    docs: list[dict[str, Any]] = mlscope(stack, "import", "mlperf", *args)
    return docs


def runs_listed(stack: Stack, model: str) -> list[str]:
    """The evaluation ids ``mlscope runs`` lists for ``model`` (newest first)."""
    out = cli(stack, "runs", "--model", model, "--limit", "100", "--json")
    return [json.loads(line)["evaluation_id"] for line in out.splitlines()]


def reported(stack: Stack, tmp_path: Path, *ids: str) -> dict[str, int]:
    """For each of ``ids``, the most rows naming it in any one table of ``mlscope
    report``'s (1: listed once; 0: not listed)."""
    path = tmp_path / "report.json"
    cli(stack, "report", *ids, "-o", str(path))
    counts = dict.fromkeys(ids, 0)
    for section in json.loads(path.read_text())["sections"]:
        for table in section["tables"]:
            rows = table["rows"]
            if rows and "evaluation_id" in rows[0]:
                for i in ids:
                    counts[i] = max(counts[i], sum(r["evaluation_id"] == i for r in rows))
    return counts


def stored_rows(stack: Stack, ids: list[str]) -> dict[str, tuple[int, int, int]]:
    """Per evaluation: its evaluation rows, log rows and query rows as inserted (no
    FINAL: a second insert shows until the engine merges it away)."""
    out = {}
    for i in ids:
        counts = []
        for table in ("evaluations", "mlperf_logs", "queries"):
            [[n]] = query(
                stack, f"SELECT count() FROM {table} WHERE evaluation_id = {{e:String}}", e=i
            )
            counts.append(int(n))
        out[i] = (counts[0], counts[1], counts[2])
    return out


def test_a_tree_imported_again_stores_each_run_once(stack: Stack, tmp_path: Path) -> None:
    model = "twice_cnn"
    tree = tmp_path / "results" / "testbox" / model
    run_loadgen(tree / "Server" / "performance" / "run_1", "Server", latency_s=0.002)
    run_loadgen(tree / "Offline" / "performance" / "run_1", "Offline", latency_s=0.01)
    results = str(tmp_path / "results")

    first = json_import(stack, results)
    assert [d["import"]["already_imported"] for d in first] == [False, False]
    ids = [d["evaluation_id"] for d in first]
    assert len(set(ids)) == 2
    rows = stored_rows(stack, ids)
    server = next(d for d in first if d["mlperf"]["scenario"] == "Server")
    assert rows[server["evaluation_id"]][2] == server["queries"] > 0  # from its trace

    # Again: the same evaluations, as stored the first time; nothing written.
    again = json_import(stack, results)
    assert [d["evaluation_id"] for d in again] == ids
    assert all(d["import"]["already_imported"] for d in again)
    for before, now in zip(first, again, strict=True):
        assert {k: v for k, v in now.items() if k != "import"} == {
            k: v for k, v in before.items() if k != "import"
        }
        assert now["import"]["source"] == before["import"]["source"]
    text = text_import(stack, results)
    lines = text.splitlines()
    assert len(lines) == 3 and lines[-1] == "0 imported, 2 already imported", text
    for line, i in zip(lines[:-1], ids, strict=True):
        assert line.startswith(i) and line.endswith("already imported"), text
    assert stored_rows(stack, ids) == rows
    assert all(r[0] == 1 for r in rows.values())
    assert sorted(runs_listed(stack, model)) == sorted(ids)
    assert reported(stack, tmp_path, *ids) == dict.fromkeys(ids, 1)

    # A run added to the tree: only it is stored.
    run_loadgen(tree / "SingleStream" / "performance" / "run_1", "SingleStream", latency_s=0.001)
    third = json_import(stack, results)
    added = [d for d in third if not d["import"]["already_imported"]]
    assert len(third) == 3 and len(added) == 1
    assert added[0]["mlperf"]["scenario"] == "SingleStream"
    new_id = added[0]["evaluation_id"]
    assert new_id not in ids
    assert sorted(d["evaluation_id"] for d in third) == sorted([*ids, new_id])
    assert sorted(runs_listed(stack, model)) == sorted([*ids, new_id])
    assert stored_rows(stack, ids) == rows
    assert stored_rows(stack, [new_id])[new_id][0] == 1
    assert reported(stack, tmp_path, *ids, new_id) == dict.fromkeys([*ids, new_id], 1)
    [[total]] = query(
        stack,
        "SELECT count() FROM evaluations WHERE model = {m:String}",
        m=model,
    )
    assert total == 3  # as inserted: no run twice


def test_the_same_logs_elsewhere_are_the_run_stored_and_a_changed_byte_is_not(
    stack: Stack, tmp_path: Path
) -> None:
    model = "moved_cnn"
    run = tmp_path / "results" / "box" / model / "Server" / "performance" / "run_1"
    run_loadgen(run, "Server", latency_s=0.002)
    [stored] = json_import(stack, str(tmp_path / "results"))
    assert not stored["import"]["already_imported"] and stored["host"] == "box"

    # A copy outside the tree, named otherwise: the same run, its first labels kept.
    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    (copy / logs.TRACE).unlink()  # a by-product left out: still the same run
    text = text_import(stack, str(copy), "--model", model, "--system", "rack-9")
    assert text.splitlines()[0].startswith(stored["evaluation_id"]), text
    assert "already imported (as system 'box')" in text, text
    [same] = json_import(stack, str(copy), "--model", model)
    assert same["evaluation_id"] == stored["evaluation_id"] and same["host"] == "box"
    assert same["import"] == {"source": str(copy.resolve()), "already_imported": True}

    # One character changed in the detail log, then in the summary: two new runs.
    ids = {stored["evaluation_id"]}
    for name in (logs.DETAIL, logs.SUMMARY):
        path = copy / name
        text = path.read_text()
        i = next(k for k, c in enumerate(text) if c.isdigit())
        path.write_text(text[:i] + str((int(text[i]) + 1) % 10) + text[i + 1 :])
        [changed] = json_import(stack, str(copy), "--model", model)
        assert not changed["import"]["already_imported"], name
        assert changed["evaluation_id"] not in ids, name
        ids.add(changed["evaluation_id"])
        [again] = json_import(stack, str(copy), "--model", model)
        assert again["evaluation_id"] == changed["evaluation_id"]
        assert again["import"]["already_imported"]
    assert sorted(runs_listed(stack, model)) == sorted(ids)
    rows = stored_rows(stack, sorted(ids))
    assert all(r[0] == 1 for r in rows.values()), rows


def test_two_imports_of_one_run_at_once_store_it_once(stack: Stack, tmp_path: Path) -> None:
    """Submitted together, both jobs run on the server at once (it runs four): one
    stores the run, the other answers with it."""
    run = tmp_path / "box" / "together_cnn" / "Offline" / "performance" / "run_1"
    run_loadgen(run, "Offline", latency_s=0.01)
    jobs = [import_job(run, model=None, framework=FRAMEWORK, system=None) for _ in range(2)]
    got: list[EvaluationSummary] = []
    ended: dict[str, str] = {}  # job -> the job its last event names

    async def both() -> None:
        async def one(job: JobRequest) -> None:
            def heard(event: JobEvent) -> None:
                if event.event == "done":
                    ended[job.job_id] = event.job_id

            got.append(await submit(stack.settings, job, on_event=heard, timeout=120))

        async with anyio.create_task_group() as tg:
            for job in jobs:
                tg.start_soon(one, job)

    anyio.run(both, backend="asyncio")
    assert len({s.evaluation_id for s in got}) == 1
    # Each answer names the job that stored the run: the same one in both.
    assert len({s.job_id for s in got}) == 1 and got[0].job_id in {j.job_id for j in jobs}
    eval_id = got[0].evaluation_id
    assert stored_rows(stack, [eval_id])[eval_id][0] == 1
    assert runs_listed(stack, "together_cnn") == [eval_id]
    # Each job's "done" is its own, though one carries the other job's summary.
    assert ended == {j.job_id: j.job_id for j in jobs}


# ----------------------------------------------------- two servers, one database (chDB)


@dataclass
class _Server:
    """What an import needs of a server (``broker.mlperf.Host``), one per server: its
    own lock, a database it shares with the others."""

    db: Database
    bus: Any = None
    zoo_dir: Path = Path()
    import_lock: anyio.Lock = field(default_factory=anyio.Lock)

    def store_evaluation(
        self, s: EvaluationSummary, rec: RunRecord | None, spec_doc: dict[str, Any]
    ) -> None:
        evalstore.store_evaluation(self.db, s, rec, spec_doc)


def test_two_servers_storing_one_run_keep_it_once(tmp_path: Path) -> None:
    """Two servers that each found no evaluation of a run (they looked at once) both
    store it: under one id, with the same log and query rows, so every read (FINAL)
    sees one run; a third import finds it. Logs stored under the run's id that are not
    its logs are refused, not taken for it."""
    db = Database(f"chdb:///{tmp_path / 'chdb'}")
    db.migrate()
    run = tmp_path / "box" / "raced_cnn" / "Server" / "performance" / "run_1"
    run_loadgen(run, "Server", latency_s=0.002)
    jobs = [import_job(run, model=None, framework=FRAMEWORK, system=None) for _ in range(3)]
    servers = [_Server(db), _Server(db)]
    imp = jobs[0].mlperf_import
    assert imp is not None
    eval_id, identity = imp.evaluation_id(), imp.identity()

    async def race() -> list[EvaluationSummary]:
        out: list[EvaluationSummary] = []

        async def store(server: _Server, job: JobRequest) -> None:
            assert job.mlperf_import is not None
            out.append(
                await mlperf._store_import(server, job, job.mlperf_import, eval_id, identity)
            )

        async with anyio.create_task_group() as tg:
            for server, job in zip(servers, jobs, strict=False):
                tg.start_soon(store, server, job)
        return out

    stored = anyio.run(race, backend="asyncio")
    assert {s.evaluation_id for s in stored} == {eval_id}
    [[inserted]] = db.rows(
        "SELECT count() FROM evaluations WHERE evaluation_id = {e:String}", {"e": eval_id}
    )
    assert inserted == 2  # both stored: what the engine has to fold

    def final(sql: str) -> list[tuple[Any, ...]]:
        return db.rows(sql, {"e": eval_id})

    assert final("SELECT count() FROM evaluations FINAL WHERE evaluation_id = {e:String}") == [(1,)]
    parts = sum(max(1, -(-len(t) // LOG_PART_CHARS)) for t in imp.files.values())
    assert final("SELECT count() FROM mlperf_logs FINAL WHERE evaluation_id = {e:String}") == [
        (parts,)
    ]
    samples = stored[0].queries
    assert samples > 0 and final(
        "SELECT count(), uniqExact(query_index) FROM queries FINAL WHERE evaluation_id = {e:String}"
    ) == [(samples, samples)]
    [[summary]] = final("SELECT summary FROM evaluations FINAL WHERE evaluation_id = {e:String}")
    kept = EvaluationSummary.model_validate_json(summary)
    assert kept.job_id in {s.job_id for s in stored}
    assert kept.latency_ms == stored[0].latency_ms == stored[1].latency_ms

    # A third import, on either server, finds the run and stores nothing.
    found = anyio.run(mlperf.import_logs, servers[0], jobs[2], backend="asyncio")
    assert found.evaluation_id == eval_id and found.job_id == kept.job_id
    [[inserted]] = db.rows(
        "SELECT count() FROM evaluations WHERE evaluation_id = {e:String}", {"e": eval_id}
    )
    assert inserted in (1, 2)  # merged or not; not a third

    # Another run's digest stored under this id (64 bits alike): refused by name.
    other = tmp_path / "other" / "raced_cnn" / "Server" / "performance" / "run_1"
    run_loadgen(other, "Server", latency_s=0.002)
    job = import_job(other, model=None, framework=FRAMEWORK, system=None)
    assert job.mlperf_import is not None
    anyio.run(
        mlperf._store_import,
        servers[1],
        job,
        job.mlperf_import,
        job.evaluation_id(),
        "0" * 64,
        backend="asyncio",
    )
    with pytest.raises(EvaluationError, match="holds other MLPerf logs"):
        anyio.run(mlperf.import_logs, servers[0], job, backend="asyncio")
    db.close()

"""Every benchmark of docs/BENCHMARKS.md, one after the other, with the commands recorded
there (``make bench``).

Each benchmark is its own process (each starts the services it needs on free ports and
stops them), so one that fails does not stop the others; the exit code says whether any
failed. Nothing is asserted: the benchmarks print medians and ratios, and the numbers
are read by a person and copied, with their conditions, into docs/BENCHMARKS.md.

``--quick`` shortens every run (a smoke test of the benchmarks themselves, not numbers
to record). ``--only NAME[,NAME]`` runs a subset. The pipeline and tracing benchmarks load
zoo models: they are built first under ``--zoo`` (default: the data dir's zoo) through
``mlscope zoo build`` (the skeleton benchmark builds its own digits_cnn).

Usage: python bench/run_all.py [--quick] [--only loadgen,pipeline] [--zoo DIR]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# name -> (full arguments, quick arguments, needs the zoo)
BENCHES: dict[str, tuple[list[str], list[str], bool]] = {
    "pacer": (["--runs", "3"], ["--runs", "1"], False),
    "loadgen": (
        ["--qps", "1000", "--duration", "30"],
        [
            "--qps",
            "1000",
            "--duration",
            "3",
            "--burst",
            "10000",
            "--rounds",
            "1",
            "--served-s",
            "2",
        ],
        False,
    ),
    "skeleton": (
        ["--qps", "500", "--duration", "5", "--repeats", "3"],
        ["--qps", "200", "--duration", "2", "--repeats", "1"],
        False,
    ),
    "pipeline": (
        ["--threads", "1"],
        [
            "--threads",
            "1",
            "--frameworks",
            "onnxruntime",
            "--seconds",
            "1",
            "--rounds",
            "1",
            "--queries",
            "300",
        ],
        True,
    ),
    "tracing": (
        ["--spans", "1000000", "--queries", "60"],
        ["--spans", "50000", "--queries", "5"],
        True,
    ),
    "scale": (
        ["--queries", "3000", "--repeat", "3"],
        ["--queries", "500", "--repeat", "1", "--rounds", "20"],
        False,
    ),
    "soak": (["--duration", "1800"], ["--duration", "40", "--run-s", "10"], False),
    "local_stream": (
        [],
        ["--rounds", "1", "--seconds", "0.5", "--cases", "digits_cnn:onnxruntime:32"],
        True,
    ),
    "verdict": ([], ["--sizes", "100000", "--repeat", "1"], False),
}


def build_zoo(zoo: Path) -> None:
    """The zoo models the benchmarks load (idempotent: a built model is only verified)."""
    cmd = [
        sys.executable,
        "-m",
        "cli.main",
        "zoo",
        "build",
        "--zoo-dir",
        str(zoo),
        "--only",
        "digits_cnn",
        "efficientnet_lite0",
    ]
    subprocess.run(cmd, cwd=REPO, env=_env(), check=True)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env["PYTHONUNBUFFERED"] = "1"
    return env


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="short runs: a smoke test")
    ap.add_argument("--only", default=",".join(BENCHES), help="comma-separated names")
    ap.add_argument(
        "--zoo",
        type=Path,
        default=None,
        help="zoo directory (default: $MLSCOPE_DATA_DIR/zoo or ~/.mlscope/zoo)",
    )
    args = ap.parse_args()
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = sorted(set(names) - set(BENCHES))
    if unknown:
        ap.error(f"unknown benchmark(s) {unknown}; known: {', '.join(BENCHES)}")
    zoo = args.zoo or Path(os.environ.get("MLSCOPE_DATA_DIR", Path.home() / ".mlscope")) / "zoo"
    if any(BENCHES[n][2] for n in names):
        build_zoo(zoo)
    failed: list[str] = []
    for name in names:
        full, quick, needs_zoo = BENCHES[name]
        cmd = [
            sys.executable,
            str(REPO / "bench" / f"bench_{name}.py"),
            *(quick if args.quick else full),
        ]
        if needs_zoo:
            cmd += ["--zoo", str(zoo)]
        print(f"\n=== {name}: {' '.join(cmd[1:])}", flush=True)
        start = time.monotonic()
        rc = subprocess.run(cmd, cwd=REPO, env=_env()).returncode
        print(f"=== {name}: rc={rc} in {time.monotonic() - start:.0f} s", flush=True)
        if rc != 0:
            failed.append(name)
    if failed:
        print(f"\nfailed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

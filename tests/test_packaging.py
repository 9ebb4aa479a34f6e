"""What a user installs: the wheel holds the library (its Lua scripts too) and nothing else at
the top level of site-packages, and works from there, away from the source tree."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import uuid
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIBRARY = ("eventstore", "projections", "adapters")

# Run from the installed files only: the source tree is not on the path (cwd is elsewhere and
# the editable install's finder is not consulted: -S skips site-packages, so the dependencies
# come from PYTHONPATH's second entry, this venv's own site-packages).
_USE = """
import asyncio, json, sys
import eventstore, projections, adapters
from adapters import ThreadStore

async def main(url: str, namespace: str) -> None:
    async with await eventstore.connect(url, namespace=namespace) as store:
        threads = ThreadStore(store)
        await threads.append_message("t", {"role": "user", "content": "from the wheel"})
        listed = await threads.list_messages("t")
        print(json.dumps({
            "files": [m.__file__ for m in (eventstore, projections, adapters)],
            "texts": [m.message.text for m in listed],
        }))

asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


def test_the_wheel_holds_the_library_and_runs_from_it(tmp_path: Path, redis_url: str) -> None:
    source = tmp_path / "src"  # built from a copy: a build writes build/ and egg-info beside it
    source.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE", "threadlog_cli.py"):
        shutil.copy(ROOT / name, source / name)
    for package in (*LIBRARY, "bench"):
        skip = shutil.ignore_patterns("__pycache__")
        shutil.copytree(ROOT / package, source / package, ignore=skip)
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "--no-index", "-w", str(tmp_path / "dist"), str(source)],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert built.returncode == 0, built.stderr
    # setuptools ships a directory it was not told about only with a warning that it will stop.
    assert "absent from the `packages` configuration" not in built.stderr, built.stderr
    (wheel,) = (tmp_path / "dist").glob("threadlog-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {name.split("/", 1)[0] for name in names}
    top = {name for name in tops if not name.endswith(".dist-info")}
    # Not bench/ (a top-level 'bench' would shadow a user's own), not tests/.
    assert top == {*LIBRARY, "threadlog_cli.py"}, top
    lua = sorted(p.name for p in (ROOT / "eventstore" / "lua").glob("*.lua"))
    assert sorted(n.rsplit("/", 1)[1] for n in names if n.startswith("eventstore/lua/")) == lua
    assert "eventstore/py.typed" in names and "projections/py.typed" in names
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "threadlog = threadlog_cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()

    site = tmp_path / "site"
    installed = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
         "--target", str(site), str(wheel)],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert installed.returncode == 0, installed.stderr
    here = [p for p in sys.path if p.endswith("site-packages")]
    run = subprocess.run(
        [sys.executable, "-S", "-c", _USE, redis_url, "w" + uuid.uuid4().hex[:12]],
        cwd=tmp_path,
        env={"PYTHONPATH": ":".join([str(site), *here]), "PATH": "/usr/bin:/bin"},
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    shown = json.loads(run.stdout)
    assert all(f.startswith(str(site)) for f in shown["files"]), shown
    assert shown["texts"] == ["from the wheel"]

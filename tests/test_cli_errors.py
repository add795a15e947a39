"""User errors of `anchorkv bench` and `anchorkv demo` found up front as one or two lines (never
a traceback, never after the work), and a closed stdout pipe (`anchorkv ls --json | head -1`)
that ends the command quietly."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

from anchorkv.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[1]
#: A bench that would run quickly (one suite, no benchmark selected, no fidelity study).
TINY_BENCH = ("bench", "--tiny", "--no-fidelity", "--suite", "codec", "-k", "zzz")


def anchorkv(*argv: str, cwd: Path = ROOT, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "anchorkv", *argv], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout)


# ----------------------------------------------------------------------------- bench --out


@pytest.mark.parametrize("sub", ["", "sub"], ids=["file", "under-a-file"])
def test_bench_out_that_is_a_file_fails_before_running(tmp_path, sub):
    """`--out FILE` (or a path under a file) is refused before any suite runs, as one line."""
    (tmp_path / "somefile").write_text("not a directory\n")
    out = tmp_path / "somefile" / sub if sub else tmp_path / "somefile"
    res = anchorkv(*TINY_BENCH, "--out", str(out))
    assert res.returncode == 2, (res.stdout, res.stderr)
    assert "Traceback" not in res.stderr and "Error:" not in res.stderr, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("anchorkv bench: --out: expected a directory"), lines[0]
    assert "found a file" in lines[0] and str(tmp_path / "somefile") in lines[0], lines[0]
    assert "suite codec" not in res.stdout, f"the bench ran before the check:\n{res.stdout}"
    assert (tmp_path / "somefile").read_text() == "not a directory\n"


def test_bench_relative_out_is_relative_to_the_callers_directory(tmp_path):
    """`anchorkv bench` runs in the checkout; a relative `--out` still names a path under the
    directory it was called from. (The name is a file both here and in the checkout, so the
    up-front check names which one was meant, and nothing runs or is written either way.)"""
    assert (ROOT / "pyproject.toml").is_file()
    (tmp_path / "pyproject.toml").write_text("mine\n")
    res = anchorkv(*TINY_BENCH, "--out", "pyproject.toml", cwd=tmp_path)
    assert res.returncode == 2, (res.stdout, res.stderr)
    assert repr(str(tmp_path / "pyproject.toml")) in res.stderr, res.stderr
    assert repr(str(ROOT / "pyproject.toml")) not in res.stderr, res.stderr


def test_out_dir_resolves_against_the_caller(tmp_path, monkeypatch):
    from benchmarks.run import out_dir

    monkeypatch.chdir(tmp_path)
    assert out_dir(None) is None
    assert out_dir("rel") == str(tmp_path / "rel")  # `python -m benchmarks.run`: this directory
    assert out_dir("rel", "/elsewhere") == "/elsewhere/rel"  # `anchorkv bench`: the caller's
    assert out_dir(str(tmp_path / "abs"), "/elsewhere") == str(tmp_path / "abs")


# ----------------------------------------------------------------------------- demo


def _demo_parse_error(capsys, *argv: str) -> str:
    """The parser's error for `anchorkv demo ARGV` (it must refuse them: exit status 2)."""
    with pytest.raises(SystemExit) as exc:
        build_parser("demo").parse_args(["demo", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


@pytest.mark.parametrize("sub", ["", "sub"], ids=["file", "under-a-file"])
def test_demo_store_that_is_a_file_is_refused_at_parsing(tmp_path, capsys, sub):
    """`demo --store FILE` fails at once naming --store (not after a minute of work, in the
    connector's words); a directory or a path that does not exist yet is fine."""
    (tmp_path / "afile").write_text("x")
    store = tmp_path / "afile" / sub if sub else tmp_path / "afile"
    line = _demo_parse_error(capsys, "--store", str(store))
    assert line.startswith("anchorkv demo: error: argument --store: expected a directory"), line
    assert "found a file" in line and str(tmp_path / "afile") in line, line
    assert "kv_connector_extra_config" not in line
    parse = build_parser("demo").parse_args
    assert parse(["demo", "--store", str(tmp_path)]).store == str(tmp_path)
    assert parse(["demo", "--store", str(tmp_path / "new" / "dir")]).store == str(tmp_path / "new" / "dir")
    assert parse(["demo"]).store is None


@pytest.mark.parametrize("seed", ["99999999999999999999999", str(2**63), "-1", "x"])
def test_demo_seed_out_of_range_is_refused_at_parsing(capsys, seed):
    """`--seed` is checked by the parser, naming the option and its range; the range's ends run."""
    line = _demo_parse_error(capsys, "--seed", seed)
    assert line == (f"anchorkv demo: error: argument --seed: expected an integer from 0 to {2**63 - 1} "
                    f"(2**63-1), found {seed!r}"), line
    parse = build_parser("demo").parse_args
    assert parse(["demo", "--seed", "0"]).seed == 0
    assert parse(["demo", "--seed", str(2**63 - 1)]).seed == 2**63 - 1
    assert parse(["demo"]).seed == 0


@pytest.mark.parametrize("option", ["--store", "--out"])
def test_a_path_that_cannot_be_checked_is_refused_as_one_line(tmp_path, capsys, option):
    """A name too long to look up raised OSError at argument parsing: a traceback."""
    path = str(tmp_path / ("a" * 300) / "x")
    if option == "--store":
        line = _demo_parse_error(capsys, "--store", path)
        assert line.startswith("anchorkv demo: error: argument --store: cannot use") and "name another path" in line
    else:
        res = anchorkv(*TINY_BENCH, "--out", path)
        assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
        assert "--out: cannot use" in res.stderr and "name another path" in res.stderr, res.stderr


# ----------------------------------------------------------------------------- closed stdout


@pytest.fixture
def store(tmp_path) -> str:
    from anchorkv.store.store import Store

    path = tmp_path / "store"
    with Store.open(path):
        pass
    return str(path)


@pytest.mark.parametrize("argv", [("ls", "--json"), ("ls",), ("verify",), ("stats",)])
def test_closed_stdout_pipe_ends_quietly(store, argv):
    """`anchorkv ls --json | head -1`: the reader is gone before the output is written. The
    tables too (rich's console exited 1 there, which for `verify` means "damaged entries")."""
    r, w = os.pipe()
    os.close(r)  # no reader: every write to the pipe fails (EPIPE)
    try:
        res = subprocess.run([sys.executable, "-m", "anchorkv", *argv, "--store", store], cwd=ROOT,
                             stdout=w, stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(w)
    assert "Traceback" not in res.stderr and "pipe" not in res.stderr.lower(), res.stderr  # (verify's progress bar)
    assert res.returncode == 141, res.returncode


class _ClosedPipe(io.StringIO):
    def write(self, s: str) -> int:
        raise BrokenPipeError(32, "Broken pipe")


def test_closed_stdout_inside_a_command_ends_quietly(store, capsys, monkeypatch):
    """A write that fails inside the command (store commands report their own OSErrors): quiet too."""
    monkeypatch.setattr(sys, "stdout", _ClosedPipe())
    code = main(["ls", "--store", store, "--json"])
    assert isinstance(sys.stdout, _ClosedPipe)  # restored
    assert capsys.readouterr().err == ""
    assert code in (0, 141)

"""The command line: help, version, options with defaults, one-line errors
(exit 2, no traceback) for bad input and missing optional dependencies,
phase lines instead of a bar off a terminal, and the peer comparison end to
end on small sizes."""

from __future__ import annotations

import io
import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_quick_runs_and_reports_every_measure() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "embstore", "bench", "--quick"],
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    ).stdout
    for measure in ("torch.index_select", "SparseAdam", "new keys", "2 threads", "resident"):
        assert measure in out
    assert "lookup result equal to torch.index_select: True" in out
    # A --quick run is not at the sizes the targets are for: none is judged.
    assert "Targets not judged: they are for vocab 2,000,000" in out
    assert ">= 8x: not judged |" in out
    assert ": met |" not in out
    # The small-call section: a row per key count, and the serving threads.
    for keys in ("| 1 |", "| 16 |", "| 128 |", "| 1,024 |", "| 16,384 |"):
        assert keys in out
    assert "Serving, 128-key lookups (insert=False): 1 thread" in out
    assert "The GIL's bound on this machine, same run: hashlib.sha256" in out
    assert "pure-Python calls (the GIL held throughout" in out
    # The FBGEMM and TorchRec rows: measured where they import, else skipped
    # with the reason.
    for peer in ("FBGEMM CPU table-batched embedding", "TorchRec FusedEmbeddingBagCollection"):
        line = next(x for x in out.splitlines() if x.startswith(peer))
        assert "x embstore's time" in line or "skipped, not importable here (" in line


def bench_json(part: str) -> dict:
    """``python -m embstore bench PART --quick --json``'s result."""
    out = subprocess.run(
        [sys.executable, "-m", "embstore", "bench", part, "--quick", "--json"],
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    ).stdout
    return json.loads(out)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_bags_reports_each_bag_length_and_the_full_step() -> None:
    res = bench_json("--bags")
    assert list(res["per_bag_length"]) == ["1", "4", "26", "100"]
    for per, r in res["per_bag_length"].items():
        assert r["bags"] == res["ids"] // int(per)
        assert min(r["pooled_s"], r["unpooled_s"], r["torch_s"]) > 0
    assert res["step26_ours_s"] > 0
    assert res["step26_torch_s"] > 0


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_readers_reports_plain_and_lru_tables_beside_each_writer() -> None:
    res = bench_json("--readers")
    rows = ["alone"] + [f"{w}_table_writer{s}" for s in ("", "_lru") for w in ("other", "same")]
    for name in rows:
        assert res[name]["calls"] > 0, name
        assert res[name]["p99_us"] > 0, name
        assert (res[name]["writer_steps"] > 0) == (name != "alone"), name
    for s in ("", "_lru"):
        same, other = res[f"same_table_writer{s}"], res[f"other_table_writer{s}"]
        assert res[f"p99_ratio_same_to_other{s}"] == same["p99_us"] / other["p99_us"]


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "embstore", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=None if env is None else {**os.environ, **env},
    )


def test_unknown_command_is_refused() -> None:
    proc = cli("frobnicate")
    assert proc.returncode == 2
    assert "usage: python -m embstore" in proc.stderr
    assert "error: unknown command 'frobnicate' (commands: demo, bench" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("flag", ["--help", "-h", "help"])
def test_help_lists_every_command_with_a_line_each(flag: str) -> None:
    proc = cli(flag)
    assert proc.returncode == 0
    for command in ("demo", "bench", "inspect", "cache-curve"):
        line = next(ln for ln in proc.stdout.splitlines() if ln.strip().startswith(command))
        assert len(line.split()) > 3, line  # a description follows the name


def test_no_command_prints_the_help_and_exits_2() -> None:
    proc = cli()
    assert proc.returncode == 2
    assert "Commands:" in proc.stderr


@pytest.mark.slow
def test_version() -> None:
    import embstore

    proc = cli("--version")
    assert proc.returncode == 0
    assert proc.stdout.strip() == f"embstore {embstore.__version__}"


def cli_without(module: str, *args: str) -> subprocess.CompletedProcess[str]:
    """The CLI in a process where ``module`` cannot be imported."""
    code = (
        f"import sys; sys.modules[{module!r}] = None\n"
        "from embstore.__main__ import main\n"
        f"sys.exit(main({list(args)!r}))"
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def assert_one_line_error(proc: subprocess.CompletedProcess[str], *words: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("python -m embstore "), lines[0]
    for w in words:
        assert w in lines[0], (w, lines[0])


@pytest.mark.parametrize("command", ["demo", "bench", "inspect", "cache-curve"])
def test_each_command_help_lists_options_with_defaults(command: str) -> None:
    proc = cli(command, "--help")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"usage: python -m embstore {command}")
    assert "``" not in proc.stdout, "raw RST markup in the help"
    lines = proc.stdout.splitlines()
    options = [i for i, ln in enumerate(lines) if ln.strip().startswith("--")]
    assert options
    for i in options:
        # every option has a description, on its own line or the next one
        described = len(lines[i].split()) > 2 or (
            i + 1 < len(lines) and lines[i + 1].startswith(" " * 10)
        )
        assert described, f"{lines[i].split()[0]} has no help"


def test_help_shows_defaults() -> None:
    out = cli("demo", "--help").stdout
    assert "training samples (default: 2000000)" in out
    assert "(default: 4096)" in out
    out = cli("bench", "--help").stdout
    assert "row width (default: 64)" in out


@pytest.fixture
def keys_files(tmp_path: pathlib.Path) -> dict[str, pathlib.Path]:
    files = {
        "float": np.arange(10, dtype=np.float64),
        "empty": np.zeros(0, np.int64),
        "object": np.array([1, "a"], dtype=object),
        "ok": np.arange(100) % 7,
    }
    out = {}
    for name, arr in files.items():
        path = tmp_path / f"{name}.npy"
        np.save(path, arr, allow_pickle=True)
        out[name] = path
    (tmp_path / "text.npy").write_text("not an array")
    out["text"] = tmp_path / "text.npy"
    return out


@pytest.mark.parametrize(
    ("case", "extra", "words"),
    [
        ("float", [], ["keys:", "float64", "expected integer keys"]),
        ("empty", [], ["keys:", "no keys"]),
        ("object", [], ["keys:", "cannot read"]),
        ("text", [], ["keys:", "cannot read"]),
        ("missing", [], ["keys:", "No such file"]),
        ("ok", ["--sizes", "0"], ["--sizes", "expected an integer >= 1, got 0"]),
        ("ok", ["--sizes", "1.5"], ["--sizes", "expected an integer >= 1, got '1.5'"]),
        ("ok", ["--sizes"], ["--sizes", "expected at least one argument"]),
        ("ok", ["--png", "/nonexistent-dir/x.png"], ["--png", "does not exist"]),
    ],
)
def test_cache_curve_bad_input_is_one_line_exit_2(
    keys_files: dict[str, pathlib.Path], case: str, extra: list[str], words: list[str]
) -> None:
    path = keys_files.get(case, pathlib.Path("/nonexistent/keys.npy"))
    assert_one_line_error(cli("cache-curve", str(path), *extra), *words)


def test_cache_curve_share_of_keys_never_exceeds_100_percent(
    keys_files: dict[str, pathlib.Path],
) -> None:
    proc = cli("cache-curve", str(keys_files["ok"]), "--sizes", "3", "7", "1000")
    assert proc.returncode == 0, proc.stderr
    rows = [ln.split() for ln in proc.stdout.splitlines()[2:]]
    assert [r[1] for r in rows] == ["42.857%", "100.000%", "100.000%"]


def test_png_without_matplotlib_is_refused_before_any_work(
    keys_files: dict[str, pathlib.Path], tmp_path: pathlib.Path
) -> None:
    proc = cli_without(
        "matplotlib", "cache-curve", str(keys_files["ok"]), "--png", str(tmp_path / "c.png")
    )
    assert_one_line_error(proc, "--png needs matplotlib", "pip install matplotlib")
    assert proc.stdout == ""  # the table was not printed first


def test_demo_torch_without_torch_is_refused_before_any_work() -> None:
    proc = cli_without("torch", "demo", "--torch")
    assert_one_line_error(proc, "--torch needs torch", "pip install torch")
    assert proc.stdout == ""


def test_bench_without_torch_is_refused_before_any_work() -> None:
    proc = cli_without("torch", "bench", "--quick")
    assert_one_line_error(proc, "the peer comparison needs torch", "pip install torch")


@pytest.mark.parametrize("flag", ["--samples=0", "--batch=-3", "--k=x"])
def test_demo_bad_option_is_one_line_exit_2(flag: str) -> None:
    assert_one_line_error(cli("demo", flag), flag.split("=")[0], "expected an integer >= 1")


def test_inspect_of_a_non_checkpoint_is_one_line_exit_2(tmp_path: pathlib.Path) -> None:
    assert_one_line_error(cli("inspect", str(tmp_path / "nope")), "not a directory")
    assert_one_line_error(cli("inspect", str(tmp_path)), "no manifest.json")


@pytest.mark.timeout(300)
def test_demo_off_a_terminal_prints_phase_lines_and_no_bar() -> None:
    proc = cli("demo", "--samples", "20000", "--test-samples", "5000", "--batch", "2048")
    assert proc.returncode == 0, proc.stderr
    assert "\r" not in proc.stderr, "a progress bar was drawn into a pipe"
    phases = proc.stderr.strip().splitlines()
    assert phases[0].startswith("generating 20,000 training and 5,000 held-out samples")
    assert phases[1].startswith("training: 10 steps of 2,048 samples")
    assert phases[2].startswith("evaluating")
    assert "held-out AUC" in proc.stdout
    quiet = cli("demo", "--samples", "20000", "--test-samples", "5000", "--quiet")
    assert quiet.returncode == 0
    assert quiet.stderr == ""


def test_cache_curve_refuses_a_fifo_and_a_header_larger_than_its_file(
    tmp_path: pathlib.Path,
) -> None:
    """At 7e7142d a FIFO blocked the command and a header claiming 2^40
    rows ended in a traceback."""
    fifo = tmp_path / "keys.npy"
    os.mkfifo(fifo)
    assert_one_line_error(cli("cache-curve", str(fifo)), "keys:", "not a regular file")
    # A directory is named as one (at 0306b22: "[Errno 21] Is a directory: 3").
    assert_one_line_error(cli("cache-curve", str(tmp_path)), "keys:", f"{tmp_path} is a directory")
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        buf, {"descr": "<i8", "fortran_order": False, "shape": (2**40,)}
    )
    huge = tmp_path / "huge.npy"
    huge.write_bytes(buf.getvalue() + bytes(64))
    assert_one_line_error(cli("cache-curve", str(huge)), "keys:", "claims", "bytes")


@pytest.mark.parametrize("flag", ["--publish", "--checkpoint"])
def test_demo_publish_dir_without_a_parent_is_refused_before_any_work(flag: str) -> None:
    proc = cli("demo", flag, "/nonexistent-parent/x")
    assert_one_line_error(proc, flag, "does not exist")
    assert proc.stdout == ""


def test_bench_sizes_that_cannot_fit_are_one_line_exit_2() -> None:
    assert_one_line_error(cli("bench", "--dim", "99999999999"), "--dim", "at most")
    assert_one_line_error(cli("bench", "--dim", "1000000"), "GiB", "available")


def test_demo_checkpoint_dir_that_cannot_be_made_is_refused_before_any_work() -> None:
    """At 0306b22 ``--checkpoint /proc/x`` (its parent exists) failed only
    at the first save, after the data was made and trained on."""
    proc = cli("demo", "--checkpoint", "/proc/embstore-x")
    assert_one_line_error(proc, "--checkpoint", "cannot make the directory")
    assert proc.stdout == ""


@pytest.mark.timeout(120)
def test_an_error_found_mid_run_is_one_line_exit_2(tmp_path: pathlib.Path) -> None:
    """A checkpoint directory the early checks pass whose save fails (its
    manifest's name taken by a directory): before, a traceback and exit 1;
    now the error's message on one line, exit 2 (with --quiet, no phase
    lines beside it), and the traceback on request."""
    ck = tmp_path / "ck"
    (ck / "manifest.json").mkdir(parents=True)
    args = ("demo", "--quiet", "--samples", "5000", "--test-samples", "1000")
    proc = cli(*args, "--checkpoint", str(ck))
    assert_one_line_error(proc, "demo: error:", "cannot publish", "EMBSTORE_TRACEBACK=1")
    shown = cli(*args, "--checkpoint", str(ck), env={"EMBSTORE_TRACEBACK": "1"})
    assert shown.returncode == 1
    assert "Traceback" in shown.stderr
    assert "CheckpointError" in shown.stderr


def test_the_bench_schema_is_a_valid_schema_that_refuses_what_it_should() -> None:
    """The published schema is valid draft 2020-12; a result without its
    machine, with a figure misspelt or a time that is not a number, fails it."""
    jsonschema = pytest.importorskip("jsonschema")
    from embstore.bench import SCHEMA

    schema = json.loads(SCHEMA.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    assert json.loads(cli("bench", "--schema").stdout) == schema
    validator = jsonschema.Draft202012Validator(schema)
    assert not validator.is_valid({})
    errors = {e.message for e in validator.iter_errors({"lookup_s": "fast", "lookup_sec": 1.0})}
    assert "'fast' is not of type 'number'" in errors
    assert any("'lookup_sec' was unexpected" in e for e in errors)
    assert "'machine' is a required property" in errors


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_json_validates_against_the_published_schema() -> None:
    jsonschema = pytest.importorskip("jsonschema")
    from embstore.bench import SCHEMA

    res = json.loads(
        subprocess.run(
            [sys.executable, "-m", "embstore", "bench", "--quick", "--json"],
            check=True,
            capture_output=True,
            text=True,
            timeout=300,
        ).stdout
    )
    jsonschema.validate(res, json.loads(SCHEMA.read_text()))
    assert res["machine"]["simd"] == embstore_simd()
    assert res["machine"]["cores"] == os.cpu_count()


def embstore_simd() -> str:
    import embstore

    return embstore.Table(1).simd

"""`./run test` cannot hide a failure: every suite runs after another one
failed, every test binary of a suite runs after an earlier binary failed,
and the summary names each failing test. Driven through the script's own
run_suites and suite functions, over a small cargo project and a pytest
folder that fail on purpose."""

import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

FAILING_RUST = {
    "Cargo.toml": """
        [package]
        name = "fails_on_purpose"
        version = "0.0.0"
        edition = "2021"
        [lib]
        path = "lib.rs"
        [[test]]
        name = "first"
        path = "first.rs"
        [[test]]
        name = "second"
        path = "second.rs"
        """,
    "lib.rs": "",
    "first.rs": """
        #[test] fn fine() {}
        #[test] fn breaks_first() { assert_eq!(1, 2); }
        """,
    "second.rs": """
        #[test] fn breaks_second() { panic!("second"); }
        #[test] fn fine_too() {}
        """,
}

FAILING_PY = """
    def test_passes():
        pass

    def test_breaks_in_python():
        assert 1 == 2
"""


def write(dir, files):
    for name, text in files.items():
        (dir / name).write_text(textwrap.dedent(text))


@pytest.mark.skipif(shutil.which("cargo") is None, reason="needs cargo")
def test_run_suites_runs_everything_and_names_each_failure(tmp_path):
    rust = tmp_path / "rust"
    rust.mkdir()
    write(rust, FAILING_RUST)
    py = tmp_path / "py"
    (py / "tests").mkdir(parents=True)
    write(py / "tests", {"test_fails.py": FAILING_PY})
    script = f"""
        source {ROOT}/run
        export CARGO_TARGET_DIR={tmp_path}/target
        suite_rusty() {{ (cd {rust} && suite_rust); }}
        suite_py_fake() {{ (cd {py} && suite_py_socket "$@"); }}
        suite_fine() {{ true; }}
        SUITES=("rusty|cargo tests" "py_fake|pytest" "fine|nothing to fail")
        run_suites
    """
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    p = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=600)
    out = p.stdout + p.stderr
    assert p.returncode == 1, out
    # Both test binaries ran although the first had a failure.
    assert "breaks_first" in out and "breaks_second" in out, out
    assert "fine_too" not in p.stdout.split("what failed")[-1]
    summary = p.stdout.split("what failed (each suite's full output is above):")[1]
    assert "2 of 3 suites FAILED: rusty py_fake (passed: fine)" in p.stdout, out
    assert "  breaks_first" in summary, summary
    assert "  breaks_second" in summary, summary
    for binary in ("first", "second"):
        assert re.search(rf"test binary failed: cargo test (-p fails_on_purpose )?--test {binary}\n", summary), summary
    assert "FAILED tests/test_fails.py::test_breaks_in_python" in summary, summary
    assert "test_passes" not in summary

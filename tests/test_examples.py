"""The examples the docs show are real programs: each page's copy is the same
as its file under examples/ (a page marks it with
``<!-- example: PATH -->`` before the fenced block), and each Python example
runs as printed, in its own processes, and says it checked its bytes. The C
example is compiled and run by the C API's tests
(crates/p2p-capi/cdylib/tests/c_api.rs)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = ["README.md", "docs/CAPI.md", "docs/NIXL.md"]
MARK = re.compile(r"<!-- example: (\S+) -->\n```[a-z]*\n(.*?)```\n", re.S)


def shown_examples():
    """(page, path, text shown) for every marked example of every page."""
    out = []
    for page in PAGES:
        text = (ROOT / page).read_text()
        out += [(page, path, body) for path, body in MARK.findall(text)]
    return out


def test_every_page_shows_its_example():
    found = {path for _, path, _ in shown_examples()}
    assert found == {"examples/quickstart.py", "examples/nixl_write.py", "examples/c/write_notify.c"}


@pytest.mark.parametrize("page,path,body", shown_examples(), ids=lambda v: str(v)[:40])
def test_page_copy_matches_the_file(page, path, body):
    file_text = (ROOT / path).read_text()
    assert body == file_text, (
        f"{page} shows a copy of {path} that differs from the file; "
        "`python tests/test_examples.py --write` copies every example into its page"
    )


def run_example(path, env_extra=None):
    env = dict(os.environ, TCPX_P2P_LOG="error", **(env_extra or {}))
    p = subprocess.run(
        [sys.executable, str(ROOT / path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, f"{path} exited with {p.returncode}:\n{p.stdout}\n{p.stderr}"
    assert "Traceback" not in p.stderr, p.stderr
    return p.stdout


def test_quickstart_runs_as_printed():
    out = run_example("examples/quickstart.py")
    assert "send/recv: 1048576 bytes, checked" in out
    assert "write: 1048576 bytes, checked" in out
    assert out.rstrip().endswith("quickstart: OK")


def test_nixl_example_runs_as_printed():
    pytest.importorskip("numpy")
    try:
        import nixl_cu12  # noqa: F401
    except ImportError:
        pytest.importorskip("nixl_cu13")
    out = run_example("examples/nixl_write.py", {"NIXL_PLUGIN_DIR": ""})
    assert "target: notification b'done'" in out
    assert out.rstrip().endswith("nixl_write: OK")


def write_pages():
    """Copies each marked example's file into its page."""
    for page in PAGES:
        p = ROOT / page
        text = p.read_text()
        new = MARK.sub(lambda m: m.group(0).replace(m.group(2), (ROOT / m.group(1)).read_text()), text)
        if new != text:
            p.write_text(new)
            print(f"updated {page}")


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    write_pages()

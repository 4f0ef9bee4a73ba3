"""benchmarks/uccl_own_tests.sh judges a test by every process it ran: a
child's failure is the test's failure though the parent exits 0 (UCCL's
two-process tests exit 0 whatever their children did)."""

import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import uccl_judge  # noqa: E402


def run_suite(tmp_path, *names):
    env = dict(os.environ)
    # The runner's python3 is this interpreter (the one with tcpx_p2p).
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env["UCCL_TEST_LIMIT"] = "60"
    script = os.path.join(ROOT, "benchmarks", "uccl_own_tests.sh")
    r = subprocess.run(
        ["bash", script, os.path.join(HERE, "uccl_fake"), str(tmp_path), *names],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    lines = {}
    for line in (tmp_path / "summary.txt").read_text().splitlines():
        if not line.startswith(" ") and ": " in line:
            name, verdict = line.split(": ", 1)
            lines[name] = verdict
    return r, lines


def test_a_failed_child_fails_the_test_though_its_parent_exits_0(tmp_path):
    r, got = run_suite(tmp_path, "child_asserts.py", "child_exits_nonzero.py", "children_pass.py")
    assert set(got) == {"child_asserts.py", "child_exits_nonzero.py", "children_pass.py"}, r.stdout
    # What the old runner saw: the parents exited 0.
    assert '"who": "main", "pid"' in (tmp_path / "child_asserts.py.exits").read_text()
    for name in ("child_asserts.py", "child_exits_nonzero.py", "children_pass.py"):
        mains = [x for x in uccl_judge.read_records(str(tmp_path / f"{name}.exits")) if x["who"] == "main"]
        assert [m["exitcode"] for m in mains] == [0], (name, mains)
    a = got["child_asserts.py"]
    assert a.startswith("FAIL") and "exit 1" in a and "traceback" in a, a
    assert "AssertionError: the child's check failed: 45" in (tmp_path / "child_asserts.py.log").read_text()
    n = got["child_exits_nonzero.py"]
    assert n.startswith("FAIL") and "exit 3" in n and "traceback" not in n, n
    p = got["children_pass.py"]
    assert p.startswith("pass") and "2 process(es)" not in p and "3 process(es)" in p, p
    assert r.returncode == 1, r.stdout + r.stderr


def test_the_suite_exits_0_only_when_every_test_passes(tmp_path):
    r, got = run_suite(tmp_path, "children_pass.py")
    assert got["children_pass.py"].startswith("pass"), got
    assert r.returncode == 0, r.stdout + r.stderr


def test_judge_reads_exit_codes_tracebacks_and_missing_records():
    ok = [{"who": "main", "pid": 1, "exitcode": 0}, {"who": "child", "name": "c", "pid": 2, "exitcode": 0}]
    assert uccl_judge.judge(0, "fine\n", ok)[0]
    # A traceback printed by a process that then exited 0 is a failure.
    passed, why = uccl_judge.judge(0, "x\nTraceback (most recent call last):\n  File ...\nValueError: no\n", ok)
    assert not passed and "traceback" in why
    # A killed child (negative exit code) is a failure.
    passed, why = uccl_judge.judge(0, "", ok + [{"who": "child", "name": "k", "pid": 3, "exitcode": -9}])
    assert not passed and "exit -9" in why
    # No record of the test's own process: it never got to the end.
    passed, why = uccl_judge.judge(0, "", ok[1:])
    assert not passed and "no exit record" in why
    passed, why = uccl_judge.judge(124, "", ok)
    assert not passed and "timed out" in why

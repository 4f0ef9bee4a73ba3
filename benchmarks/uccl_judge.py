"""Judges a test script by what every one of its processes did, not by the
exit code of its first process alone. UCCL's two-process tests
(test_engine_send.py, test_engine_metadata.py, ...) start their server and
client with multiprocessing and exit 0 whatever the children did: a child
that dies with an AssertionError leaves the parent's exit code at 0.

    python3 uccl_judge.py run RECORD SCRIPT [ARGS...]
        runs SCRIPT as __main__ (as `python3 SCRIPT ARGS` would; under
        torchrun, once per rank) and appends one JSON line per process to
        RECORD: this process's own exit code, and each multiprocessing
        child's exit code once it has been joined (children join their own
        children the same way, so a fork-started grandchild is recorded too;
        Python joins the children left at exit).
    python3 uccl_judge.py verdict RC LOG RECORD
        prints one line, "pass (...)" or "FAIL (...)", and exits 0 on pass:
        RC (the exit status of the command, 124 = timed out) must be 0,
        RECORD must hold this process's exit and every exit recorded in it
        must be 0, and LOG (the output of all processes) must hold no
        Python traceback and no AssertionError.
"""

import json
import os
import re
import sys

TRACEBACK = re.compile(r"^Traceback \(most recent call last\):|AssertionError", re.M)


def _record(path, entry):
    """One line per process, appended in one write (processes share RECORD)."""
    line = (json.dumps(entry) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def _watch_children(path):
    """Records each multiprocessing child's exit code when it is joined."""
    from multiprocessing import process

    join = process.BaseProcess.join

    def recording_join(self, timeout=None):
        join(self, timeout)
        code = self.exitcode
        if code is not None and not getattr(self, "_judge_recorded", False):
            self._judge_recorded = True
            _record(path, {"who": "child", "name": self.name, "pid": self.pid, "parent": os.getpid(), "exitcode": code})

    process.BaseProcess.join = recording_join


def run(record, script, args):
    import runpy
    import traceback

    _watch_children(record)
    sys.argv = [script] + list(args)
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        if e.code is None:
            code = 0
        elif isinstance(e.code, int):
            code = e.code
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    # Children still running are joined (and so recorded) by multiprocessing
    # at exit; this process's own code is recorded after the script's end.
    rank = os.environ.get("RANK")
    _record(record, {"who": "main", "pid": os.getpid(), "rank": rank, "exitcode": code})
    sys.stdout.flush()
    sys.stderr.flush()
    return code


def judge(rc, log_text, records):
    """(passed, reason) of one test from its command's exit status, its
    output and its processes' exit records."""
    why = []
    if rc == 124:
        why.append("timed out")
    elif rc != 0:
        why.append(f"exit {rc}")
    mains = [r for r in records if r.get("who") == "main"]
    if not mains:
        why.append("no exit record of the test's own process")
    for r in records:
        if r.get("exitcode") != 0:
            who = "process" if r.get("who") == "main" else f"child {r.get('name')}"
            why.append(f"{who} (pid {r.get('pid')}) exit {r.get('exitcode')}")
    hits = TRACEBACK.findall(log_text)
    if hits:
        why.append(f"{len(hits)} traceback/AssertionError line(s) in the output")
    if why:
        return False, "; ".join(why)
    return True, f"{len(records)} process(es), every exit 0, no traceback"


def read_records(path):
    if not os.path.exists(path):
        return []
    out = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                out.append(json.loads(line))
            except ValueError:
                out.append({"who": "unreadable", "exitcode": line})
    return out


def main(argv):
    if len(argv) >= 3 and argv[0] == "run":
        return run(argv[1], argv[2], argv[3:])
    if len(argv) == 4 and argv[0] == "verdict":
        rc, log, record = int(argv[1]), argv[2], argv[3]
        try:
            with open(log, errors="replace") as f:
                text = f.read()
        except OSError:
            text = ""
        ok, reason = judge(rc, text, read_records(record))
        print(f"{'pass' if ok else 'FAIL'} ({reason})")
        return 0 if ok else 1
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

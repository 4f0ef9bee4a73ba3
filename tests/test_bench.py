"""The benchmark tool runs end to end and reports verified rows (host
memory; figures are not asserted — speed is for benchmarks, not tests)."""

import json
import subprocess
import sys


def bench(tmp_path, *args):
    out = tmp_path / "b.json"
    r = subprocess.run(
        [sys.executable, "-m", "tcpx_p2p.bench", "pair", "--iters", "3", "--json", str(out), *args],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    return json.loads(out.read_text()), r.stdout


def test_pair_send_with_reference(tmp_path):
    doc, table = bench(tmp_path, "--sizes", "4K,1M", "--reference")
    rows = doc["rows"]
    assert [r["size"] for r in rows] == [4096, 1 << 20]
    assert all(r["verified"] and "raw_tcp_GBps" in r and "ratio_vs_raw_tcp" in r for r in rows)
    assert "rawTCP" in table and "GB/s" in table


def test_pair_write_kv_blocks(tmp_path):
    doc, _ = bench(tmp_path, "--op", "write", "--kv-blocks", "64", "--block-size", "32K")
    (row,) = doc["rows"]
    assert row["batch"] == 64 and row["verified"]


def test_pairs_single_process(tmp_path):
    doc, _ = bench(tmp_path, "--op", "read", "--sizes", "64K", "--pairs", "2", "--single-process")
    pairs = [r for r in doc["rows"] if r["op"] == "read"]
    total = [r for r in doc["rows"] if r["op"] == "sum"]
    assert sorted(r["pair"] for r in pairs) == [0, 1] and all(r["verified"] for r in pairs)
    assert len(total) == 1 and total[0]["pairs"] == 2

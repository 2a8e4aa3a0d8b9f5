"""``python -m prep.studies.threads``: the expert is timed alone and beside a reader that really reads."""

from __future__ import annotations

import torch

from prep.studies import threads


def test_the_threads_study_times_an_expert_alone_and_beside_a_reader(tmp_path, capsys):
    before = torch.get_num_threads()
    path = tmp_path / "records.bin"
    stride = -(-3 * threads.INTER * threads.HIDDEN * 4 // 4096) * 4096
    path.write_bytes(bytes(stride * threads.RECORDS))
    for check in ("none", "crc32", "xxh3"):
        alone, beside = threads.measure(path, 1, check, n=50)
        assert 0 < alone < 1 and 0 < beside < 1
    torch.set_num_threads(before)
    threads.main(["--dir", str(tmp_path), "--threads", "1"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 1 |")]
    assert [row.split("|")[2].strip() for row in rows] == ["none", "crc32", "xxh3"]
    assert torch.get_num_threads() == before

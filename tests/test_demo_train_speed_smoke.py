"""The demo training-throughput benchmark on its shortest run: every variant takes real steps and
the report holds a row for each, the committed step at exactly 1.00x."""

from __future__ import annotations

from bench.demo_train_speed import VARIANTS, main


def test_every_variant_is_timed_against_the_committed_step(tmp_path) -> None:
    main(["--out", str(tmp_path), "--blocks", "1", "--steps", "1", "--threads", "1"])
    report = (tmp_path / "demo_train_speed.md").read_text()
    rows = [line for line in report.splitlines() if line.startswith("| ") and "x (" in line]
    assert [r.split(" | ")[0][2:] for r in rows] == [v.name for v in VARIANTS]
    assert rows[0].endswith("| 1.00x (1.00-1.00) |")
    rates = [float(r.split(" | ")[1]) for r in rows]
    assert all(rate > 0 for rate in rates)
    assert "Where make train-demo's step spends its operator time" in report

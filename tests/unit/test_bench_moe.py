"""bench.moe on a small shape: three engines, the same tokens grouped or per token."""

from __future__ import annotations

import json

from bench import moe


def test_bench_moe_reports_each_batch_and_checks_the_tokens(default_model, capsys):
    assert moe.main(["--hidden", "128", "--expert-size", "64", "--layers", "2", "--batches", "1,4",
                     "--steps", "2", "--context", "16"]) == 0
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [r["batch"] for r in rows] == [1, 4]
    for row in rows:
        assert row["per_token_over_grouped"] == round(row["per_token_ms"] / row["grouped_ms"], 2)
        assert row["grouped_over_dense"] == round(row["grouped_ms"] / row["dense_ms"], 2)

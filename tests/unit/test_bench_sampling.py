"""``bench.sampling`` times the sampler and torch's multinomial on the same logits and
reports their ratio."""

from __future__ import annotations

import json

from bench.sampling import main


def test_each_row_times_both_draws_and_their_ratio(tmp_path):
    out = tmp_path / "sampling.json"
    assert main(["--batches", "1,4", "--vocabs", "64", "--repeat", "1", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["batch"], r["vocab"]) for r in rows] == [(1, 64), (4, 64)]
    for r in rows:
        assert r["sample_ms"] > 0 and r["multinomial_ms"] > 0
        assert abs(r["ratio_vs_multinomial"] - r["sample_ms"] / r["multinomial_ms"]) < 1e-9

"""`carpool bench soak` in small: a server of two models and a cascade, killed once mid-traffic and started again,
and the ledger's invariants hold (every whole answer billed once, nothing refused or unknown billed, the budget
kept, KV free when idle). The RSS check needs minutes of one server life: not asserted at this length."""

from carpool.bench.soak import soak


def test_a_short_soak_with_a_kill_keeps_the_ledger_invariants(tmp_path):
    report = soak(minutes=0.3, workers=2, kill_every=9, abort_share=0.3, home=tmp_path, batch_lines=3)
    assert report.kills == 1 and report.batch_lines == 3
    assert sum(report.requests.values()) > 0
    assert [v for v in report.violations if not v.startswith("RSS")] == []

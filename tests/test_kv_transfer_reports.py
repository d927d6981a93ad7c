"""Under tensor parallelism a transfer ends when every rank moved its shard: TPTransferReports
holds a rank's early report until the others report too, and fails the transfer if any part failed."""
from rackserve.kv_transfer.base import KVConnectorOutput, TPTransferReports


def test_a_transfer_ends_when_every_rank_reported_it_and_fails_if_any_part_failed():
    reports = TPTransferReports(world_size=2)
    out = reports.combine([KVConnectorOutput(finished_recving={"a", "b"}, finished_sending={"p"}),
                           KVConnectorOutput(failed_recving={"b"})])
    assert out.finished_recving == set() and out.failed_recving == {"b"} and out.finished_sending == set()
    out = reports.combine([KVConnectorOutput(), KVConnectorOutput(finished_recving={"a"}, finished_sending={"p"})])
    assert out.finished_recving == {"a"} and out.finished_sending == {"p"} and not out.failed_recving
    assert reports.combine([KVConnectorOutput(), KVConnectorOutput()]).is_empty

"""storm/policy.py's Refusals: the reason a put the store refused stays where it is, logged once
per kind of refusal (the Keep reasons of saves are tested through storm.offload in test_hooks.py,
test_hooks_budget.py and test_backend.py)."""

from __future__ import annotations

import logging

from storm.errors import StormRequestError, StormUnavailable
from storm.policy import Keep, Refusals


def test_each_refusal_has_its_reason_and_each_kind_is_logged_once(caplog):
    refusals = Refusals()
    with caplog.at_level(logging.WARNING, logger="storm"):
        reasons = [refusals.reason(StormRequestError(code, "refused"))
                   for code in ("POOL_FULL", "TOO_LARGE", "QUOTA", "POOL_FULL", "BAD_KEY")]
        reasons.append(refusals.reason(StormUnavailable("gone")))
    assert reasons == [Keep.POOL_FULL, Keep.POOL_FULL, Keep.QUOTA, Keep.POOL_FULL, Keep.STORE_ERROR,
                       Keep.STORE_ERROR]
    assert len(caplog.records) == 5  # the second POOL_FULL is not logged again
    assert "pool_size" in caplog.records[0].getMessage()


def test_a_quota_refusal_names_both_settings_that_bound_a_client(caplog):
    """stormd refuses QUOTA past a client's bytes (client_quota) or its tensors (client_max_keys)."""
    with caplog.at_level(logging.WARNING, logger="storm"):
        Refusals().reason(StormRequestError("QUOTA", "refused"))
    assert "client_quota" in caplog.text and "client_max_keys" in caplog.text

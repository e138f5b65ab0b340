#!/usr/bin/env python3
"""Item 11a, the store full: a 1 MiB store (map_size "1MiB", about 1,100
records) and N unique keys (CI 4,000, long 20,000), 16 at a time, with a TTL
of 15 s (long: 40 s). Once full, every new key is answered 503 with
Retry-After (problem+json) and nothing is forwarded, while every stored key
keeps replaying byte for byte. After the records' TTL has elapsed
(purge_interval 1s), purging makes room and new keys succeed again. Every
answered 201 was executed exactly once and is either replayable or logged
"unstored" (README: the result could not be stored)."""

import collections
import time
import unittest

import adv
from adv import harness

TTL_S = adv.scale(short=15.0, long=40.0)


class StoreFullRecovers(adv.AdversarialCase):
    def one(self, proxy, key):
        return adv.timed_request(proxy.port, "POST", "/v1/payments", [
            ("Content-Type", "application/json"), ("Idempotency-Key", key)], harness.PAYMENT_BODY)

    def test_full_store_fails_closed_then_recovers(self):
        n = adv.scale(short=4000, long=20000)
        cfg = self.config(routes=[self.route(ttl="%gs" % TTL_S)],
                          store={"map_size": "1MiB", "purge_interval": "1s"},
                          server={"per_ip_connections": 0})
        proxy = self.start_proxy(config=cfg)
        started = time.monotonic()
        failures = []

        keys = ["fill-%d" % i for i in range(n)]
        fill_start = time.monotonic()
        answers = adv.parallel(lambda k: self.one(proxy, k)[0], keys, workers=16)
        fill_s = time.monotonic() - fill_start
        statuses = collections.Counter(getattr(r, "status", "error") for r in answers)
        ok_keys = [k for k, r in zip(keys, answers) if getattr(r, "status", None) == 201]
        full = [r for r in answers if getattr(r, "status", None) == 503]
        for k, r in zip(keys, answers):
            st = getattr(r, "status", None)
            if st == 503:
                if not adv.is_problem(r) or not (r.header("Retry-After") or "").strip().isdigit():
                    failures.append("%s: 503 without problem+json and Retry-After: %s" % (
                        k, adv.short(r)))
            elif st != 201:
                failures.append("%s: %s" % (k, adv.short(r)))
        executed = self.upstream.executions()["by_key"]
        forwarded_503 = [k for k, r in zip(keys, answers)
                         if getattr(r, "status", None) == 503 and executed.get(k)]
        if forwarded_503:
            failures.append("%d keys answered 503 were forwarded: %r" % (
                len(forwarded_503), forwarded_503[:5]))
        twice = [k for k in ok_keys if executed.get(k) != 1]
        if twice:
            failures.append("201 keys not executed exactly once: %r" % twice[:5])
        if not full:
            failures.append("the 1 MiB store never answered 503 in %d keys" % n)
        if fill_s > TTL_S / 2:
            failures.append("filling took %.1fs, too close to the %gs TTL to conclude" % (
                fill_s, TTL_S))

        # Full: a new key is refused, every stored key still replays.
        again_new = self.one(proxy, "new-while-full")[0]
        if getattr(again_new, "status", None) != 503:
            failures.append("new key while full: %s" % adv.short(again_new))
        log = {e["key"]: e["outcome"] for e in proxy.access_log() if e.get("key")}
        before = self.upstream.total()
        replays = adv.parallel(lambda k: self.one(proxy, k)[0], ok_keys, workers=16)
        replayed = 0
        unstored = 0
        for r in replays:
            if getattr(r, "status", None) == 201 and r.replayed:
                replayed += 1
            else:
                unstored += 1
        replay_executions = self.upstream.total() - before
        logged_unstored = sum(1 for o in log.values() if o == "unstored")
        if replay_executions or unstored > logged_unstored:
            failures.append("%d stored keys did not replay (%d executed again; %d logged "
                            "unstored)" % (unstored, replay_executions, logged_unstored))
        rc, doc, _ = adv.check_store(self.store_path)
        if rc != 0:
            failures.append("check-store while full: %r" % doc)
        full_records = doc.get("records")
        elapsed_since_fill = time.monotonic() - fill_start
        if elapsed_since_fill > TTL_S - 1:
            failures.append("replays checked %.1fs after the fill began: TTL %gs too short" % (
                elapsed_since_fill, TTL_S))

        # After the TTL: purging makes room and new keys succeed again.
        deadline = fill_start + TTL_S + 15
        recovered = None
        i = 0
        while time.monotonic() < deadline:
            r = self.one(proxy, "after-ttl-%d" % i)[0]
            i += 1
            if getattr(r, "status", None) == 201:
                recovered = time.monotonic() - fill_start
                break
            if getattr(r, "status", None) != 503:
                failures.append("while waiting for purge: %s" % adv.short(r))
                break
            time.sleep(0.25)
        if recovered is None:
            failures.append("no new key succeeded within TTL + 15 s")
        # Once every fill record is past its TTL (the fill took fill_s), the
        # whole store is purgeable: 200 more new keys must all succeed.
        time.sleep(max(0.0, fill_start + fill_s + TTL_S + 2.0 - time.monotonic()))
        more = adv.parallel(lambda k: self.one(proxy, k)[0],
                            ["after-ttl-more-%d" % j for j in range(200)], workers=16)
        more_ok = sum(1 for r in more if getattr(r, "status", None) == 201)
        if more_ok < 200:
            failures.append("after purge only %d of 200 new keys succeeded" % more_ok)
        rc, doc_after, _ = adv.check_store(self.store_path)
        if rc != 0 or doc_after.get("in_progress"):
            failures.append("check-store after recovery: %r" % doc_after)

        self.summary("store-full",
                     "1 MiB store, %d unique keys in %.1fs: %d stored (201), %d refused 503 "
                     "(Retry-After, none forwarded), other %d; %d records when full; %d/%d stored "
                     "keys replayed while full (%d logged unstored); new keys succeed again %.1fs "
                     "after the fill began (TTL %gs); then %d/200 new keys ok; %.1fs",
                     n, fill_s, statuses.get(201, 0), statuses.get(503, 0),
                     n - statuses.get(201, 0) - statuses.get(503, 0), full_records or 0,
                     replayed, len(ok_keys), logged_unstored, recovered or -1, TTL_S, more_ok,
                     time.monotonic() - started)
        self.assertEqual(failures, [], "\n".join(failures[:30]))


if __name__ == "__main__":
    unittest.main()

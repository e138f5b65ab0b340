#!/usr/bin/env python3
"""A proxy with the native upstream client (the default) never sets up
OpenSSL: the upstream is http:// only, and the store's SHA-256 runs on
OpenSSL's low-level functions, without its provider. Setting OpenSSL up
(libcurl's global init, or an EVP digest fetch) kept ~1.7 MiB more of
libcrypto resident in every process (Debian 12's OpenSSL 3.0). A proxy
with the libcurl client is the control: it does set OpenSSL up, so the
measurement can tell the two apart."""

import re
import unittest

import harness

MAPPING = re.compile(r"^[0-9a-f]+-[0-9a-f]+ ")


def libcrypto_rss_kib(pid):
    total, name = 0, ""
    with open("/proc/%d/smaps" % pid) as f:
        for line in f:
            if MAPPING.match(line):
                fields = line.split()
                name = fields[5] if len(fields) > 5 else ""
            elif line.startswith("Rss:") and "libcrypto" in name:
                total += int(line.split()[1])
    return total


class NativeClientSetsUpNoOpenSSL(harness.ProxyTestCase):
    def resident_after_traffic(self, client):
        cfg = self.config(routes=[self.route()])
        cfg["upstream"]["client"] = client
        proxy = self.start_proxy(config=cfg, name="proxy-" + client)
        # Everything that hashes: a key acquired and completed, then replayed.
        first = self.post(proxy, "openssl-" + client)
        self.assertExecuted(first)
        self.assertReplayOf(self.post(proxy, "openssl-" + client), first)
        return libcrypto_rss_kib(proxy.pid)

    def test_openssl_set_up_only_for_libcurl(self):
        native = self.resident_after_traffic("native")
        libcurl = self.resident_after_traffic("libcurl")
        self.assertGreater(native, 0, "libcrypto is not mapped: the test measures nothing")
        self.assertLess(native + 1024, libcurl, "libcrypto resident, KiB: native %d, libcurl %d"
                        % (native, libcurl))


if __name__ == "__main__":
    unittest.main()

"""The request the upstream receives, byte for byte the same from both
upstream clients (upstream.client "native" and "libcurl"): the request line
with the URL's base path prefixed to the target exactly as the client sent
it, Host as the upstream's own host:port, the forwarded headers in order,
Content-Length as libcurl wrote it (always for POST, PUT and PATCH, even 0;
never for a bodiless GET or DELETE), and no header the client did not send
(no Accept, User-Agent, Expect or Content-Type invented). A host name
upstream ("localhost") has its addresses tried in order;
an IPv6 literal gets its brackets in Host."""

import unittest

import harness

CLIENTS = ("native", "libcurl")


class UpstreamRequestAsSent(harness.ProxyTestCase):
    def start_with(self, client, url=None, path="/"):
        cfg = self.config(routes=[self.route(path="/v1/payments")],
                          upstream_url=url or (self.upstream.url + "/base/"))
        cfg["upstream"]["client"] = client
        return self.start_proxy(config=cfg, name="proxy-" + client)

    def seen(self, proxy, method, target, headers=(), body=b""):
        h = [("X-Test-Fault", "echo-headers")] + list(headers)
        r = proxy.request(method, target, h, body)
        self.assertEqual(r.status, 201, r)
        return [tuple(x) for x in r.json()]

    def exchanges(self, client):
        proxy = self.start_with(client)
        port = self.upstream.port
        out = {}
        out["get"] = self.seen(proxy, "GET", "/v1/other/a%20b?q=x%20y&z=1")
        out["post-empty"] = self.seen(proxy, "POST", "/v1/other/empty")
        out["delete"] = self.seen(proxy, "DELETE", "/v1/other/d")
        out["put"] = self.seen(proxy, "PUT", "/v1/other/p", [("Content-Type", "text/plain")],
                               b"put-body")
        out["keyed"] = self.seen(proxy, "POST", "/v1/payments",
                                 [("Idempotency-Key", "as-sent-" + client),
                                  ("Content-Type", "application/json"), ("X-Empty", ""),
                                  ("Accept-Language", "en")], b'{"a":1}')
        for name, hs in out.items():
            names = [n.lower() for (n, _) in hs]
            self.assertEqual(hs[0], ("Host", "127.0.0.1:%d" % port), (client, name, hs))
            for invented in ("accept", "user-agent", "expect"):
                self.assertNotIn(invented, names, (client, name, hs))
        self.assertNotIn("content-length", [n.lower() for (n, _) in out["get"]])
        self.assertNotIn("content-length", [n.lower() for (n, _) in out["delete"]])
        self.assertNotIn("content-type", [n.lower() for (n, _) in out["post-empty"]])
        self.assertIn(("Content-Length", "0"), out["post-empty"])
        self.assertIn(("Content-Length", "8"), out["put"])
        self.assertIn(("X-Empty", ""), out["keyed"])
        paths = [e["path"] for e in self.upstream.entries()[-5:]]
        self.assertEqual(paths, ["/base/v1/other/a%20b?q=x%20y&z=1", "/base/v1/other/empty",
                                 "/base/v1/other/d", "/base/v1/other/p", "/base/v1/payments"])
        proxy.stop()
        # The keys and the proxies' ports differ; everything else must not.
        for name in out:
            out[name] = [(n, v) for (n, v) in out[name] if n != "Idempotency-Key"]
            self.assertIn(("X-Forwarded-Host", "127.0.0.1:%d" % proxy.port), out[name])
            out[name].remove(("X-Forwarded-Host", "127.0.0.1:%d" % proxy.port))
        return out

    def test_both_clients_send_the_same_request(self):
        native = self.exchanges("native")
        libcurl = self.exchanges("libcurl")
        for name in native:
            self.assertEqual(native[name], libcurl[name], name)

    def test_host_name_upstream(self):
        for client in CLIENTS:
            proxy = self.start_with(client, url="http://localhost:%d" % self.upstream.port)
            hs = self.seen(proxy, "GET", "/v1/other/named")
            self.assertEqual(hs[0], ("Host", "localhost:%d" % self.upstream.port), client)
            proxy.stop()

    def test_ipv6_literal_upstream(self):
        up6 = harness.Upstream(self.workdir, name="upstream6", host="::1").start()
        self.addCleanup(up6.stop)
        for client in CLIENTS:
            proxy = self.start_with(client, url=up6.url + "/v6base")
            hs = self.seen(proxy, "GET", "/v1/other/six?x=1")
            self.assertEqual(hs[0], ("Host", "[::1]:%d" % up6.port), client)
            proxy.stop()


if __name__ == "__main__":
    unittest.main()
